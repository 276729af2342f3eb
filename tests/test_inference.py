"""Where a model and a tokenizer meet (inference.check_vocab, through load_for_inference): every pairing
gptopt itself makes is accepted, a tokenizer of another vocabulary is refused with both sizes and the fix.

    pytest -q tests/test_inference.py
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from gptopt.config import preset
from gptopt.infer.load import check_vocab, load_for_inference
from gptopt.models import checkpoint
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve

CPU = resolve("cpu", quiet=True)


def words(n: int) -> Tokenizer:
    """A tokenizer of exactly n tokens."""
    return Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))


@pytest.mark.parametrize(("tokens", "model"), [
    (320, 320),  # debug and tiny trained on prepared data: the data's vocabulary, gptopt's padding not counted
    (50257, 50257),  # GPT-2 from the hub or a Hugging Face folder
    (50257, 50304),  # nanoGPT's GPT-2: 50257 tokens padded to a multiple of 64
    (325, 384),
])
def test_a_model_of_the_tokenizers_vocabulary_padded_to_a_multiple_of_64_is_accepted(tokens: int, model: int) -> None:
    check_vocab(words(tokens), model)


@pytest.mark.parametrize(("tokens", "model"), [
    (320, 512),  # a debug-sized tokenizer on a model of another vocabulary: the rows differ beyond padding
    (512, 8192),
    (50257, 50368),  # padded one multiple of 64 too far
    (8192, 512),  # more tokens than rows
])
def test_a_tokenizer_of_another_vocabulary_is_refused_with_both_sizes(tokens: int, model: int) -> None:
    with pytest.raises(ValueError, match=f"the tokenizer has {tokens} tokens, the model {model} .*do not belong "
                                         "together; pass the --tokenizer the model was trained with"):
        check_vocab(words(tokens), model)


def test_a_gpt2_sized_model_trained_with_a_smaller_tokenizer_meets_only_that_one(
    train_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # train --preset gpt2 on a corpus with its own BPE keeps GPT-2's 50257 rows (config.preset_for_data);
    # the checkpoint carries the tokenizer it was trained with
    directory = checkpoint.save_model(GPT(preset("debug", vocab_size=50257)), tmp_path / "m")
    shutil.copy(train_data / "tokenizer.json", directory / "tokenizer.json")
    _, tok = load_for_inference(str(directory), tokenizer=None, plan=CPU)
    assert tok.get_vocab_size() == 320
    load_for_inference(str(directory), tokenizer=str(train_data / "tokenizer.json"), plan=CPU)  # the same one, given
    words(50257).save(str(tmp_path / "gpt2-sized.json"))
    with pytest.raises(ValueError, match="the tokenizer has 50257 tokens, the model 50257 and the tokenizer.json in "
                                         "its folder 320: they do not belong together; drop --tokenizer"):
        load_for_inference(str(directory), tokenizer=str(tmp_path / "gpt2-sized.json"), plan=CPU)


def test_a_typo_in_a_local_path_fails_at_once_without_asking_the_hub(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """'out/ckpt-0000002x' where out/ exists is a path with a typo, not the Hub name 'org/name': generate, serve
    and export say so at once (offline the Hub's retries took most of a minute, then named something else)."""
    from gptopt.data import tokenizer as tokenizer_module
    from gptopt.data.tokenizer import load_tokenizer
    from gptopt.infer.load import model_source
    from gptopt.models import hf

    def no_hub(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(hf, "hub_folder", no_hub)
    monkeypatch.setattr(tokenizer_module, "_from_hub", no_hub)
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    for typo in ("out/ckpt-0000002x", "./out/model", "~/no/such/model", str(tmp_path / "nope")):
        with pytest.raises(ValueError, match="no such directory"):
            model_source(typo)
        with pytest.raises(ValueError, match="no such model directory"):
            hf.load_pretrained(typo)
    with pytest.raises(ValueError, match="no such file or folder"):
        load_tokenizer("out/tokenizer.jsn")
    cached_on_the_hub("openai-community/gpt2", tmp_path / "cache", monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_source("openai-community/gpt2") == "openai-community/gpt2"  # a Hub name stays one


def cached_on_the_hub(name: str, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hugging Face cache in `cache`, holding `name`'s config.json as a download leaves it."""
    constants = pytest.importorskip("huggingface_hub.constants")
    snapshot = cache / f"models--{name.replace('/', '--')}" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


@pytest.mark.parametrize("hub", ["HF_HUB_OFFLINE", "unreachable"])
def test_an_org_slash_name_that_is_no_folder_and_not_on_a_reachable_hub_fails_at_once_naming_the_model(
        hub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`generate --model ot/ckpt-0000030` (out/ckpt-0000030 mistyped) reads as the Hub's org/name: with the Hub
    offline, or unreachable (one refused request, no retries), it fails at once naming the model, never asking
    the Hub for a tokenizer (GPT-2's took most of a minute of retries, then the tokenizer was blamed)."""
    constants = pytest.importorskip("huggingface_hub.constants")
    from gptopt import cli
    from gptopt.data import tokenizer as tokenizer_module

    asked: list[str] = []
    monkeypatch.setattr(tokenizer_module, "_from_hub", lambda name: asked.append(name))
    (tmp_path / "out" / "ckpt-0000030").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))  # empty, whatever this machine's holds
    with socket.socket() as closed:  # bound, never listening: a connection to it is refused at once
        closed.bind(("127.0.0.1", 0))
        if hub == "HF_HUB_OFFLINE":
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        else:
            monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
            monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
            url = f"http://127.0.0.1:{closed.getsockname()[1]}/{{repo_id}}/resolve/{{revision}}/{{filename}}"
            monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url)
        assert cli.main(["generate", "--model", "ot/ckpt-0000030", "--device", "cpu", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--model ot/ckpt-0000030 is neither a local folder nor reachable" in err and "check the path" in err
    assert "tokenizer" not in err and asked == []
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]
