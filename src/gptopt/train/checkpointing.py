"""A training run's checkpoints: its folder while it trains (RunFolder: the mark, the old run --overwrite sets aside
and when it goes or comes back) and its checkpoints (Checkpointer: save, and restore of the one it resumes).

    python -c "from gptopt.train.checkpointing import RunFolder; help(RunFolder)"

What a run keeps when it fails (docs/design.md, "Nothing a user owns is lost"): a checkpoint a run saved is never
deleted because the run failed later. The one exception is a stop's checkpoint (Ctrl-C, SIGTERM) under --overwrite
before any other: it does not retire the old run, so stopping a mistaken --overwrite gives the old run back, in its
place. A run that replaced nothing keeps every checkpoint it saved, however it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors.torch import save as safetensors_bytes

from gptopt import outputs
from gptopt.config import TrainConfig
from gptopt.data.loader import TokenData
from gptopt.data.tokenizer import TOKENIZER, tokenizer_digest
from gptopt.models import checkpoint, hf, lora
from gptopt.models.gpt import GPT
from gptopt.runtime.device import DevicePlan, environment
from gptopt.train import distributed, resume
from gptopt.train.distributed import DistInfo
from gptopt.train.metrics import Progress
from gptopt.train.resume import RUN_ENTRIES, RUN_KIND
from gptopt.train.step import TrainStep
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")


class RunFolder:
    """--output_dir while a run trains in it (rank 0's: it alone writes). `with folder.open():` makes the folder,
    moves the old run --overwrite replaces aside (outputs.Aside) and marks the folder as a run's; retire() lets the
    old run go (the new run has a checkpoint of its own); give_back() puts it back (a stop before that). A failure
    before retire() puts it back too, and takes with it only what the new run wrote."""

    def __init__(self, out: Path, replaced: list[Path]) -> None:
        self.out, self.replaced = out, replaced
        self.aside: outputs.Aside | None = None

    @property
    def replacing(self) -> bool:
        """An old run is still set aside: the new one has saved no checkpoint that retires it."""
        return self.aside is not None and self.aside.folder is not None

    def retire(self) -> None:
        if self.aside is not None:
            self.aside.commit()

    def give_back(self) -> None:
        if self.aside is not None:
            self.aside.rollback()

    @contextlib.contextmanager
    def open(self) -> Iterator[RunFolder]:
        created, marked = not self.out.exists(), outputs.marked_kind(self.out) is not None
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            with outputs.Aside(self.out, self.replaced, RUN_ENTRIES) as self.aside:
                outputs.mark(self.out, RUN_KIND)
                yield self
        except UserError:
            # A refusal found once the run had begun. Before its first checkpoint (the step will not fit,
            # --auto_batch_size found no micro-batch that does) nothing of the run is worth keeping: the folder the
            # run made for itself goes, and a folder the user made is left as it was. After it, the checkpoints stay.
            if not checkpoint.checkpoint_dirs(self.out):
                if created:
                    outputs.remove(self.out)
                elif not marked:
                    outputs.remove(self.out / outputs.OWNER_FILE)
            raise


class Checkpointer:
    """The run's checkpoints: save() (every rank gathers the state, rank 0 writes it, continuing the run's lineage;
    retention keeps --save_total_limit) and restore() of the checkpoint being resumed."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, plan: DevicePlan, data: TokenData, lineage: list[str],
                 folder: RunFolder | None, carried: dict[str, bytes] | None = None) -> None:
        self.cfg, self.info, self.plan, self.data = cfg, info, plan, data
        self.carried = carried or {}  # resume.carried_files: what each checkpoint keeps of the model it began from
        self.out = Path(cfg.output_dir)
        self.lineage = lineage
        self.folder = folder  # rank 0's; None elsewhere

    def restore(self, state: dict[str, Any], raw: GPT, train_step: TrainStep, sharded: bool,
                progress: Progress) -> Progress:
        """The optimizer, GradScaler, RNGs, step and tokens of the checkpoint being resumed (its train state)."""
        if not state:
            return progress
        optimizer, scaler = train_step.optimizer, train_step.scaler
        distributed.load_optimizer_state(raw, optimizer, state["optimizer"], sharded)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        resume.set_rng_state(state["rng"])
        progress.step, progress.tokens_seen = state["step"], state["tokens_seen"]
        progress.train_s = state.get("train_s", 0.0)  # absent from checkpoints of older versions
        progress.first_steps_s = state.get("first_steps_s", 0.0)
        progress.best_val = state.get("best_val_loss")
        done = state.get("target")  # a run resumed after reaching this target does not train on
        progress.target = done if done and done["loss"] == self.cfg.target_loss else None
        if self.info.is_main:  # progress.last_good: the checkpoint resumed, until this run saves one
            log.info(f"resumed from {progress.last_good} at step {progress.step} ({progress.tokens_seen:,} tokens)")
        return progress

    def save(self, progress: Progress, raw: GPT, train_step: TrainStep, sharded: bool, *,
             retire_old: bool = True) -> Path | None:
        """The checkpoint of progress.step; it retires the old run --overwrite set aside unless retire_old is False
        (a stop's checkpoint). Returns its path (on every rank)."""
        optimizer, scaler = train_step.optimizer, train_step.scaler
        model_state, optim_state = distributed.full_state_dicts(raw, optimizer, sharded)
        path = None
        if self.info.is_main:
            train_state = {
                "step": progress.step, "tokens_seen": progress.tokens_seen, "bad_steps": progress.bad_steps,
                "optimizer": optim_state, "scaler": scaler.state_dict() if scaler is not None else None,
                "rng": resume.rng_state(), "world_size": self.info.world_size, "train_s": progress.train_s,
                "first_steps_s": progress.first_steps_s, "best_val_loss": progress.best_val,
                "target": progress.target,
            }
            # The tokenizer travels in the checkpoint (generate and serve prefer that copy); the recorded
            # path is absolute, so even an older reader finds it from any working directory.
            tokenizer = self.data.tokenizer()
            data_dir = Path(self.cfg.data_dir).resolve()
            # data_dir too: compress and bench evaluate on it by default, from whatever folder they run in
            meta = {"environment": environment(self.plan), "train_config": dataclasses.asdict(self.cfg),
                    "data_dir": str(data_dir),
                    **({"tokenizer": str(data_dir / TOKENIZER), "tokenizer_digest": tokenizer_digest(tokenizer)}
                       if tokenizer else {})}
            files = self.carried
            if self.cfg.lora_rank:  # the frozen weights as they were, the adapters beside them (models/lora.py)
                model_state, adapters = lora.split_state(model_state)
                rank, alpha = self.cfg.lora_rank, self.cfg.lora_alpha
                meta["lora"] = {"rank": rank, "alpha": alpha, "targets": list(lora.TARGETS)}
                files = {**files, lora.ADAPTER: safetensors_bytes({k: v.contiguous() for k, v in adapters.items()})}
                with contextlib.suppress(UserError):  # a mix of families maps onto no Hugging Face model
                    tensors, config = hf.peft_adapter(raw.config, adapters, rank, alpha)
                    files[lora.PEFT_WEIGHTS] = safetensors_bytes(tensors)
                    files[lora.PEFT_CONFIG] = (json.dumps(config, indent=2) + "\n").encode()
            path = checkpoint.save_checkpoint(self.out, progress.step, raw.config, model_state, train_state,
                                              meta=meta, keep=self.cfg.save_total_limit, parent=self.lineage,
                                              tokenizer=tokenizer, files=files)
            self.lineage = checkpoint.lineage(path)
            if self.folder is not None and retire_old:
                self.folder.retire()  # the new run has a checkpoint of its own: the old run goes
        distributed.barrier(self.info)
        return path if path is not None else checkpoint.latest_checkpoint(self.out)
