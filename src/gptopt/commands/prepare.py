"""gptopt prepare: text (files, a folder, a Hugging Face dataset, or Python's stdlib) -> a BPE tokenizer and
token shards in a data directory (data/corpus.py does the work).

    gptopt prepare                                       # stdlib corpus, byte-level BPE of 8192 -> data/stdlib
    gptopt prepare --input my_texts/ --output_dir data/mine --vocab_size 4096
"""

from __future__ import annotations

import json
import time

from gptopt.config import PrepareConfig
from gptopt.data.corpus import META, tokenize_corpus


def main(config: PrepareConfig) -> int:
    start = time.perf_counter()
    out = tokenize_corpus(config)
    meta = json.loads((out / META).read_text())
    print(
        f"prepared {meta['documents']:,} documents -> {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
        f"tokens, vocab {meta['vocab_size']:,} ({meta['dtype']}), {time.perf_counter() - start:.1f} s -> {out}"
    )
    return 0

