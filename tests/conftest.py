"""Shared fixtures for the test suite: the debug preset, seeded RNGs, temporary model dirs, injected
faults (out of memory, NaN loss) and the `--json` line commands print last.

    pytest -q                 # the default suite (no slow, no cuda)
    pytest -q -m slow         # the slow tests
    pytest -q -m cuda         # GPU tests (.ci/gpu_check.sh runs these)
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gptopt import cli
from gptopt.commands import train as train_cmd
from gptopt.config import GPTConfig, TrainConfig, preset
from gptopt.infer.sampling import SamplingParams
from gptopt.models.gpt import GPT
from gptopt.runtime import process

# The suite builds many compiled Generators in one process, as bench does: the decode's graphs add up.
process.allow_recompiles()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def graph_ops(fn: object, x: torch.Tensor) -> tuple[set[str], torch.Tensor]:
    """The functions in the graph that dynamo captures of fn(x) (no inductor: quick), and its output."""
    ops: set[str] = set()

    def backend(gm: torch.fx.GraphModule, _inputs: list[torch.Tensor]) -> object:
        ops.update(getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes
                   if n.op in ("call_function", "call_method"))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend)(x)
    return ops, out


@pytest.fixture(autouse=True)
def _own_signal_handlers() -> Iterator[None]:
    # A test that runs a Trainer installs its stop handlers (the first SIGINT only sets a flag); one that leaves
    # them behind would make a later test's Ctrl-C do nothing: each test gets back the handlers it started with.
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def debug_config() -> GPTConfig:
    return preset("debug")


@pytest.fixture
def debug_model(debug_config: GPTConfig) -> GPT:
    return GPT(debug_config).eval()


@pytest.fixture(scope="session")
def train_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prepared token shards (BPE vocab 320) of a few stdlib modules: real text, ~40k tokens, ~1 s."""
    import sysconfig

    from gptopt.config import PrepareConfig
    from gptopt.data.corpus import tokenize_corpus

    src = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py"):
        (src / f"{name}.txt").write_text((stdlib / name).read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path_factory.mktemp("prepared") / "data"
    tokenize_corpus(PrepareConfig(input=str(src), output_dir=str(out), vocab_size=320, val_fraction=0.3))
    return out


@pytest.fixture(scope="session")
def debug_tokenizer(train_data: Path) -> Tokenizer:
    """train_data's byte-level BPE (vocab 320): multi-byte characters (emoji) span several tokens."""
    from gptopt.data.tokenizer import load_tokenizer

    return load_tokenizer(train_data / "tokenizer.json")


def family_config(family: str, vocab_size: int = 512) -> GPTConfig:
    """The debug preset's size in another family's shape: "gpt2" (the preset itself); "llama" (rotary, RMSNorm,
    SwiGLU, grouped-query attention, no biases, its own head); "qwen3" (the same plus QK-norm, heads sized apart
    from the width and a tied head)."""
    if family == "gpt2":
        return preset("debug", vocab_size=vocab_size)
    qwen = family == "qwen3"
    return GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64, vocab_size=vocab_size, bias=False,
                     positions="rope", rope_theta=5e4, norm="rmsnorm", mlp="swiglu", intermediate_size=96,
                     qk_norm=qwen, head_size=32 if qwen else None, tie_embeddings=qwen)


def make_varied_model(vocab_size: int, family: str = "gpt2") -> GPT:
    """The debug preset (or its size in family_config's family) with wide random weights (std 0.5): its greedy
    text changes from token to token, where GPT-2's 0.02 init makes a random model repeat one token. For
    module-scoped fixtures too."""
    torch.manual_seed(0)
    model = GPT(family_config(family, vocab_size))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
    return model.eval()


FAMILY_SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-6)


