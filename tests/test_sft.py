"""Supervised fine-tuning on conversations: prepare's rows and masks, the packed rows' isolation, the loss under
accumulation, resume, and the fine-tuned model's template and end of turn (train/chat_data.py, data/loader.py's
ChatRows, train/step.py's chat_weights).

    pytest tests/test_sft.py
    pytest -m slow tests/test_sft.py    # the end-to-end task: a tiny model taught to answer in CPU minutes
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    CHAT,
    TRAIN_FAST,
    chat_model_dir,
    eval_samples,
    family_config,
    file_tree,
    last_json_line,
    load_script,
    train_losses,
    train_run,
)
from tokenizers import Tokenizer

from gptopt import cli
from gptopt.commands import eval as eval_cmd
from gptopt.config import PrepareConfig
from gptopt.data.loader import IGNORE_INDEX, ChatRows, TokenData
from gptopt.infer import chat
from gptopt.infer.generator import Generator
from gptopt.infer.load import find_tokenizer, load_for_inference, model_source
from gptopt.infer.sampling import SamplingParams
from gptopt.infer.scheduler import generate
from gptopt.models.gpt import GPT, document_mask
from gptopt.runtime.device import resolve
from gptopt.train import chat_data
from gptopt.train.distributed import DistInfo
from gptopt.train.step import chat_weights, forward_backward
from gptopt.utils.errors import UserError

CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"},
     {"role": "assistant", "content": "ba"}, {"role": "user", "content": "xyz"},
     {"role": "assistant", "content": "zyx"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ih"}],
    [{"role": "user", "content": "cat"}, {"role": "assistant", "content": "tac"}],
    [{"role": "user", "content": "dog"}, {"role": "assistant", "content": "god"}],
    [{"role": "user", "content": "sun"}, {"role": "assistant", "content": "nus"}],
    [{"role": "user", "content": "pot"}, {"role": "assistant", "content": "top"}],
]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def prepare(src: Path, out: Path, tokenizer: Path, **kw: Any) -> TokenData:
    """`gptopt prepare` of conversations, as its command reads them (by content unless kw says)."""
    from gptopt.commands import prepare as prepare_cmd

    cfg = PrepareConfig(input=str(src), output_dir=str(out), tokenizer=str(tokenizer), **{"seq_len": 64, **kw})
    assert prepare_cmd.main(cfg) == 0
    return TokenData(out)


@pytest.fixture(scope="module")
def chat_data_dir(trained_out: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CONVERSATIONS (twice over, so that val holds some) prepared for trained_out's model: gptopt's default
    template, its markers added to the debug tokenizer."""
    tmp = tmp_path_factory.mktemp("chat")
    src = write_jsonl(tmp / "chats.jsonl", [{"messages": m} for m in CONVERSATIONS * 4])
    prepare(src, tmp / "data", trained_out, val_fraction=0.2)
    return tmp / "data"


def supervised_text(data: TokenData, split: str = "train") -> list[str]:
    """Each conversation's targets, decoded: what the loss counts."""
    ds = ChatRows(data, split, batch_size=1, seed=0)
    tok = data.tokenizer()
    assert tok is not None
    out = []
    for _x, y, pos in ds.eval_batches():
        starts = (pos[0] == 0).nonzero().flatten().tolist() + [pos.shape[1]]
        for a, b in zip(starts, starts[1:], strict=False):
            targets = [t for t in y[0, a:b].tolist() if t != IGNORE_INDEX]
            if targets:
                out.append(tok.decode(targets, skip_special_tokens=False))
    return out


def test_the_loss_counts_each_assistant_turn_and_its_end_of_turn_token_only(chat_data_dir: Path) -> None:
    data = TokenData(chat_data_dir)
    want = {"ba<|im_end|>zyx<|im_end|>", "ih<|im_end|>", "tac<|im_end|>", "god<|im_end|>", "nus<|im_end|>",
            "top<|im_end|>"}
    got = supervised_text(data) + supervised_text(data, "val")
    assert set(got) == want and len(got) == len(CONVERSATIONS) * 4
    assert data.chat["added_tokens"] == ["<|im_start|>", "<|im_end|>"]
    assert (chat_data_dir / "chat_template.jinja").read_text() == chat.DEFAULT_TEMPLATE


