"""A chat model fine-tuned from a Hugging Face folder keeps how it chats: its template, its special tokens and every
end-of-sequence id, through training, resuming and export. The folders are made here (conftest.chat_model_dir).

    pytest -q tests/test_fine_tune_chat.py
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
from conftest import CHAT, chat_model_dir
from tokenizers import Tokenizer

from gptopt import cli
from gptopt.infer import chat
from gptopt.models import checkpoint, hf_files

transformers = pytest.importorskip("transformers")
pytest.importorskip("jinja2")

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "def fib(n):"}]


def source_and_data(kind: str, debug_tokenizer: Tokenizer, tmp_path: Path) -> tuple[Path, Path]:
    """A chat model's folder whose generation_config.json ends a sequence at its end of turn or at the end of text
    (config.json names the end of turn alone, as Qwen3's does), and text prepared with its tokenizer."""
    src = chat_model_dir(kind, debug_tokenizer, tmp_path / kind)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    ends = [tok.token_to_id(CHAT[kind][3]), tok.token_to_id("<|endoftext|>")]
    generation = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": ends}))
    text = tmp_path / "text"
    text.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("argparse.py", "textwrap.py"):
        (text / f"{name}.txt").write_text((stdlib / name).read_text(encoding="utf-8"), encoding="utf-8")
    data = tmp_path / "data"
    assert cli.main(["prepare", "--input", str(text), "--tokenizer", str(src), "--output_dir", str(data),
                     "--val_fraction", "0.3"]) == 0
    return src, data


def train(data: Path, out: Path, *extra: str) -> None:
    assert cli.main(["train", "--data_dir", str(data), "--output_dir", str(out), "--device", "cpu", "--seq_len", "32",
                     "--batch_size", "2", "--warmup_steps", "1", "--eval_interval", "0", "--sample_tokens", "0",
                     "--no-tensorboard", *extra]) == 0


def how_it_chats(folder: Path | str, tok: Tokenizer) -> tuple[object, ...]:
    """What generate --chat and serve take of a model's folders: its template, and every id that ends a reply."""
    folders = chat.template_folders(str(folder))
    template = chat.load_template(None, folders, tok)
    assert template is not None, chat.no_template(folders)
    return template.text, template.eos_token, chat.end_token_ids(folders, tok), hf_files.special_ids(folders)


def served_chat_ends_at(folder: Path, chat_ids: list[int], end_of_turn: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """serve --model FOLDER: the chat route sends the template's tokens, and the model's end of turn ends the reply
    (forced as the third new token, as a model that ends its turn there would), with the text before it."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from serve_helpers import end_of_text_after

    from gptopt.config import ServeConfig
    from gptopt.serve.app import create_app
    from gptopt.serve.server import serve_in_thread

    app = create_app(ServeConfig(model=str(folder), device="cpu", max_batch_size=2, engine_process=False))
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    with serve_in_thread(app) as server:
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
        end_of_text_after(app.state.engine.generator, monkeypatch, len(chat_ids), 3, end_of_turn)
        got = httpx.post(url, json=body, timeout=60)
    assert got.status_code == 200, got.text
    reply = got.json()
    assert reply["usage"] == {"prompt_tokens": len(chat_ids), "completion_tokens": 3, "total_tokens": len(chat_ids) + 3}
    assert reply["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_a_chat_model_fine_tuned_resumed_and_exported_keeps_its_template_and_every_end_id(
        kind: str, debug_tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """train --init_from a chat model's folder: the checkpoint chats as its source does (its template, its end of
    turn and every eos id of both configs), generate --chat sends the template's tokens, --resume keeps it all
    (the checkpoint it resumed from deleted by retention before the next save), serve's chat route ends a reply at
    the end of turn, and export --format hf writes a
    folder whose tokenizer transformers applies the template with, and whose configs name every eos id."""
    from conftest import run_chat

    src, data = source_and_data(kind, debug_tokenizer, tmp_path)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    want = how_it_chats(src, tok)
    end_of_turn = tok.token_to_id(CHAT[kind][3])
    assert want[0] == CHAT[kind][0] and end_of_turn in want[2] and len(want[3][1]) == 2

    out = tmp_path / "ft"
    train(data, out, "--init_from", str(src), "--max_steps", "2")
    assert how_it_chats(out, tok) == want

    theirs = transformers.AutoTokenizer.from_pretrained(src)
    chat_ids = theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    rc, _, err, prompts = run_chat(["--model", str(out), "--max_new_tokens", "2", "Be terse."], "def fib(n):\n",
                                   monkeypatch, capsys)
    assert rc == 0, err
    assert prompts == [chat_ids]

    first = checkpoint.latest_checkpoint(out)
    train(data, out, "--resume", "auto", "--max_steps", "6", "--save_interval", "2", "--save_total_limit", "1")
    assert not first.exists() and checkpoint.latest_checkpoint(out).name == checkpoint.checkpoint_name(6)
    assert how_it_chats(out, tok) == want
    served_chat_ends_at(out, chat_ids, end_of_turn, monkeypatch)

    export = tmp_path / "export"
    assert cli.main(["export", "--model", str(out), "--format", "hf", "--output_dir", str(export)]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(export)
    assert exported.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False) == chat_ids
    every_end = want[3][1]
    assert transformers.GenerationConfig.from_pretrained(export).eos_token_id == every_end
    assert json.loads((export / "config.json").read_text())["eos_token_id"] == every_end


def on_a_fake_hub(name: str, repo: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hugging Face Hub, as huggingface_hub's snapshot_download serves it, holding `repo` as `name`: a snapshot
    folder in `cache` of the repository's files that allow_patterns name, as a download leaves them."""
    import fnmatch
    import shutil

    hub = pytest.importorskip("huggingface_hub")
    snapshot = cache / f"models--{name.replace('/', '--')}" / "snapshots" / ("0" * 40)

    def snapshot_download(repo_id: str, *, allow_patterns: list[str], local_files_only: bool = False,
                          **kw: object) -> str:
        assert repo_id == name
        if not local_files_only:
            snapshot.mkdir(parents=True, exist_ok=True)
            for f in repo.iterdir():
                if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                    shutil.copy(f, snapshot / f.name)
        assert snapshot.is_dir(), "not in the cache, and local_files_only"
        return str(snapshot)

    def try_to_load_from_cache(repo_id: str, filename: str, **kw: object) -> str | None:
        return str(snapshot / filename) if (snapshot / filename).is_file() else None

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(hub, "try_to_load_from_cache", try_to_load_from_cache)
    monkeypatch.setattr("gptopt.models.hub._probe", lambda hub, name: None)  # the Hub has it


def test_a_chat_model_fine_tuned_from_a_hub_name_keeps_its_template_and_every_end_id(
        debug_tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train --init_from org/name: the model's tokenizer_config.json, chat template and generation_config.json are
    fetched with its weights, and the checkpoint chats as the model does (its template, its end of turn and every
    eos id of both configs), as one fine-tuned from a local copy of the folder does."""
    src, data = source_and_data("qwen3", debug_tokenizer, tmp_path)
    (src / hf_files.TEMPLATE_FILE).write_text(CHAT["qwen3"][0], encoding="utf-8")  # as newer transformers save it
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    want = how_it_chats(src, tok)
    on_a_fake_hub("org/chat-model", src, tmp_path / "hub", monkeypatch)

    out = tmp_path / "ft"
    train(data, out, "--init_from", "org/chat-model", "--max_steps", "1")
    assert how_it_chats(out, tok) == want
    assert (checkpoint.latest_checkpoint(out) / hf_files.TEMPLATE_FILE).read_text(encoding="utf-8") == CHAT["qwen3"][0]
