"""Every bad input of every verb: one line on stderr naming the problem and the fix, exit status 2,
and nothing read or written before it (validation happens before any model is built).

    pytest -q tests/test_bad_input.py
"""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import exit_status

from gptopt import cli
from gptopt.config import GPTConfig, TrainConfig, field_types

# What a verb needs besides the option under test, so the error is about that option.
BASE_ARGS: dict[str, list[str]] = {"compress": ["--output_dir", "c_out", "--quantize", "int8-dynamic"]}


def config_class(verb: str) -> type:
    return cli._load(cli.COMMANDS[verb].config)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """gptopt.cli.main(argv) -> (exit status, stderr), whether it returns or exits."""
    return exit_status(argv), capsys.readouterr().err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gptopt "), err
    for needle in needles:
        assert needle.lower() in lines[0].lower(), (needle, err)


def options(kind: type) -> list[tuple[str, str]]:
    """(verb, option) for every command-line option of this scalar type, in every verb."""
    return [(verb, f.name) for verb in cli.COMMANDS for f, k, _ in cli.cli_fields(config_class(verb))
            if k is kind and not f.metadata.get("positional")]


@pytest.fixture(autouse=True)
def _in_empty_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def assert_nothing_written(tmp_path: Path, keep: set[str] = frozenset()) -> None:
    assert {p.name for p in tmp_path.iterdir()} <= keep


# ----------------------------------------------------------------------------------------------
# Every int and float option of every verb, as a flag and from TOML