def test_prompt_completion_pairs_are_recognised_by_content_and_supervise_the_completion(
        trained_out: Path, tmp_path: Path) -> None:
    pairs = [{"prompt": f"say {w}", "completion": w[::-1]} for w in ("ab", "cd", "ef", "gh")]
    src = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    assert chat_data.detect(src) == "prompt_completion"
    data = prepare(src, tmp_path / "data", trained_out, val_fraction=0.25)
    assert data.chat["reading"] == "prompt_completion"
    assert sorted(supervised_text(data) + supervised_text(data, "val")) == \
        sorted(f"{w[::-1]}<|im_end|>" for w in ("ab", "cd", "ef", "gh"))


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_a_hugging_face_folders_template_masks_every_turn_of_a_multi_turn_conversation(
        kind: str, debug_tokenizer: Tokenizer, tmp_path: Path) -> None:
    """Qwen3's template renders an earlier reply otherwise once later turns follow (the last gets an empty think
    block): each turn's content and end-of-turn token are still the ones counted."""
    folder = chat_model_dir(kind, debug_tokenizer, tmp_path / kind)
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CONVERSATIONS[0]}] * 3)
    data = prepare(src, tmp_path / "data", folder, val_fraction=0.4, seq_len=256)
    eos = CHAT[kind][3]
    assert supervised_text(data) == [f"ba{eos}zyx{eos}"] * 2
    assert not data.chat["added_tokens"]  # the model's own tokens: nothing added, no embedding to grow
    assert json.loads((tmp_path / "data" / "tokenizer_config.json").read_text())["eos_token"] == eos


@pytest.mark.parametrize("line, reason", [
    ("{not json", "not JSON"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "role must be one of"),
    ({"prompt": "hi"}, "no \"messages\""),
])
def test_a_bad_line_is_refused_with_its_number_and_nothing_is_written(trained_out: Path, tmp_path: Path,
                                                                         line: Any, reason: str) -> None:
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CONVERSATIONS[:2]] + [line])
    before = file_tree(tmp_path)
    with pytest.raises(UserError, match=rf"chats.jsonl:3: .*{reason}"):
        prepare(src, tmp_path / "data", trained_out)
    assert file_tree(tmp_path) == before


def test_an_overlong_conversation_is_refused_or_split_never_cut(trained_out: Path, tmp_path: Path) -> None:
    long = [{"role": "user", "content": "x " * 40}, {"role": "assistant", "content": "y " * 80}]
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in [*CONVERSATIONS, long]])
    with pytest.raises(UserError, match=r"chats.jsonl:7: the conversation takes .* tokens, more than .*--overlong"):
        prepare(src, tmp_path / "data", trained_out, val_fraction=0.1, seed=1)
    data = prepare(src, tmp_path / "data", trained_out, val_fraction=0.1, seed=1, overlong="split")
    splits = data.chat["splits"]
    assert splits["train"]["split_pieces"] + splits["val"]["split_pieces"] >= 2
    every = sum(s["tokens"] for s in splits.values())
    tok = data.tokenizer()
    template = chat.ChatTemplate("t", chat.DEFAULT_TEMPLATE, kind="t", eos_token=chat.DEFAULT_END)
    assert tok is not None
    assert every == sum(len(chat_data.tokenize(template, tok, m).ids) for m in [*CONVERSATIONS, long])  # nothing lost


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_packed_conversation_sees_itself_alone(family: str) -> None:
    """Logits of a conversation packed after another, its positions restarting and the document mask on, equal
    its logits alone: nothing of the first reaches it (learned positions and rotary alike)."""
    model = GPT(family_config(family, vocab_size=64)).eval()
    torch.manual_seed(0)
    a, b = torch.randint(0, 64, (1, 11)), torch.randint(0, 64, (1, 9))
    row = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(11), torch.arange(9)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(row, pos=pos, attn_mask=document_mask(pos))
        alone_a, alone_b = model(a), model(b)
        unmasked = model(row, pos=pos)
    torch.testing.assert_close(packed[:, :11], alone_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[:, 11:], alone_b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unmasked[:, 11:], alone_b, atol=1e-3)  # without the mask it would see the first


