"""`gptopt generate`: prompts from the command line, stdin or a file -> streamed text, a .jsonl, or a chat.

The generation itself is generator.py's (one Generator for the CLI, bench, train and the server);
this module reads prompts, encodes them, streams or writes the completions, and runs a chat turn by turn.

    gptopt generate --model out/ "def fib(n):"
    echo "import os" | gptopt generate --model gpt2 --temperature 0 --max_new_tokens 32
    gptopt generate --model out/ --input prompts.txt --output completions.jsonl --batch_size 16
    gptopt generate --model chat_model/ --chat "You are terse."     # a conversation, turns from stdin
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from tokenizers import Tokenizer
from tqdm import tqdm

from gptopt.config import GenerateConfig
from gptopt.data.tokenizer import eot_id
from gptopt.infer import chat, speculative
from gptopt.infer.generator import Generator, Stepper
from gptopt.infer.load import load_for_inference, model_source
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import complete, stream
from gptopt.infer.stop import StopChecker
from gptopt.outputs import check_writable, lock_output, staged_file
from gptopt.runtime import process
from gptopt.runtime.device import resolve
from gptopt.utils.errors import UserError

__all__ = ["main"]

log = logging.getLogger("gptopt")


def _check_utf8(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: argv's stand-in for a byte that is not UTF-8
        raise UserError(f"{what} is not valid UTF-8 text ({_bad_char(text[e.start])} at character {e.start}); "
                         "give it as UTF-8") from None


def _encode(tok: Tokenizer, text: str, eot: int | None, what: str = "the prompt") -> list[int]:
    _check_utf8(text, what)  # the tokenizer raises a TypeError on it
    ids = tok.encode(text).ids
    if not ids:
        if eot is None:
            raise UserError("the prompt is empty and the tokenizer has no end-of-text token to start from")
        ids = [eot]  # an empty prompt starts a fresh document
    return ids


def _bad_char(c: str) -> str:
    """A lone surrogate, named as the byte it stands for when Python decoded argv with surrogateescape."""
    return f"byte 0x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"lone surrogate U+{ord(c):04X}"


# The keys of each line generate writes (_write_jsonl): how --overwrite knows a file is its own output.
OUTPUT_KEYS = frozenset({"prompt", "completion", "tokens", "finish_reason"})


def _read_prompts(path: str) -> list[str]:
    """One prompt per non-blank line; in a .jsonl file, each line's "prompt" field."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UserError(f"--input {path} is a folder; give a file of prompts, one a line (or .jsonl)")
    if not p.exists():
        raise UserError(f"--input {path}: no such file")
    try:  # not only regular files: a pipe (--input <(cmd)) is read too
        data = p.read_bytes()
    except OSError as e:
        raise UserError(f"--input {path}: cannot read it ({e.strerror or e}); give a readable file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--input {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                         "convert it, e.g. iconv -f latin1 -t utf-8") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or p.suffix != ".jsonl":
            prompts += [line] if line.strip() else []
            continue
        row = None
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f'{p}:{n}: expected a JSON object with a "prompt" string, got {line[:80]!r}')
        prompts.append(row["prompt"])
    if not prompts:
        raise UserError(f"--input {path}: no prompts in it (it is empty or all blank lines)")
    return prompts


def _prompt_text(prompt: str | None) -> str:
    if prompt is not None and prompt != "-":
        return prompt
    if sys.stdin.isatty():
        print("gptopt generate: reading the prompt from stdin (Ctrl-D ends it)", file=sys.stderr)
    try:
        text = sys.stdin.read()
    except UnicodeDecodeError as e:
        raise UserError(f"the prompt on stdin is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                         f"{e.start}); convert it, e.g. iconv -f latin1 -t utf-8") from None
    return text.removesuffix("\n")  # the newline echo adds is not part of the prompt


WARM_TOKENS = 3  # prefill, then the decode steps that compile and (on CUDA) warm up and record the graphs