@pytest.mark.parametrize(("verb", "name"), options(int))
@pytest.mark.parametrize("value", ["-1", str(10**19)])
def test_every_int_option_refuses_negative_and_absurd_values(
    verb: str, name: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli([verb, *BASE_ARGS.get(verb, []), f"--{name}", value], capsys)
    assert_one_line_error(code, err, f"--{name}", value)
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize(("verb", "name"), options(float))
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_option_refuses_non_finite_values(
    verb: str, name: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --x=-inf: argparse reads a lone -inf as an option
    code, err = run_cli([verb, *BASE_ARGS.get(verb, []), f"--{name}={value}"], capsys)
    assert_one_line_error(code, err, f"--{name}", "finite")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize(("verb", "name"), options(float))
def test_toml_floats_get_the_same_check_as_flags(
    verb: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "c.toml").write_text(f"[{verb}]\n{name} = nan\n")
    code, err = run_cli([verb, *BASE_ARGS.get(verb, []), "--config", "c.toml"], capsys)
    assert_one_line_error(code, err, f"--{name}", "finite")
    assert_nothing_written(tmp_path, {"c.toml"})


def test_every_int_option_has_an_upper_limit() -> None:
    # an unbounded size is a typo away from an allocation that fails minutes into a run
    for cls in [GPTConfig] + [config_class(verb) for verb in cli.COMMANDS]:
        for f in dataclasses.fields(cls):
            if field_types(cls)[f.name][0] is int:
                assert "le" in f.metadata or "lt" in f.metadata, f"{cls.__name__}.{f.name}"


@pytest.mark.parametrize("verb", list(cli.COMMANDS))
def test_config_naming_a_folder_exits_2(verb: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "cfg").mkdir()
    code, err = run_cli([verb, "--config", "cfg"], capsys)
    assert_one_line_error(code, err, "--config cfg is a folder")
    assert_nothing_written(tmp_path, {"cfg"})


@pytest.mark.parametrize("verb", list(cli.COMMANDS))
def test_unreadable_config_exits_2(verb: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    # chmod does not stop root, so the refusal the kernel would give is injected where the file is opened
    (tmp_path / "c.toml").write_text("")

    def denied(path: str, *args: Any, **kw: Any) -> Any:
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(cli, "open", denied, raising=False)
    code, err = run_cli([verb, "--config", "c.toml"], capsys)
    assert_one_line_error(code, err, "--config c.toml", "permission denied")


def test_toml_that_is_not_utf8_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "c.toml").write_bytes(b"preset = \"\xff\xfe\"\n")
    code, err = run_cli(["doctor", "--config", "c.toml"], capsys)
    assert_one_line_error(code, err, "--config c.toml", "not valid TOML")


def test_toml_choices_are_checked_like_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # argparse checks choices of flags only; a TOML value went straight into the config
    (tmp_path / "c.toml").write_text('attention = "flash9"\n')
    code, err = run_cli(["train", "--config", "c.toml"], capsys)
    assert_one_line_error(code, err, "--attention", "flash9")


def test_argparse_errors_are_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(["train", "--batch_size", "many"], capsys)
    assert_one_line_error(code, err, "--batch_size", "--help")


# ----------------------------------------------------------------------------------------------
# Intervals, sizes, loader combinations


def test_eval_iters_0_is_refused_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # it used to pass and fail at the first evaluation, losing the steps before it
    code, err = run_cli(["train", "--preset", "debug", "--eval_iters", "0", "--output_dir", "out"], capsys)
    assert_one_line_error(code, err, "--eval_iters", "--eval_interval 0")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize(("name", "meaning"), [("eval_interval", "0: never"), ("save_interval", "0: only at the end"),
                                               ("log_interval", "0: step 1 only"), ("sample_tokens", "0: no sample")])
def test_an_interval_of_0_turns_it_off_and_says_so(name: str, meaning: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert getattr(TrainConfig(**{name: 0}), name) == 0
    field = next(f for f in dataclasses.fields(TrainConfig) if f.name == name)
    assert meaning in field.metadata["help"]


@pytest.mark.parametrize(
    ("argv", "limit"),
    [
        (["serve", "--max_batch_size", "1000000000"], "4096"),
        (["train", "--batch_size", "100000000"], "65536"),
        (["train", "--seq_len", "100000000"], "1048576"),
        (["generate", "--max_new_tokens", str(10**12)], "1048576"),
        (["train", "--num_workers", "100000"], "]"),  # the machine's limit: 4 per core
        (["prepare", "--vocab_size", str(2**31)], "16777216"),
        (["train", "--learning_rate", "1000"], "1]"),
        (["bench", "--batch_size", "100000000"], "65536"),
    ],
)
def test_absurd_sizes_are_refused_naming_the_limit(argv: list[str], limit: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(argv, capsys)
    assert_one_line_error(code, err, argv[1], limit)
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num_workers", "1", "--prefetch_factor", "0"], "--prefetch_factor must be in [1,"),
        (["--num_workers", "0", "--prefetch_factor", "2"], "--prefetch_factor needs worker processes"),
        (["--num_workers", "0", "--persistent_workers"], "--persistent_workers needs worker processes"),
        (["--learning_rate", "1e-3", "--min_lr", "1e-2"], "--min_lr"),
        (["--time_budget", "nan"], "--time_budget"),
        (["--time_budget", "-5m"], "--time_budget"),
        (["--beta2", "1.0"], "--beta2 must be in [0, 1)"),
        (["--dropout", "1.0"], "--dropout must be in [0, 1)"),
    ],
)
def test_inconsistent_train_options_are_refused(argv: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(["train", *argv], capsys)
    assert_one_line_error(code, err, message)


def test_loader_combinations_torch_accepts_pass() -> None:
    TrainConfig(num_workers=0, persistent_workers=False)
    TrainConfig(num_workers=2, prefetch_factor=4, persistent_workers=True)
    TrainConfig(prefetch_factor=4)  # workers chosen for the device later; make_loader drops it without them


# ----------------------------------------------------------------------------------------------
# JSON files of the right syntax and the wrong shape


def _gptopt_json(model_dir: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    target = tmp_path / "m"
    shutil.copytree(model_dir, target)
    meta = json.loads((target / "gptopt.json").read_text())
    (target / "gptopt.json").write_text(json.dumps(edit(meta)))
    return target


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda m: [m], "not a gptopt model config"),
        (lambda m: {**m, "model": []}, "must be a table"),
        (lambda m: {**m, "model": {**m["model"], "n_layer": "x"}}, "n_layer must be int"),
        (lambda m: {**m, "model": {k: v for k, v in m["model"].items() if k != "n_embd"}}, "lacks n_embd"),
        (lambda m: {**m, "model": {**m["model"], "dropout": 2.0}}, "dropout must be in [0, 1)"),
        (lambda m: {**m, "tokenizer": 5}, "tokenizer must be a path"),
        (lambda m: {**m, "train_config": []}, "train_config must be a table"),
    ],
)
def test_gptopt_json_of_the_wrong_shape(edit: Callable[[dict[str, Any]], Any], needle: str, model_dir: Path,
                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = _gptopt_json(model_dir, tmp_path, edit)
    code, err = run_cli(["generate", "--model", str(target), "--device", "cpu", "hello"], capsys)
    assert_one_line_error(code, err, "gptopt.json", needle)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[]", "expected a JSON object"),
        ('{"model_type": "gpt2", "n_embd": "768"}', "n_embd must be int"),
        ('{"model_type": "gpt2", "n_layer": 2.5}', "n_layer must be int"),
        ('{"model_type": "gpt2", "n_inner": "x"}', "n_inner is 'x'"),
        ('{"model_type": "gpt2", "n_positions": null}', "block_size must be int"),
    ],
)
def test_hf_config_json_of_the_wrong_shape(text: str, needle: str, tmp_path: Path, train_data: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hfm").mkdir()
    (tmp_path / "hfm" / "config.json").write_text(text)
    code, err = run_cli(["generate", "--model", "hfm", "--tokenizer", str(train_data / "tokenizer.json"),
                         "--device", "cpu", "hello"], capsys)
    assert_one_line_error(code, err, "config.json", needle)


# ----------------------------------------------------------------------------------------------
# Folders that cannot be written


WRITERS = {  # verb -> the option naming where it writes
    "prepare": "--output_dir", "train": "--output_dir", "bench": "--output_dir", "profile": "--output_dir",
    "tune": "--output_dir", "export": "--output_dir", "compress": "--output_dir", "generate": "--output",
    "eval": "--output_dir",
}


@pytest.mark.parametrize("verb", sorted(WRITERS))
@pytest.mark.parametrize(
    ("error", "words"),
    [
        (PermissionError(errno.EACCES, "Permission denied", "/srv/out"), "cannot write /srv/out: permission denied; "
                                                                         "choose a folder you can write"),
        (OSError(errno.EROFS, "Read-only file system", "/srv/out"), "cannot write /srv/out: read-only file system"),
        (OSError(errno.ENOSPC, "No space left on device"), "cannot write: no space left on device; free some space"),
        (IsADirectoryError(errno.EISDIR, "Is a directory", "/srv/out"), "cannot use /srv/out: it is a folder"),
        (NotADirectoryError(errno.ENOTDIR, "Not a directory", "/srv/f/out"), "cannot use /srv/f/out: part of the path"),
    ],
)
def test_a_file_system_error_while_writing_is_one_line(verb: str, error: OSError, words: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # The commands' own up-front checks catch most of these; this is the net under them.
    real_load = cli._load

    def load(ref: str) -> Any:
        if ref == cli.COMMANDS[verb].run:
            def run(config: Any) -> int:
                raise error
            return run
        return real_load(ref)

    monkeypatch.setattr(cli, "_load", load)
    extra = {"generate": ["--input", "p.txt", "--output", "o.jsonl"]}.get(verb, [])
    code, err = run_cli([verb, *BASE_ARGS.get(verb, []), *extra], capsys)
    assert_one_line_error(code, err, words)
    if words.startswith("cannot write"):
        assert f"({WRITERS[verb]})" in err


def test_an_unwritable_output_dir_of_a_real_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # root ignores modes, so the kernel's refusal is injected where prepare creates its folders
    (tmp_path / "in.txt").write_text("some text to tokenize\n" * 200)
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args: Any, **kw: Any) -> None:
        if "locked" in self.parts:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        real_mkdir(self, *args, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    code, err = run_cli(["prepare", "--input", "in.txt", "--vocab_size", "300", "--output_dir", "locked/data"], capsys)
    assert_one_line_error(code, err, "locked", "permission denied")


def test_network_errors_keep_their_traceback() -> None:
    assert cli.os_error_line(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"), None) is None


# Argument errors of every verb: an unknown option, a value out of range or not among the choices, options that
# contradict each other or the preset. Each is told before torch is imported (seconds sooner).
ARGUMENT_ERRORS = [
    *[[verb, "--no_such_option", "1"] for verb in cli.COMMANDS],
    ["doctor", "--preset", "qwen3-0.6b", "--seq_len", "50000"],
    ["prepare", "--vocab_size", "3"],
    ["train", "--batch_size", "0"],
    ["train", "--preset", "tiny", "--seq_len", "4096"],
    ["train", "--arch", "block_size=128", "--seq_len", "200"],
    ["train", "--use_amp", "--amp_dtype", "fp16", "--device", "cpu"],
    ["train", "--cpu_offload"],
    ["bench", "--preset", "tiny", "--seq_len", "4096"],
    ["bench", "--batch_sizes", "1,4"],
    ["profile", "--preset", "tiny", "--seq_len", "4096"],
    ["profile", "--mode", "generate", "--seq_len", "4"],
    ["profile", "--use_amp", "--amp_dtype", "fp16", "--device", "cpu"],
    ["generate", "--temperature", "-1"],
    ["serve", "--port", "99999"],
    ["loadtest", "--requests", "0"],
    ["compress", "--quantize", "int3"],
    ["export", "--format", "tflite"],
    ["tune", "--preset", "tiny", "--seq_len", "4096"],
    ["tune", "--axes", "colour"],
    ["eval", "--task", "trivia"],
    # a model path that names nothing: a typo of a local folder, not a hub name
    ["generate", "--model", "./no_such_run"],
    ["generate", "--model", "gpt2", "--draft_model", "runs/draft/ckpt-0000010"],
    ["serve", "--model", "~/no_such_run"],
    ["train", "--init_from", "./no_such_model"],
    ["compress", "--model", "/no/such/run"],
    ["export", "--model", "./no_such_run"],
    ["eval", "--model", "./no_such_run"],
    ["bench", "--mode", "infer", "--model", "./no_such_run"],
]

# Runs each command line in one fresh process, in order, and prints its exit status and whether torch had been
# imported by then: the first line that imports it is the one to fix.
_RUN_EACH = """
import json, sys
from gptopt import cli
for argv in json.loads(sys.argv[1]):
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    print(json.dumps([argv, code, "torch" in sys.modules]), flush=True)
"""


def test_every_argument_error_is_told_before_torch_is_imported(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(Path(cli.__file__).parents[1]), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", _RUN_EACH, json.dumps(ARGUMENT_ERRORS)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == len(ARGUMENT_ERRORS), proc.stderr[-2000:]
    assert [argv for argv, code, _ in rows if code != 2] == []  # each an argument error, refused
    first = next((argv for argv, _, torch_in in rows if torch_in), None)
    assert first is None, f"`gptopt {' '.join(first or [])}` imported torch before telling its argument error"
    assert list(tmp_path.iterdir()) == []  # and nothing was written


def test_a_model_path_that_names_nothing_is_refused_naming_its_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # 'runs/draft' then reads as a path under it, not as the hub's org/name
    assert cli.main(["generate", "--model", "gpt2", "--draft_model", "runs/draft"]) == 2
    err = capsys.readouterr().err
    assert "--draft_model runs/draft: no such directory" in err and "--model " not in err, err


def test_loadtest_model_is_the_servers_name_for_it_not_a_path_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server started with --model /its/path answers to that name: loadtest from another machine sends it."""
    from gptopt.commands import loadtest

    seen = []
    monkeypatch.setattr(loadtest, "main", lambda cfg: seen.append(cfg.model) or 0)
    assert cli.main(["loadtest", "--model", "/srv/models/run-7", "--requests", "1"]) == 0
    assert seen == ["/srv/models/run-7"]