def test_the_loss_and_gradients_are_the_same_with_accumulation_1_and_4(chat_data_dir: Path,
                                                                         debug_config: Any) -> None:
    """Rows supervise different numbers of tokens: the loss is the mean over every supervised token of the global
    batch (chat_weights), not a mean of micro-batch means."""
    data = TokenData(chat_data_dir)
    plan = dataclasses.replace(resolve("cpu"), amp_dtype=None)  # fp32: bf16 rounds otherwise at other shapes
    x, y, pos = ChatRows(data, "train", batch_size=4, seed=0)[0]
    counts = (y != IGNORE_INDEX).sum(dim=1)
    assert len(set(counts.tolist())) > 1  # otherwise a mean of means would agree too
    base = GPT(dataclasses.replace(debug_config, vocab_size=data.vocab_size))
    grads, losses = [], []
    for accum in (1, 4):
        model = copy.deepcopy(base)
        batches = [(x[i::accum], y[i::accum], pos[i::accum]) for i in range(accum)]
        weights = chat_weights(batches, DistInfo())
        loss = sum(forward_backward(model, bx, by, plan, None, accum, pos=bp, weight=w)
                   for (bx, by, bp), w in zip(batches, weights, strict=True))
        losses.append(float(loss))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_sft_resumes_bitwise_and_the_model_chats_with_the_datas_template(chat_data_dir: Path, trained_out: Path,
                                                                         tmp_path: Path) -> None:
    """4 steps straight, and 2 then 2 resumed, train on the same rows with the same losses; the grown vocabulary
    (the template's markers) and the template reach the checkpoint, so generate and serve find the template and
    end a reply at <|im_end|>."""
    kw = dict(TRAIN_FAST, init_from=str(trained_out), batch_size=2, gradient_accumulation_steps=2, seq_len=None)
    kw.pop("preset")
    assert train_run(chat_data_dir, tmp_path / "straight", max_steps=4, **kw) == 0
    assert train_run(chat_data_dir, tmp_path / "resumed", max_steps=2, **kw) == 0
    assert train_run(chat_data_dir, tmp_path / "resumed", max_steps=4, resume="auto", **kw) == 0
    assert train_losses(tmp_path / "straight") == train_losses(tmp_path / "resumed")
    folders = chat.template_folders(str(tmp_path / "straight"))
    tok = find_tokenizer(model_source(str(tmp_path / "straight")))
    template = chat.load_template(None, folders, tok)
    assert template is not None and template.text == chat.DEFAULT_TEMPLATE
    assert tok.token_to_id(chat.DEFAULT_END) in chat.end_token_ids(folders, tok)


def test_train_refuses_a_seq_len_other_than_the_rows(chat_data_dir: Path, trained_out: Path, tmp_path: Path) -> None:
    kw = dict(TRAIN_FAST, init_from=str(trained_out), seq_len=32)
    kw.pop("preset")
    with pytest.raises(UserError, match="packed into rows of 64 tokens"):
        train_run(chat_data_dir, tmp_path / "out", max_steps=1, **kw)


def test_eval_chat_counts_exact_replies(trained_out: Path, tmp_path: Path) -> None:
    """A held-out set whose answers are the model's own greedy replies scores 1; change one answer and that one
    is wrong, shown with its line."""
    model_dir = tmp_path / "m"
    shutil.copytree(trained_out, model_dir)
    (model_dir / "chat_template.jinja").write_text(chat.DEFAULT_TEMPLATE)
    src = write_jsonl(tmp_path / "held.jsonl", [{"messages": m} for m in CONVERSATIONS[1:4]])
    examples = eval_cmd.read_chat_answers(src, None)
    plan = resolve("cpu")
    model, tok = load_for_inference(str(model_dir), tokenizer=None, plan=plan, dtype="fp32")
    folders = chat.template_folders(str(model_dir))
    template = chat.load_template(None, folders, tok)
    assert template is not None
    first = eval_cmd.chat_accuracy(model, tok, template, chat.end_token_ids(folders, tok), examples, plan, 2)
    own = [(w, m, r["reply"]) for (w, m, _), r in zip(examples, first["wrong"], strict=True)]
    assert len(own) == 3
    scored = eval_cmd.chat_accuracy(model, tok, template, chat.end_token_ids(folders, tok), own, plan, 2)
    assert scored["exact_match"] == 1.0
    own[1] = (own[1][0], own[1][1], own[1][2] + " and more")
    scored = eval_cmd.chat_accuracy(model, tok, template, chat.end_token_ids(folders, tok), own, plan, 2)
    assert scored["correct"] == 2 and [w["where"] for w in scored["wrong"]] == [own[1][0]]