def hf_family_model(kind: str, **kw: object) -> torch.nn.Module:
    """A random transformers model of the family: Llama with grouped-query attention and its own head; Qwen3 with
    heads sized apart from the width (as Qwen3-0.6B's) and a tied head."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**{**FAMILY_SMALL, "num_key_value_heads": 2, "rope_theta": 50000.0,
                                          "tie_word_embeddings": False, **kw})
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.Qwen3Config(**{**FAMILY_SMALL, "num_key_value_heads": 2, "head_dim": 32, "rope_theta": 1e6,
                                      "tie_word_embeddings": True, **kw})
    return transformers.Qwen3ForCausalLM(cfg).eval()


# The families' chat templates as their tokenizer_config.json carries them: Llama 3's (its BOS from the
# template, each turn ended by <|eot_id|>), and Qwen3's chat turns with its thinking switch (its tool calls left out).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == "user" and ns.last_query_index == messages|length - 1 %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""
# kind: (template, its special tokens, bos_token, eos_token: the token that ends a turn)
CHAT = {"llama": (LLAMA3_TEMPLATE, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                  "<|begin_of_text|>", "<|eot_id|>"),
        "qwen3": (QWEN3_TEMPLATE, ("<|im_start|>", "<|im_end|>"), None, "<|im_end|>")}


def chat_model_dir(kind: str, tokenizer: Tokenizer, path: Path) -> Path:
    """A Hugging Face directory of the family as a published chat model has it: the tokenizer with the family's
    special tokens (Llama 3's adds its BOS to every text it encodes), tokenizer_config.json with the chat template
    and the end-of-turn token, and random weights wide enough that greedy text changes from token to token."""
    from tokenizers import processors

    template, specials, bos, eos = CHAT[kind]
    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.add_special_tokens(list(specials))
    if bos is not None:
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])])
    # its configs name its own special tokens, as a published model's do (transformers' defaults, 1 and 2, would be
    # ordinary tokens of this tokenizer)
    ends = {"bos_token_id": tok.token_to_id(bos) if bos else None, "eos_token_id": tok.token_to_id(eos)}
    model = hf_family_model(kind, vocab_size=tok.get_vocab_size(), **ends)
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = ends.values()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": eos,
              **({"bos_token": bos} if bos else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.fixture
def varied_model(debug_tokenizer: Tokenizer) -> GPT:
    """make_varied_model sized to debug_tokenizer."""
    return make_varied_model(debug_tokenizer.get_vocab_size())


def exit_status(argv: list[str]) -> int:
    """`gptopt ARGV`'s exit status, whether cli.main returns it or exits (argparse's and the configs' refusals)."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1


# Prompts the Generator's tests decode (test_generate, test_sampling, test_generate_cli): of different lengths, one
# of a single token and one of a token repeated, each within varied_model's vocabulary; and greedy settings.
PROMPTS = [[5, 17, 99, 4, 200, 31, 8], [42], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [120, 3, 64]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


@pytest.fixture(scope="session")
def trained_out(train_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `gptopt train` output dir (2 steps of the debug preset on train_data, ~3 s): what generate and serve load."""
    from gptopt.commands import train as train_cmd
    from gptopt.config import TrainConfig

    out = tmp_path_factory.mktemp("trained") / "out"
    rc = train_cmd.main(TrainConfig(data_dir=str(train_data), output_dir=str(out), preset="debug", seq_len=32,
                                    batch_size=4, max_steps=2, warmup_steps=1, device="cpu", sample_tokens=0,
                                    eval_interval=0, tensorboard=False))
    assert rc == 0
    return out


@pytest.fixture(scope="session")
def model_dir(train_data: Path, debug_tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make_varied_model saved as a gptopt model dir whose meta names its tokenizer, as training
    checkpoints do: what generate and export load. Shared: write outputs elsewhere, never into it."""
    from gptopt.models.checkpoint import save_model

    model = make_varied_model(debug_tokenizer.get_vocab_size())
    return save_model(model, tmp_path_factory.mktemp("model") / "m", {"tokenizer": str(train_data / "tokenizer.json")})


@pytest.fixture
def break_forward(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """break_forward(when, fault="oom"): GPT.forward fails where when(model, idx) holds, as a real device
    would: "oom" raises CUDA's out-of-memory error, "nan" returns a NaN loss. Elsewhere the real forward runs."""
    real_forward = GPT.forward

    def install(when: Callable[[GPT, torch.Tensor], bool], fault: str = "oom") -> None:
        assert fault in ("oom", "nan")

        def forward(self: GPT, idx: torch.Tensor, targets: torch.Tensor | None = None, **kw: Any) -> torch.Tensor:
            if not when(self, idx):
                return real_forward(self, idx, targets, **kw)
            if fault == "oom":
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate 2.00 GiB (injected at batch {idx.size(0)})")
            return real_forward(self, idx, targets, **kw) * float("nan")

        monkeypatch.setattr(GPT, "forward", forward)

    return install


SCRIPT_DIRS = (".ci", "benchmarks")  # the repository's stand-alone scripts: the GPU check; the measurements


def load_script(name: str) -> ModuleType:
    """NAME.py of one of SCRIPT_DIRS as a module (the scripts are not a package), registered under NAME:
    dataclasses resolve their module by name. Its folder goes on sys.path, as running the script puts it
    first there, so the sibling modules it imports (the GPU check's gpu_check_*.py) are found."""
    root = Path(__file__).resolve().parents[1]
    found = [root / d / f"{name}.py" for d in SCRIPT_DIRS if (root / d / f"{name}.py").is_file()]
    assert len(found) == 1, f"{name}.py: want it in exactly one of {', '.join(SCRIPT_DIRS)}, found {found}"
    path = found[0]
    if str(path.parent) not in sys.path:  # last, not first: a script's name must not hide an installed module
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def exact_distribution(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
    """The distribution a row's settings define, computed directly: softmax(logits / T) over the top k (every
    token tied with the k-th kept), then the smallest set of the most likely tokens whose mass reaches top_p (every
    token tied with its last kept), renormalised."""
    x = logits / temperature
    if top_k is not None:
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    p = x.softmax(-1)
    sorted_p = p.sort(descending=True).values
    last = sorted_p[((sorted_p.cumsum(-1) - sorted_p) < top_p).sum().clamp_min(1) - 1]
    q = p.masked_fill(p < last, 0.0)
    return q / q.sum()


def assert_draws_follow(counts: torch.Tensor, want: torch.Tensor) -> None:
    """counts (each token's draws) come from `want`: none outside it, and a chi-square test (p = 0.001) over its
    first 8 tokens one by one and the rest as one cell."""
    n = counts.sum()
    assert counts[want == 0].sum() == 0, (counts.tolist(), want.tolist())
    cells = [*range(8), slice(8, None)] if want[8:].sum() > 0 else list(range(8))
    seen = torch.stack([counts[c].sum() for c in cells])
    expected = torch.stack([want[c].sum() for c in cells]) * n
    live = expected > 0
    chi2 = float(((seen[live] - expected[live]) ** 2 / expected[live]).sum())
    # chi-square's 0.999 quantile for the cells' degrees of freedom (1 to 8)
    limit = {0: 0.0, 1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}
    assert chi2 < limit[int(live.sum()) - 1], (seen.tolist(), expected.tolist())


def last_json_line(stdout: str) -> Any:
    """What a command's `--json` prints: one JSON document on the last line of stdout (raises if not)."""
    return json.loads(stdout.strip().splitlines()[-1])


def split_bytes_per_token(data_dir: Path, split: str = "val") -> float:
    """UTF-8 bytes per token of a prepared split, the plain way: the whole split decoded in one call
    (special tokens skipped), for tests that check bits per byte against it."""
    import numpy as np

    ids = np.fromfile(data_dir / f"{split}.bin", dtype=np.uint16).tolist()
    text = Tokenizer.from_file(str(data_dir / "tokenizer.json")).decode(ids)
    return len(text.encode("utf-8")) / len(ids)


# gptopt train on one CPU process at its quickest: the debug model, no evaluation, every step logged
TRAIN_FAST = dict(preset="debug", seq_len=32, batch_size=4, device="cpu", sample_tokens=0, tensorboard=False,
                  eval_interval=0, log_interval=1, warmup_steps=2)


def train_run(data: Path, out: Path, **kw: Any) -> int:
    """`gptopt train` with TRAIN_FAST and kw, in this process; its exit code."""
    return train_cmd.main(TrainConfig(data_dir=str(data), output_dir=str(out), **{**TRAIN_FAST, **kw}))


def train_records(out: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl, one dict a record."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train_losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in train_records(out) if "loss" in r}


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data_dir", str(data), "--output_dir", str(out), "--preset", "debug", "--seq_len", "32",
            "--batch_size", "4", "--device", "cpu", "--sample_tokens", "0", "--no-tensorboard", "--warmup_steps", "2",
            "--eval_interval", "0", "--log_interval", "1", *extra]  # the same settings as TRAIN_FAST


def eval_samples(out: Path) -> dict[int, str]:
    return {r["step"]: r["sample"] for r in train_records(out) if "sample" in r}


def file_tree(root: Path) -> dict[str, bytes]:
    """Every file under root (relative path -> bytes): what a refused command must leave exactly as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}



_HOLD = """
import sys
from gptopt import outputs
held = outputs.lock_output(sys.argv[1], whole=sys.argv[2] == "whole")  # kept: a collected one lets go
held.__enter__()
print("held", flush=True)
sys.stdin.read()  # until the test lets go (closes stdin) or kills it
"""


@contextlib.contextmanager
def another_writer(out: Path, *, whole: bool = False) -> Iterator[subprocess.Popen[str]]:
    """Another gptopt process holding out's one-writer lock (outputs.lock_output) for the block; killed
    with SIGKILL at the end, as a crash would end it."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(out), "whole" if whole else "in place"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages torch ops allocate while active, and their peak: each storage counted once, until
    no tensor holds it (an op's output that shares an input's storage, in place or a view, allocates nothing).
    What the memory estimates are held to: the tensors' own bytes, not an allocator's or the process's."""

    def __init__(self) -> None:
        super().__init__()
        self.holders: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, key: int, nbytes: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = tree_flatten((args, kwargs))[0]
        inputs = {t.untyped_storage().data_ptr() for t in given if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if key not in self.holders:
                if key in inputs:
                    continue
                self.holders[key] = 0
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            self.holders[key] += 1
            weakref.finalize(t, self._release, key, nbytes)
        return out

def run_chat(argv: list[str], stdin: str, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> tuple[Any, str, str, list[list[int]]]:
    """`gptopt generate --chat ARGV` with STDIN piped in: (exit status, stdout, stderr, each prompt's ids)."""
    from gptopt.commands import generate

    prompts, real_stream = [], generate.stream

    def spy(gen: Any, ids: list[int], params: Any, stepper: Any = None) -> Iterator[int]:
        prompts.append(list(ids))
        return real_stream(gen, ids, params, stepper)

    monkeypatch.setattr(generate, "stream", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    capsys.readouterr()
    try:
        rc = cli.main(["generate", "--chat", "--device", "cpu", "--temperature", "0", *argv])
    except SystemExit as e:  # argparse's and the config's refusals
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err, prompts


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    """Poll instead of sleeping a fixed time: a loaded CI machine only makes this slower, not wrong."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def server(debug_tokenizer: Tokenizer) -> Iterator[tuple[str, Any]]:
    """A live server of the debug model (4 slots, the plain chat template: the documented chat curl), one per test
    module that asks for it: (its url, its app). Modules that need another define their own."""
    from serve_helpers import running  # the serve extra: only modules that use a server import it

    with running(debug_tokenizer, max_batch_size=4, chat_template="plain") as s:
        yield s


@pytest.fixture(scope="module")
def url(server: tuple[str, Any]) -> str:
    return server[0]