def _stream_text(gen: Generator, tok: Tokenizer, ids: list[int], params: SamplingParams,
                 times: list[float] | None = None, stepper: Stepper | None = None) -> tuple[int, str]:
    """Print the completion as it comes; the number of tokens generated and the text. `times` gets each
    token's time."""
    checker, n = StopChecker(tok, params.stop), 0
    for token in stream(gen, ids, params, stepper):
        n += 1
        if times is not None:
            times.append(time.perf_counter())
        sys.stdout.write(checker.add(token))
        sys.stdout.flush()
        if checker.stopped:
            break
    sys.stdout.write(checker.finish() + "\n")
    return n, checker.text


def _chat_template(cfg: GenerateConfig, tok: Tokenizer | None) -> chat.ChatTemplate:
    model_source(cfg.model)  # a --model that names nothing is told so first
    folders = chat.template_folders(cfg.model, cfg.tokenizer)
    template = chat.load_template(cfg.chat_template, folders, tok)
    if template is None:
        raise UserError(chat.no_template(folders))
    return template


def _read_turn() -> str | None:
    """The next line of stdin without its newline, or None at the end of input."""
    sys.stderr.write("you> ")
    sys.stderr.flush()
    try:
        line = sys.stdin.readline()
    except UnicodeDecodeError as e:
        raise UserError(f"stdin is not UTF-8 text (byte 0x{e.object[e.start]:02x}); convert it, e.g. "
                         "iconv -f latin1 -t utf-8") from None
    if not line:
        sys.stderr.write("\n")
        return None
    return line.rstrip("\r\n")


