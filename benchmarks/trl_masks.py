"""The tokens fine-tuning supervises, gptopt's against TRL's: the same conversations through TRL's SFTTrainer
(assistant_only_loss) and gptopt's prepare, the same tokenizer and template, compared token by token.

    python benchmarks/trl_masks.py --model HF_DIR --data chats.jsonl [--n 100] --work_dir DIR   # needs trl

TRL finds the replies by the template's `{% generation %}` marks; gptopt by rendering. HF_DIR is copied into
--work_dir; a folder without a template gets gptopt's default ChatML with its two markers added to the tokenizer,
written with the marks (the same text: MARKED_CHATML). Prints JSON last: the conversations whose token ids and
supervised tokens agree, and each side's count of supervised tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from gptopt.infer import chat
from gptopt.train import chat_data

MARKED_CHATML = ("{% for message in messages %}{% if message['role'] == 'assistant' %}<|im_start|>assistant\n"
                 "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>"
                 "{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def marked_copy(model: Path, work: Path) -> Path:
    """model copied into work, its template MARKED_CHATML where it has none of its own."""
    folder = work / "model"
    shutil.copytree(model, folder, dirs_exist_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if chat.load_template(None, [folder]) is None:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.add_special_tokens([chat.DEFAULT_START, chat.DEFAULT_END])
        tok.save(str(folder / "tokenizer.json"))
        config.update(chat_template=MARKED_CHATML, eos_token=chat.DEFAULT_END)
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("pad_token", config.get("eos_token"))
    config_path.write_text(json.dumps(config))
    return folder


def compare(folder: Path, conversations: list[list[dict[str, str]]], work: Path) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    hf_tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(hf_tok))
    args = SFTConfig(output_dir=str(work / "trl"), assistant_only_loss=True, packing=False, max_length=4096,
                     report_to=[], dataset_num_proc=1, use_cpu=True, bf16=False)
    trainer = SFTTrainer(model=model, processing_class=hf_tok, args=args,
                         train_dataset=Dataset.from_list([{"messages": m} for m in conversations]))
    theirs = trainer.train_dataset
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    template = chat.load_template(None, [folder], tok)
    assert template is not None
    same, ours_n, theirs_n = 0, 0, 0
    for i, messages in enumerate(conversations):
        ours = chat_data.tokenize(template, tok, chat.check_messages(messages))
        mask = [int(label != -100) for label in theirs[i]["labels"]]
        same += ours.ids == list(theirs[i]["input_ids"]) and ours.mask == mask
        ours_n, theirs_n = ours_n + sum(ours.mask), theirs_n + sum(mask)
    return {"conversations": len(conversations), "same": same, "supervised_gptopt": ours_n,
            "supervised_trl": theirs_n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face folder (its tokenizer and template)")
    ap.add_argument("--data", required=True, help="a .jsonl of {messages} lines")
    ap.add_argument("--n", type=int, default=100, help="conversations compared")
    ap.add_argument("--work_dir", required=True, help="where the model's copy and TRL's output go")
    args = ap.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    conversations = [m for _, m in chat_data.read_lines(Path(args.data), "messages")][: args.n]
    result = compare(marked_copy(Path(args.model), work), conversations, work)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