@pytest.mark.slow
def test_a_tiny_pretrained_model_learns_the_chat_task(tmp_path: Path) -> None:
    """benchmarks/chat_task.py's task, the recipe of the report (benchmarks/2026-12-07-chat-fine-tuning.md): the
    tiny preset pretrained on the stdlib corpus answers none of the held-out conversations before; fine-tuned for
    CPU minutes it answers at least 90% exactly, through eval's Generator and through serve's chat completions
    with the openai client, and keeps its raw text within 5% bits per byte."""
    openai = pytest.importorskip("openai")
    task = load_script("chat_task")
    assert task.main(["--output_dir", str(tmp_path / "task"), "--train", "12000", "--heldout", "100"]) == 0
    held = tmp_path / "task" / "heldout.jsonl"
    assert cli.main(["prepare", "--output_dir", str(tmp_path / "text")]) == 0
    assert cli.main(["train", "--preset", "tiny", "--data_dir", str(tmp_path / "text"), "--output_dir",
                     str(tmp_path / "base"), "--max_steps", "500", "--use_amp", "--eval_interval", "0",
                     "--sample_tokens", "0", "--no-tensorboard"]) == 0
    assert cli.main(["prepare", "--input", str(tmp_path / "task" / "train.jsonl"), "--tokenizer",
                     str(tmp_path / "base"), "--output_dir", str(tmp_path / "chat"), "--seq_len", "256",
                     "--text_data", str(tmp_path / "text"), "--text_share", "0.25"]) == 0
    before = tmp_path / "before"  # the base model given the template fine-tuning teaches, to be asked before it
    shutil.copytree(tmp_path / "base", before)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        shutil.copy(tmp_path / "chat" / name, before / name)
    assert _chat_score(before, held) <= 0.05
    assert cli.main(["train", "--init_from", str(tmp_path / "base"), "--data_dir", str(tmp_path / "chat"),
                     "--output_dir", str(tmp_path / "sft"), *SFT_RECIPE, "--eval_interval", "0",
                     "--sample_tokens", "0", "--no-tensorboard"]) == 0
    assert _chat_score(tmp_path / "sft", held) >= 0.9

    from gptopt.config import ServeConfig
    from gptopt.serve.app import create_app
    from gptopt.serve.server import serve_in_thread

    app = create_app(ServeConfig(model=str(tmp_path / "sft"), device="cpu"))
    with serve_in_thread(app) as server:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x")
        examples = eval_cmd.read_chat_answers(held, None)
        right = sum(client.chat.completions.create(model="sft", messages=m, temperature=0, max_tokens=24)
                    .choices[0].message.content.strip() == answer.strip() for _, m, answer in examples)
    assert right >= 0.9 * len(examples)

    held_text = tmp_path / "held.txt"  # the text data's val split as text: both models' tokenizers read it alike
    text = TokenData(tmp_path / "text")
    assert text.tokenizer() is not None
    held_text.write_text(text.tokenizer().decode(text.tokens("val")[:50000].tolist()), encoding="utf-8")
    bpb = {name: _bpb(tmp_path / name, held_text) for name in ("base", "sft")}
    assert bpb["sft"] <= bpb["base"] * 1.05


# The fine-tuning of the report and the slow test: CPU minutes on the tiny preset
SFT_RECIPE = ("--max_steps", "2400", "--batch_size", "8", "--learning_rate", "1e-3", "--warmup_steps", "30",
              "--use_amp")


def _chat_score(model: Path, held: Path) -> float:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["eval", "--model", str(model), "--task", "chat", "--data", str(held), "--json",
                         "--batch_size", "16"]) == 0
    return last_json_line(buf.getvalue())["exact_match"]


def _bpb(model: Path, text: Path) -> float:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["eval", "--model", str(model), "--task", "bpb", "--data", str(text), "--json"]) == 0
    return last_json_line(buf.getvalue())["bits_per_byte"]