def _chat(gen: Generator, tok: Tokenizer, template: chat.ChatTemplate, params: SamplingParams,
          system: str | None, stepper: Stepper | None = None) -> int:
    """generate --chat: each line of stdin is a user turn; the reply streams to stdout. /reset clears the
    conversation, /exit or the end of input ends it. The number of tokens generated in all."""
    ends = tuple(dict.fromkeys((*params.stop_token_ids, *template.stop_token_ids(tok))))
    params = dataclasses.replace(params, stop=params.stop + template.stop, stop_token_ids=ends)
    # the rendered conversation leaves room for a reply: at most half the context, so turns are not all dropped
    limit = gen.max_len - min(params.max_new_tokens, gen.max_len // 2)
    start = [{"role": "system", "content": system}] if system else []
    history, total = list(start), 0

    def count(messages: list[dict[str, str]]) -> int:
        return len(template.encode(tok, template.render(messages)))

    if start:  # a system message that leaves no room for any turn is said once, not blamed on every turn
        try:
            least = count([*start, {"role": "user", "content": ""}])
        except ValueError:  # a template that refuses an empty turn: each real turn says why it fails
            least = 0
        if least > limit:
            raise UserError(f"the system message takes {least} tokens in the chat template, more than the {limit} "
                             f"a prompt may take (the model's context of {gen.max_len} tokens less "
                             f"{gen.max_len - limit} kept for the reply), so no turn fits; shorten the system "
                             "message, or lower --max_new_tokens")
    while (line := _read_turn()) is not None:
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            history = list(start)
            print("gptopt generate: the conversation is cleared", file=sys.stderr)
            continue
        if not line.strip():
            continue
        try:
            history, dropped = chat.fit_conversation([*history, {"role": "user", "content": line}], count, limit)
            ids = template.encode(tok, template.render(history))
        except ValueError as e:  # this turn cannot be sent: say why, and the conversation goes on without it
            print(f"gptopt generate: {e}", file=sys.stderr)
            continue
        if dropped:
            print(f"gptopt generate: dropped the {dropped} oldest messages to fit the model's context of "
                  f"{gen.max_len} tokens", file=sys.stderr)
        n, reply = _stream_text(gen, tok, ids, params, stepper=stepper)
        total += n
        history.append({"role": "assistant", "content": reply.strip()})
    return total


def _batch_jsonl(gen: Generator, tok: Tokenizer, prompts: list[str], encoded: list[list[int]],
                 params: SamplingParams, output: str | None, stepper: Stepper | None = None) -> int:
    """Write {"prompt", "completion", "tokens", "finish_reason"} per prompt; the number of tokens generated."""
    with contextlib.ExitStack() as stack:
        fh = sys.stdout
        if output:  # written beside, then renamed over: a failed run leaves an earlier file as it was
            fh = stack.enter_context(open(stack.enter_context(staged_file(Path(output).expanduser())), "w",
                                          encoding="utf-8"))
        return _write_jsonl(gen, tok, prompts, encoded, params, fh, stepper)


def _write_jsonl(gen: Generator, tok: Tokenizer, prompts: list[str], encoded: list[list[int]],
                 params: SamplingParams, fh: TextIO, stepper: Stepper | None = None) -> int:
    n, size = 0, gen.max_batch_size
    with tqdm(total=len(prompts), desc="generate", unit=" prompt", file=sys.stderr) as bar:
        for start in range(0, len(prompts), size):
            checkers = [StopChecker(tok, params.stop) for _ in encoded[start : start + size]]

            def stopped(row: int, token: int, checkers: list[StopChecker] = checkers) -> bool:
                checkers[row].add(token)
                return checkers[row].stopped  # its stop string ends this row; the rest of the batch goes on

            results = complete(gen, encoded[start : start + size], params, stopped, stepper)
            for prompt, checker, (ids, reason) in zip(prompts[start : start + size], checkers, results, strict=True):
                checker.finish()
                fh.write(json.dumps({"prompt": prompt, "completion": checker.text, "tokens": len(ids),
                                     "finish_reason": reason}, ensure_ascii=False) + "\n")
                n += len(ids)
            fh.flush()
            bar.update(len(checkers))
    return n


def _check_output_file(cfg: GenerateConfig) -> None:
    """--output, checked before the model is loaded: a writable place, never an input, and no file replaced
    unasked; --overwrite replaces only generate's own output."""
    output = cfg.output
    assert output is not None
    path = Path(output).expanduser()
    if path.is_dir():
        raise UserError(f"--output {output} is a folder; give the path of a file (.jsonl)")
    real = os.path.realpath(path)  # through symlinks and .., as the write would go
    if cfg.input and (real == os.path.realpath(Path(cfg.input).expanduser()) or _same_file(path, cfg.input)):
        raise UserError(f"--output {output} is the --input file; nothing was written: choose another --output")
    for folder in _model_folders(cfg.model):
        if os.path.commonpath([real, folder]) == folder:
            raise UserError(f"--output {output} is inside the model folder {folder}; nothing was written: "
                             "choose an --output outside it")
    if path.exists() and not _overwrite_ok(path, cfg.overwrite, output):
        raise UserError(f"--output {output} exists; nothing was written: pass --overwrite to replace it (kept until "
                         "the new file is complete), or choose another path")
    check_writable(path.parent, "--output", shown=output)  # the folder the file goes into


def _same_file(a: Path, b: str) -> bool:
    try:  # a hard link has another path but the same inode
        return os.path.samefile(a, Path(b).expanduser())
    except OSError:
        return False


def _model_folders(model: str) -> list[str]:
    """The local folders --model loads from (a training run dir and the checkpoint it resolves to), resolved."""
    if not Path(model).expanduser().is_dir():
        return []  # a hub name, or a path load_for_inference will refuse
    folders = {os.path.realpath(Path(model).expanduser())}
    with contextlib.suppress(ValueError, OSError):
        source = model_source(model)
        if isinstance(source, Path):
            folders.add(os.path.realpath(source))
    return sorted(folders)


def _overwrite_ok(path: Path, overwrite: bool, output: str) -> bool:
    """Whether --overwrite may replace `path`: only a file generate wrote, every line a JSON object with
    exactly OUTPUT_KEYS (or an empty file). Anything else (a prompts file, a model's weights, a script)
    was not made by generate and may be all the user has of it, so it is refused whatever --overwrite says."""
    if not overwrite:
        return False
    if not path.is_file():
        raise UserError(f"--output {output} exists and is not a regular file; choose another --output")
    try:
        with path.open("rb") as fh:
            for line in fh:
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or set(row) != OUTPUT_KEYS:
                    break
            else:
                return True
    except (OSError, ValueError):  # unreadable, not UTF-8 (UnicodeDecodeError) or not JSON: not ours
        pass
    raise UserError(f"--output {output} exists and is not a generate output (.jsonl of prompt/completion "
                     "lines), so --overwrite does not replace it; nothing was written: choose another --output, "
                     "or move the file away first")


def main(cfg: GenerateConfig) -> int:
    with lock_output(cfg.output, flag="--output", whole=True) if cfg.output else contextlib.nullcontext():
        return _generate(cfg)


def _generate(cfg: GenerateConfig) -> int:
    if cfg.output:
        _check_output_file(cfg)
    batch = _read_prompts(cfg.input) if cfg.input else None
    if batch is None and cfg.prompt is not None:
        _check_utf8(cfg.prompt, "the prompt")  # before the model loads
    if cfg.chat:
        _chat_template(cfg, None)  # a missing template or a bad --chat_template fails before the model loads
    plan = resolve(cfg.device, quiet=True)
    process.set_matmul_precision(plan)
    if cfg.compile:
        process.allow_recompiles()
    model, tok = load_for_inference(cfg.model, tokenizer=cfg.tokenizer, plan=plan, dtype=cfg.dtype,
                                    quantize=cfg.quantize)
    eot = eot_id(tok)
    # every end-of-sequence id of the model, as transformers' generate stops at
    ends = chat.end_token_ids(chat.template_folders(cfg.model, cfg.tokenizer), tok)
    params = dataclasses.replace(SamplingParams.from_config(cfg), stop_token_ids=ends)
    gen = Generator(model, plan, max_batch_size=cfg.batch_size if batch else 1, compile=cfg.compile,
                    cuda_graphs=cfg.cuda_graphs, prefix_cache=cfg.prefix_cache)
    spec = speculative.build(cfg, gen, tok, plan)
    if cfg.chat:  # no tokens/s: the time is mostly the person typing
        n = _chat(gen, tok, _chat_template(cfg, tok), params, cfg.prompt, spec)
        print(f"gptopt generate: {n} tokens generated in the conversation{_acceptance(spec)}", file=sys.stderr)
        return 0
    if batch:
        encoded = [_encode(tok, text, eot, f"--input {cfg.input}: prompt {i}") for i, text in enumerate(batch, 1)]
    else:
        encoded = [_encode(tok, _prompt_text(cfg.prompt), eot)]
    for ids in encoded:
        gen.check_prompt(ids)  # a bad line fails before the batch runs, not after
    t0, times = time.perf_counter(), []
    n = _stream_text(gen, tok, encoded[0], params, times, spec)[0] if batch is None else _batch_jsonl(
        gen, tok, batch, encoded, params, cfg.output, spec)
    dt = time.perf_counter() - t0
    line = (f"gptopt generate: {n} tokens in {dt:.2f} s: {n / max(dt, 1e-9):.1f} tokens/s "
            f"(prefill + decode, batch {gen.max_batch_size}, {plan.device})")
    if gen.bucketed and len(times) > WARM_TOKENS + 1:
        # The compile (and CUDA graphs' warm-up and recording) happens in the first decode steps:
        # the whole-run rate above mostly measures it, so the decode rate after it is shown too.
        warm = times[WARM_TOKENS - 1] - t0
        rate = (len(times) - WARM_TOKENS) / max(times[-1] - times[WARM_TOKENS - 1], 1e-9)
        what = "compiled decode" if gen.compiled else "decode on CUDA graphs"
        line += f"; {what} after the first {WARM_TOKENS} tokens ({warm:.2f} s): {rate:.1f} tokens/s"
    print(line + _acceptance(spec), file=sys.stderr)
    return 0


def _acceptance(spec: speculative.Speculator | None) -> str:
    """The log's words on speculative decoding: the share of draft tokens the model kept."""
    if spec is None:
        return ""
    if spec.acceptance is None:
        return "; speculative: no draft proposed"
    return f"; speculative: {spec.accepted} of {spec.proposed} draft tokens kept ({spec.acceptance:.0%})"
