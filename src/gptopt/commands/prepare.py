"""gptopt prepare: text (files, a folder, a Hugging Face dataset, or Python's stdlib) -> a BPE tokenizer and
token shards in a data directory (data/corpus.py does the work); or conversations (a .jsonl of {messages} or
{prompt, completion} lines) -> packed rows with a loss mask for fine-tuning (train/chat_data.py).

    gptopt prepare                                       # stdlib corpus, byte-level BPE of 8192 -> data/stdlib
    gptopt prepare --input my_texts/ --output_dir data/mine --vocab_size 4096
    gptopt prepare --input chats.jsonl --tokenizer runs/base --output_dir data/chat --seq_len 512
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from gptopt.config import PrepareConfig
from gptopt.data.corpus import META, tokenize_corpus
from gptopt.train import chat_data


def main(config: PrepareConfig) -> int:
    start = time.perf_counter()
    reading = config.format if config.format != "auto" else \
        chat_data.detect(Path(config.input).expanduser()) if config.input else None
    if reading in chat_data.READINGS:
        out = chat_data.prepare_chat(config, reading)
        meta = json.loads((out / META).read_text())
        tr, va = meta["chat"]["splits"]["train"], meta["chat"]["splits"]["val"]
        print(f"prepared {meta['documents']:,} conversations ({reading}) -> {tr['rows']:,} train + {va['rows']:,} val "
              f"rows of {meta['chat']['seq_len']} tokens, {tr['supervised']:,} train tokens supervised "
              f"({tr['supervised'] / max(1, tr['tokens']):.0%} of {tr['tokens']:,}); template: "
              f"{meta['chat']['template']}; {time.perf_counter() - start:.1f} s -> {out}")
        return 0
    out = tokenize_corpus(config)
    meta = json.loads((out / META).read_text())
    print(
        f"prepared {meta['documents']:,} documents -> {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
        f"tokens, vocab {meta['vocab_size']:,} ({meta['dtype']}), {time.perf_counter() - start:.1f} s -> {out}"
    )
    return 0