def test_an_exported_fine_tuned_model_answers_in_transformers_as_in_gptopt(chat_data_dir: Path, trained_out: Path,
                                                                            tmp_path: Path) -> None:
    """export --format hf keeps the template and the end of turn: transformers' apply_chat_template and generate
    give gptopt's greedy reply, ending at <|im_end|>."""
    transformers = pytest.importorskip("transformers")
    kw = dict(TRAIN_FAST, init_from=str(trained_out), seq_len=None)
    kw.pop("preset")
    assert train_run(chat_data_dir, tmp_path / "run", max_steps=2, **kw) == 0
    export = tmp_path / "hf"
    assert cli.main(["export", "--model", str(tmp_path / "run"), "--format", "hf", "--output_dir", str(export)]) == 0
    messages = CONVERSATIONS[2][:1]
    theirs = transformers.AutoTokenizer.from_pretrained(export)
    ids = theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    end = theirs.convert_tokens_to_ids(chat.DEFAULT_END)
    assert end in transformers.GenerationConfig.from_pretrained(export).eos_token_id

    plan = dataclasses.replace(resolve("cpu"), amp_dtype=None)
    ours, tok = load_for_inference(str(tmp_path / "run"), tokenizer=None, plan=plan, dtype="fp32")
    folders = chat.template_folders(str(tmp_path / "run"))
    template = chat.load_template(None, folders, tok)
    assert template is not None
    prompt = template.encode(tok, template.render(messages))
    assert prompt == ids
    reply = generate(Generator(ours, plan, max_batch_size=1, max_len=64), [prompt],
                     SamplingParams(max_new_tokens=12, temperature=0.0,
                                    stop_token_ids=chat.end_token_ids(folders, tok)))[0]
    # transformers keeps the end-of-turn token it stopped at; gptopt's reply ends before it
    assert out[: len(reply)] == reply and out[len(reply):] in ([], [end], [tok.token_to_id("<|endoftext|>")])


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_hugging_face_chat_model_fine_tunes_on_its_own_template(kind: str, debug_tokenizer: Tokenizer,
                                                                  tmp_path: Path) -> None:
    """A Llama- or Qwen3-shaped Hugging Face folder: its own template and tokens (nothing added, no vocabulary
    grown), the loss falling on its replies, and its checkpoints carrying its template and end-of-turn token."""
    folder = chat_model_dir(kind, debug_tokenizer, tmp_path / kind)
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CONVERSATIONS[1:] * 4])
    prepare(src, tmp_path / "data", folder, val_fraction=0.2, seq_len=64)
    kw = dict(TRAIN_FAST, init_from=str(folder), seq_len=None, learning_rate=3e-3, batch_size=2)
    kw.pop("preset")
    assert train_run(tmp_path / "data", tmp_path / "run", max_steps=8, **kw) == 0
    losses = train_losses(tmp_path / "run")
    assert losses[8] < losses[1]
    folders = chat.template_folders(str(tmp_path / "run"))
    tok = find_tokenizer(model_source(str(tmp_path / "run")))
    template = chat.load_template(None, folders, tok)
    assert template is not None and template.text == CHAT[kind][0]
    assert tok.token_to_id(CHAT[kind][3]) in chat.end_token_ids(folders, tok)
    assert tok.get_vocab_size() == debug_tokenizer.get_vocab_size() + len(CHAT[kind][1])


def test_sample_every_logs_the_models_reply_to_a_val_conversation(chat_data_dir: Path, trained_out: Path,
                                                                   tmp_path: Path) -> None:
    kw = dict(TRAIN_FAST, init_from=str(trained_out), seq_len=None, sample_tokens=4, sample_every=2)
    kw.pop("preset")
    assert train_run(chat_data_dir, tmp_path / "run", max_steps=4, **kw) == 0
    samples = eval_samples(tmp_path / "run")
    assert sorted(samples) == [2, 4]
    for text in samples.values():  # the val conversation's prompt ends where a reply begins, then the reply
        prompt, _, _reply = text.partition(" -> ")
        assert prompt.endswith("<|im_start|>assistant\n")


def lora_run(data: Path, source: Path, out: Path, steps: int, **kw: Any) -> int:
    args = dict(TRAIN_FAST, init_from=str(source), seq_len=None, lora_rank=4, learning_rate=3e-3, **kw)
    args.pop("preset")
    return train_run(data, out, max_steps=steps, **args)


