"""The command line: verbs, options from the config dataclasses, TOML configs, errors.

pytest -q tests/test_cli.py
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gptopt import cli
from gptopt.config import DoctorConfig, ProfileConfig, TrainConfig, opt

# The option surface grows only on purpose: a new flag must be added here too.
EXPECTED_OPTIONS = {
    "doctor": {"device", "json", "preset", "seq_len", "smoke"},
    "prepare": {
        "chat_template",
        "format",
        "overlong",
        "seq_len",
        "dataset",
        "dataset_config",
        "dataset_split",
        "input",
        "max_documents",
        "num_workers",
        "output_dir",
        "overwrite",
        "seed",
        "text_field",
        "tokenizer",
        "val_fraction",
        "vocab_size",
        "text_data",
        "text_share",
    },
    "train": {
        "align_documents",
        "amp_dtype",
        "arch",
        "attention",
        "auto_batch_size",
        "batch_size",
        "beta1",
        "beta2",
        "compile",
        "compile_fullgraph",
        "compile_mode",
        "cpu_offload",
        "data_dir",
        "device",
        "dropout",
        "eval_interval",
        "eval_iters",
        "fp8",
        "fsdp",
        "fused_optimizer",
        "grad_clip",
        "gradient_accumulation_steps",
        "gradient_checkpointing",
        "init_from",
        "learning_rate",
        "lora_alpha",
        "lora_rank",
        "log_interval",
        "loss",
        "max_bad_steps",
        "max_steps",
        "max_tokens",
        "lr_decay_steps",
        "min_lr",
        "muon_lr",
        "muon_momentum",
        "num_workers",
        "optimizer",
        "output_dir",
        "overwrite",
        "persistent_workers",
        "pin_memory",
        "prefetch_factor",
        "preset",
        "profile",
        "resume",
        "sample_every",
        "sample_tokens",
        "save_interval",
        "save_total_limit",
        "sdpa_backend",
        "seed",
        "seq_len",
        "tensorboard",
        "target_loss",
        "time_budget",
        "use_amp",
        "vocab_pad_multiple",
        "warmup_steps",
        "weight_decay",
    },
    "bench": {
        "batch_size",
        "batch_sizes",
        "data_dir",
        "device",
        "draft_model",
        "json",
        "loss_tolerance",
        "max_steps",
        "mode",
        "model",
        "num_speculative_tokens",
        "output_dir",
        "overwrite",
        "preset",
        "recipes",
        "rungs",
        "seed",
        "seeds",
        "seq_len",
        "steps",
        "target_loss",
        "temperature",
        "top_k",
        "top_p",
        "warmup",
    },
    "profile": {
        "active",
        "amp_dtype",
        "attention",
        "batch_size",
        "compile",
        "compile_mode",
        "data_dir",
        "device",
        "gradient_checkpointing",
        "json",
        "mode",
        "num_workers",
        "output_dir",
        "overwrite",
        "pin_memory",
        "preset",
        "row_limit",
        "seq_len",
        "use_amp",
        "wait",
        "warmup",
    },
    "generate": {
        "batch_size",
        "chat",
        "chat_template",
        "compile",
        "cuda_graphs",
        "device",
        "draft_model",
        "dtype",
        "input",
        "max_new_tokens",
        "model",
        "num_speculative_tokens",
        "output",
        "overwrite",
        "prefix_cache",
        "prompt",
        "quantize",
        "repetition_penalty",
        "seed",
        "speculate",
        "stop",
        "temperature",
        "tokenizer",
        "top_k",
        "top_p",
    },
    "serve": {
        "api_key",
        "block_size",
        "blocklist",
        "chat_template",
        "compile",
        "cors_origin",
        "cuda_graphs",
        "device",
        "draft_model",
        "dtype",
        "engine_process",
        "host",
        "kv_cache_memory",
        "max_batch_size",
        "max_len",
        "max_logprobs",
        "max_queue",
        "max_tokens_limit",
        "model",
        "model_name",
        "num_speculative_tokens",
        "port",
        "prefill_chunk",
        "prefix_cache",
        "quantize",
        "request_timeout",
        "solo_threads",
        "speculate",
        "speculate_max_batch",
        "stall_timeout",
        "tokenizer",
    },
    "loadtest": {
        "api_key",
        "concurrency",
        "json",
        "max_tokens",
        "model",
        "prompt_tokens",
        "rate",
        "requests",
        "seed",
        "shared_prefix",
        "temperature",
        "timeout",
        "tokenizer",
        "url",
    },
    "compress": {
        "compile",
        "data_dir",
        "device",
        "eval_tokens",
        "json",
        "model",
        "output_dir",
        "overwrite",
        "prune",
        "quantize",
        "repeats",
        "tokenizer",
    },
    "export": {"format", "model", "opset", "output_dir", "overwrite", "tokenizer", "tolerance"},
    "eval": {"batch_size", "data", "device", "dtype", "json", "limit", "model", "output_dir", "overwrite", "task",
             "tokenizer"},
    "tune": {
        "axes",
        "data_dir",
        "device",
        "global_batch_tokens",
        "json",
        "loss_tolerance",
        "memory_budget",
        "output_dir",
        "overwrite",
        "preset",
        "seed",
        "seq_len",
        "steps",
        "time_budget",
        "warmup",
    },
}


def test_help_lists_every_verb(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for verb in cli.COMMANDS:
        assert verb in out


def test_python_dash_m_entry_point_runs() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "gptopt", "--help"], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0
    assert "doctor" in res.stdout


def test_no_arguments_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "commands:" in capsys.readouterr().out


def test_unknown_verb_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


# Old names that keep working (config.opt's aliases), each -> the option it names: pinned as the options are.
EXPECTED_ALIASES = {
    "train": {"model_name": "init_from", "use_compile": "compile"},
    "profile": {"use_compile": "compile"},
    "compress": {"output": "output_dir"},
    "eval": {"output": "output_dir"},
}


@pytest.mark.parametrize("verb", sorted(EXPECTED_OPTIONS))
def test_option_surface_is_pinned(verb: str) -> None:
    cls = cli._load(cli.COMMANDS[verb].config)
    assert {f.name for f, _, _ in cli.cli_fields(cls)} == EXPECTED_OPTIONS[verb]
    assert cli.aliases(cls) == EXPECTED_ALIASES.get(verb, {})
    assert not set(cli.aliases(cls)) & EXPECTED_OPTIONS[verb]  # an old name never shadows another option


def test_every_verb_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for verb in cli.COMMANDS:
        with pytest.raises(SystemExit) as e:
            cli.main([verb, "--help"])
        assert e.value.code == 0
        assert f"gptopt {verb}" in capsys.readouterr().out


def _parse(argv: list[str]) -> DoctorConfig:
    parser = cli.build_parser("doctor", DoctorConfig)
    return cli.parse_config("doctor", DoctorConfig, argv, parser)


def test_defaults_come_from_the_dataclass() -> None:
    assert _parse([]) == DoctorConfig()


def test_toml_config_then_flags_override(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('preset = "debug"\nsmoke = true\n[doctor]\ndevice = "cpu"\n[train]\nbatch_size = 8\n')
    cfg = _parse(["--config", str(path)])
    assert (cfg.preset, cfg.smoke, cfg.device) == ("debug", True, "cpu")
    cfg = _parse(["--config", str(path), "--preset", "tiny", "--no-smoke"])
    assert (cfg.preset, cfg.smoke, cfg.device) == ("tiny", False, "cpu")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--preset", "gpt5"], "unknown preset 'gpt5'"),
        (["--smok"], "unrecognized arguments: --smok"),  # no silent abbreviations
    ],
)
def test_bad_options_exit_2_naming_the_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('presett = "tiny"\n', "unknown option 'presett'"),
        ("smoke = 3\n", "smoke must be bool"),
        ("preset = [\n", "not valid TOML"),
    ],
)
def test_bad_toml_exits_2(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", "--config", str(path)])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_toml_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["doctor", "--config", str(tmp_path / "nope.toml")])
    assert e.value.code == 2
    assert "no such file" in capsys.readouterr().err


def test_int_option_rejects_non_numbers() -> None:
    from dataclasses import dataclass

    from gptopt.config import opt

    @dataclass(kw_only=True)
    class C:
        steps: int = opt(10, "steps")
        lr: float | None = opt(None, "lr")

    parser = cli.argparse.ArgumentParser(argument_default=cli.argparse.SUPPRESS)
    cli.add_options(parser, C)
    assert parser.parse_args(["--steps", "5", "--lr", "none"]).lr is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--steps", "five"])


@dataclass(kw_only=True)
class Renamed:
    compile: bool = opt(False, "compile the model", aliases=("use_compile",))
    output_dir: str = opt("out", "where the files go", aliases=("output",))
    steps: int = opt(10, "steps")


def _parse_renamed(argv: list[str]) -> Renamed:
    parser = cli._Parser(prog="gptopt renamed", argument_default=cli.argparse.SUPPRESS, allow_abbrev=False)
    parser.add_argument("--config")
    cli.add_options(parser, Renamed)
    return cli.parse_config("renamed", Renamed, argv, parser)


def test_an_options_old_name_is_a_flag_of_the_same_option() -> None:
    assert _parse_renamed(["--use_compile", "--output", "o"]) == Renamed(compile=True, output_dir="o")
    assert _parse_renamed(["--compile", "--no-use_compile"]) == Renamed(compile=False)  # the last flag wins


def test_an_options_old_name_is_a_toml_key_of_the_same_option(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text('use_compile = true\n[renamed]\noutput = "o"\n')
    assert _parse_renamed(["--config", str(path)]) == Renamed(compile=True, output_dir="o")
    assert _parse_renamed(["--config", str(path), "--output_dir", "p"]).output_dir == "p"  # flags still override


@pytest.mark.parametrize("text", ['use_compile = true\ncompile = false\n', 'compile = false\nuse_compile = true\n',
                                  '[renamed]\noutput = "a"\noutput_dir = "b"\n'])
def test_a_toml_table_giving_an_option_and_its_old_name_is_refused(
    tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "both.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        _parse_renamed(["--config", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    name, old = ("compile", "use_compile") if "compile" in text else ("output_dir", "output")
    assert len(err.strip().splitlines()) == 1 and f"{name} and {old} are one option" in err


def test_help_names_an_option_before_its_old_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse_renamed(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--compile, --no-compile, --use_compile, --no-use_compile" in out
    assert "--output_dir STR, --output STR" in out


@pytest.mark.parametrize("cls", [TrainConfig, ProfileConfig], ids=["train", "profile"])
def test_use_compile_is_an_old_name_of_compile(cls: type) -> None:
    verb = "train" if cls is TrainConfig else "profile"
    for argv, on in ((["--use_compile"], True), (["--compile"], True), (["--compile", "--no-use_compile"], False)):
        assert cli.parse_config(verb, cls, argv, cli.build_parser(verb, cls)).compile is on


# best.toml as `gptopt bench` wrote it before `use_compile` became `compile` (tune.toml had the same keys)
OLD_BEST_TOML = """# written by `gptopt bench`: the fastest rung whose loss matched the baseline
# gptopt train --config best.toml
preset = "debug"
data_dir = "data/stdlib"
seq_len = 32
batch_size = 4
gradient_accumulation_steps = 1
attention = "eager"
use_amp = true
use_compile = true
compile_mode = "default"
fused_optimizer = true
gradient_checkpointing = false
num_workers = 0
amp_dtype = "bf16"
seed = 1337
"""


def test_a_best_toml_written_before_the_rename_still_trains_compiled(tmp_path: Path) -> None:
    path = tmp_path / "best.toml"
    path.write_text(OLD_BEST_TOML)
    cfg = cli.parse_config("train", TrainConfig, ["--config", str(path)], cli.build_parser("train", TrainConfig))
    assert cfg == TrainConfig(preset="debug", seq_len=32, batch_size=4, attention="eager", use_amp=True, compile=True,
                              num_workers=0, amp_dtype="bf16")


def test_an_internal_error_keeps_its_traceback_and_a_users_is_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A bug (any exception but a UserError) is not dressed as bad input: its traceback, exit 1. What the user
    gave is one line naming the fix, exit 2; GPTOPT_DEBUG keeps that one's traceback too."""
    from gptopt.commands import doctor
    from gptopt.utils.errors import UserError

    monkeypatch.setattr(doctor, "run", lambda cfg: int("not a number"))  # a ValueError of gptopt's own making
    assert cli.main(["doctor"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "invalid literal for int()" in err and "internal error" in err

    def refused(cfg: object) -> int:
        raise UserError("--device cuda: no GPU here; use --device cpu")

    monkeypatch.setattr(doctor, "run", refused)
    assert cli.main(["doctor"]) == 2
    assert capsys.readouterr().err == "gptopt doctor: error: --device cuda: no GPU here; use --device cpu\n"
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(UserError):
        cli.main(["doctor"])


def test_help_says_each_default_once_never_none_and_the_range_of_bounded_options(
        capsys: pytest.CaptureFixture[str]) -> None:
    for verb in cli.COMMANDS:
        with pytest.raises(SystemExit):
            cli.main([verb, "--help"])
        text = " ".join(capsys.readouterr().out.split())  # argparse's wrapping undone
        assert "(default: None)" not in text, verb
        assert not re.search(r"default: [^()]*\) \(default:", text), verb  # the help's own default, and another
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert "(default: 10; in [10, 100000])" in " ".join(capsys.readouterr().out.split())  # --steps' minimum


@pytest.mark.parametrize(("mode", "listed", "left_out"), [("quality", "--recipes", "--batch_sizes"),
                                                          ("infer", "--batch_sizes", "--recipes")])
def test_bench_help_of_a_mode_lists_that_modes_options(mode: str, listed: str, left_out: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--mode", mode, "--help"])
    out = capsys.readouterr().out
    options = re.findall(r"^  (--\w+)", out, re.M)
    assert listed in options and left_out not in options and "--steps" in options
