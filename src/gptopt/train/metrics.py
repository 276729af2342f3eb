"""What a run records as it goes: metrics.jsonl and TensorBoard scalars (Metrics), where the run stands
(Progress: what a checkpoint records, and the timings the summary reports), and the eval's text sample.

    python -c "from gptopt.train.metrics import Progress; print(Progress())"
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptopt.infer import chat
from gptopt.infer.generator import Generator
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")


@torch.no_grad()
def sample(model: GPT, plan: DevicePlan, tokenizer: Any, eot_id: int | None, n_tokens: int, seed: int) -> str:
    """A short sample for the eval log: n_tokens (at most the model's context) from a document's start,
    by the Generator (KV cache, prefill + decode) with generate's default sampling. An end-of-text
    does not end it, so early in training, when the model often predicts one, the log still shows text.

    Its own seeded generator draws the tokens, so training's RNG stream is left untouched (exact
    resume depends on it). Runs under the plan's autocast, as training's forward does; the caller
    puts the model back into training mode."""
    start = eot_id if eot_id is not None else 0
    params = SamplingParams(max_new_tokens=n_tokens, seed=seed)
    gen = Generator(model, plan, max_batch_size=1, max_len=min(model.config.block_size, n_tokens + 1))
    with plan.autocast():
        ids = generate(gen, [[start]], params)[0]
    return tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))


@torch.no_grad()
def chat_sample(model: GPT, plan: DevicePlan, tokens: Any, n_tokens: int) -> str:
    """The eval log's sample of chat data: the first val conversation's prompt (its tokens up to the first one the
    loss counts), then the model's greedy reply, up to n_tokens or an end-of-turn (any token the template or the
    tokenizer ends a turn with), as '...END OF THE PROMPT -> REPLY'."""
    ids, mask, pos = tokens.rows("val")
    starts = np.flatnonzero(pos[0, 1:] == 0)  # where the row's second conversation (or its padding) begins
    end = int(starts[0]) + 1 if len(starts) else ids.shape[1]
    supervised = np.flatnonzero(mask[0, :end])
    prompt = [int(t) for t in ids[0, : int(supervised[0]) if len(supervised) else end]]
    tok = tokens.tokenizer()
    # the data folder holds the template's files: its end-of-turn token ends the reply, as serve's would
    stops = chat.end_token_ids([tokens.directory], tok) if tok is not None else ()
    room = model.config.block_size - len(prompt)
    if room < 1:
        return ""
    params = SamplingParams(max_new_tokens=min(n_tokens, room), temperature=0.0, stop_token_ids=stops)
    gen = Generator(model, plan, max_batch_size=1, max_len=min(model.config.block_size, len(prompt) + n_tokens))
    with plan.autocast():
        reply = generate(gen, [prompt], params)[0]
    if tok is None:
        return f"{prompt} -> {reply}"
    asked = tok.decode(prompt, skip_special_tokens=False)
    return f"...{asked[-SAMPLE_PROMPT_CHARS:]} -> {tok.decode(reply, skip_special_tokens=False)}"


SAMPLE_PROMPT_CHARS = 80  # the prompt's end the log shows: the question, not the system prompt before it



class Metrics:
    """metrics.jsonl (one JSON object per logged step or eval) and TensorBoard scalars, rank 0 only."""

    def __init__(self, out: Path, start_step: int, tensorboard: bool) -> None:
        self.path = out / "metrics.jsonl"
        if self.path.exists():  # a resumed run drops records past its checkpoint: they are being redone
            kept = [line for line in self.path.read_text().splitlines() if line and self._step(line) <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.fh = open(self.path, "a")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "logs"), purge_step=start_step or None)
            except ImportError:
                log.info("TensorBoard logs off: pip install 'gptopt[tensorboard]'")

    def _step(self, line: str) -> int:
        try:
            record = json.loads(line)
            step = record.get("step", 0) if isinstance(record, dict) else None
        except ValueError:
            step = None
        if not isinstance(step, int):
            raise UserError(f"{self.path}: a line is not one of gptopt's metrics records ({line[:60]!r}); move the "
                             "file away (the run's checkpoints do not need it) and resume again")
        return step

    def write(self, record: dict[str, Any]) -> None:
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        self.fh.close()
        if self.tb is not None:
            self.tb.close()


@dataclasses.dataclass
class Progress:
    """Where a run stands: what a checkpoint records, and the timings the final summary reports."""

    step: int = 0
    tokens_seen: int = 0
    bad_steps: int = 0  # consecutive non-finite steps
    last_good: Path | None = None  # the newest checkpoint, named when bad steps stop the run
    compile_s: float | None = None  # the first step pays compile / warm-up: kept out of the speed figures
    times: list[float] = dataclasses.field(default_factory=list)  # the later steps' wall times
    waits: list[float] = dataclasses.field(default_factory=list)  # the share of each spent waiting for data
    # Over the whole run, resumed parts included (checkpoints carry them): the steps' wall time (evals and
    # saves left out), the part of it each process's first step took, and the best val loss so far.
    train_s: float = 0.0
    first_steps_s: float = 0.0
    best_val: float | None = None
    target: dict[str, Any] | None = None  # --target_loss: the step it was reached at, and what it took