def test_lora_trains_the_adapters_alone_resumes_bitwise_and_its_checkpoint_runs_merged(
        chat_data_dir: Path, trained_out: Path, tmp_path: Path) -> None:
    """The frozen weights are saved as they were and the adapters beside them; a resumed LoRA run continues bit
    for bit; every reader (checkpoint.load_model) gets the adapters merged, the logits of the model trained."""
    from safetensors.torch import load_file

    from gptopt.models import checkpoint, lora

    assert lora_run(chat_data_dir, trained_out, tmp_path / "straight", 4) == 0
    assert lora_run(chat_data_dir, trained_out, tmp_path / "resumed", 2) == 0
    assert lora_run(chat_data_dir, trained_out, tmp_path / "resumed", 4, resume="auto") == 0
    assert train_losses(tmp_path / "straight") == train_losses(tmp_path / "resumed")
    ckpt = checkpoint.latest_checkpoint(tmp_path / "straight")
    assert ckpt is not None and checkpoint.read_meta(ckpt)["lora"]["rank"] == 4
    source = checkpoint.load_model(model_source(str(trained_out)))
    frozen = load_file(str(ckpt / checkpoint.WEIGHTS))
    for name, w in source.state_dict().items():  # the blocks' weights untouched (the embedding grew two rows)
        if name.startswith("transformer.h."):
            assert torch.equal(frozen[name], w), name
    adapted = lora.add_lora(checkpoint.load_model(ckpt, merge_lora=False), 4, 16.0)
    adapted.load_state_dict(load_file(str(ckpt / lora.ADAPTER)), strict=False)
    merged = checkpoint.load_model(ckpt)
    x = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert not torch.allclose(merged(x), checkpoint.load_model(ckpt, merge_lora=False)(x), atol=1e-4)
        torch.testing.assert_close(merged(x), adapted(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_peft_loads_a_lora_checkpoint_over_the_hugging_face_base(kind: str, debug_tokenizer: Tokenizer,
                                                                  tmp_path: Path) -> None:
    """The checkpoint is a peft adapter folder too: PeftModel over the Hugging Face model fine-tuning began from
    gives the logits of gptopt's merged checkpoint (c_attn's adapter split into q_proj, k_proj and v_proj), and of
    its export, which merges them."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from gptopt.models import checkpoint

    folder = chat_model_dir(kind, debug_tokenizer, tmp_path / kind)
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CONVERSATIONS[1:] * 4])
    prepare(src, tmp_path / "data", folder, val_fraction=0.2, seq_len=64)
    assert lora_run(tmp_path / "data", folder, tmp_path / "run", 3, batch_size=2) == 0
    ckpt = checkpoint.latest_checkpoint(tmp_path / "run")
    assert ckpt is not None
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, ckpt).eval()
    ours = checkpoint.load_model(ckpt).eval()
    x = torch.randint(0, 300, (1, 12))
    assert cli.main(["export", "--model", str(tmp_path / "run"), "--format", "hf", "--output_dir",
                     str(tmp_path / "merged")]) == 0  # export merges the adapters
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        want = theirs(input_ids=x).logits
        got = ours(x)
        merged = exported(input_ids=x).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(merged, want, atol=1e-4, rtol=1e-4)


def test_text_share_mixes_windows_of_the_models_text_into_the_train_rows(chat_data_dir: Path, trained_out: Path,
                                                                         train_data: Path, tmp_path: Path) -> None:
    """--text_data's windows, every token learned, make --text_share of the train rows; val keeps the
    conversations alone, and text of another tokenizer is refused."""
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CONVERSATIONS * 4])
    data = prepare(src, tmp_path / "mixed", trained_out, val_fraction=0.2, text_data=str(train_data), text_share=0.5)
    train = data.chat["splits"]["train"]
    assert train["text_rows"] == round(train["rows"] - train["text_rows"])
    ids, mask, _ = data.rows("train")
    text = TokenData(train_data).tokens("train")
    first_text = len(ids) - train["text_rows"]
    assert ids[first_text].tolist() == text[:64].tolist()  # the first window starts the split
    assert mask[first_text:, 1:].all() and not mask[first_text:, 0].any()
    assert "text_rows" not in data.chat["splits"]["val"]
    with pytest.raises(UserError, match="not text tokenized with the model's tokenizer"):  # conversations are not
        prepare(src, tmp_path / "refused", trained_out, text_data=str(chat_data_dir), text_share=0.5)


def test_a_lora_run_is_overwritten_or_refused_as_a_run_is(chat_data_dir: Path, trained_out: Path,
                                                          tmp_path: Path) -> None:
    """--overwrite replaces a LoRA run (its adapter files are gptopt's); a run of every weight is not resumed as
    LoRA; and under LoRA's frozen embedding the end of a turn starts as the end-of-text token, so a reply ends."""
    from gptopt.models import checkpoint

    assert lora_run(chat_data_dir, trained_out, tmp_path / "run", 1) == 0
    assert lora_run(chat_data_dir, trained_out, tmp_path / "run", 1, overwrite=True) == 0
    kw = dict(TRAIN_FAST, init_from=str(trained_out), seq_len=None)
    kw.pop("preset")
    assert train_run(chat_data_dir, tmp_path / "full", max_steps=1, **kw) == 0
    with pytest.raises(UserError, match="trains every weight"):
        train_run(chat_data_dir, tmp_path / "full", max_steps=2, resume="auto", lora_rank=4, **kw)
    model = checkpoint.load_model(checkpoint.latest_checkpoint(tmp_path / "run"))  # type: ignore[arg-type]
    tok = TokenData(chat_data_dir).tokenizer()
    assert tok is not None
    wte = model.transformer.wte.weight
    assert torch.equal(wte[tok.token_to_id(chat.DEFAULT_END)], wte[tok.token_to_id("<|endoftext|>")])


def test_text_readers_refuse_conversation_rows(chat_data_dir: Path, trained_out: Path) -> None:
    from gptopt.data.loader import BatchDataset

    with pytest.raises(UserError, match="holds conversations packed for fine-tuning"):
        BatchDataset(TokenData(chat_data_dir), "train", 2, 16, seed=0)
    with pytest.raises(UserError, match="holds conversations packed for fine-tuning"):
        eval_cmd.read_held_out(chat_data_dir, "--data")


def test_the_chat_task_holds_out_word_lists_training_never_answers_last(tmp_path: Path) -> None:
    task = load_script("chat_task")
    assert task.main(["--output_dir", str(tmp_path), "--train", "300", "--heldout", "40"]) == 0
    train, held = ([json.loads(line)["messages"] for line in (tmp_path / name).read_text().splitlines()]
                   for name in ("train.jsonl", "heldout.jsonl"))
    assert (len(train), len(held)) == (300, 40)
    last = {m[-1]["content"] for m in train}
    for m in held:
        words = m[-2]["content"].removeprefix("Reverse: ").split()
        assert m[-1]["content"] == " ".join(reversed(words)) and m[-1]["content"] not in last
    assert chat_data.detect(tmp_path / "train.jsonl") == "messages"


def test_trl_supervises_the_tokens_gptopt_does(debug_tokenizer: Tokenizer, tmp_path: Path) -> None:
    """benchmarks/trl_masks.py: TRL's SFTTrainer (assistant_only_loss) and gptopt's prepare agree token by token on
    a folder without a template of its own (the marked ChatML) (skipped where trl is not installed)."""
    pytest.importorskip("trl")
    folder = chat_model_dir("qwen3", debug_tokenizer, tmp_path / "qwen3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tool = load_script("trl_masks")
    copy_ = tool.marked_copy(folder, tmp_path / "work")
    result = tool.compare(copy_, CONVERSATIONS, tmp_path / "work")
    assert result["same"] == len(CONVERSATIONS) and result["supervised_gptopt"] == result["supervised_trl"] > 0


def test_a_line_that_is_not_utf8_is_refused_with_its_number(trained_out: Path, tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CONVERSATIONS[:2]])
    src.write_bytes(src.read_bytes() + b'{"messages": [{"role": "user", "content": "\xff"}]}\n')
    with pytest.raises(UserError, match=r"chats.jsonl:3: not UTF-8 text"):
        prepare(src, tmp_path / "data", trained_out)
    assert not (tmp_path / "data").exists()
