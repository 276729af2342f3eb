"""The sampling step's cost with and without response_format: Generator.sample_next of 16 rows on random
logits, plain rows against rows constrained by a JSON schema, alternated round by round; medians in ms.

    python benchmarks/sample_cost.py --vocab 8192 50257            # BPEs trained on the stdlib sources
    python benchmarks/sample_cost.py --tokenizer gpt2/tokenizer.json --temperature 1

The model's vocabulary is the tokenizer's padded as inference.check_vocab allows. Needs the serve extra (llguidance).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from tokenizers import Tokenizer

from gptopt.config import GPTConfig
from gptopt.data.corpus import stdlib_corpus, train_bpe
from gptopt.infer.constrain import Grammars, grammar_for
from gptopt.infer.generator import Generator
from gptopt.infer.load import VOCAB_PAD
from gptopt.infer.sampling import SamplingParams
from gptopt.models.gpt import GPT
from gptopt.runtime.device import resolve

EOT = "<|endoftext|>"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color", "scores"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "scores": {"type": "array", "items": {"type": "number"}}}}


def trained(vocab: int) -> Tokenizer:
    return train_bpe(iter(stdlib_corpus()), vocab)  # as `gptopt prepare` trains one: end of text is id 0


def measure(tok: Tokenizer, *, rows: int, temperature: float, rounds: int, steps: int) -> dict[str, float]:
    eot = tok.token_to_id(EOT)
    vocab = -(-tok.get_vocab_size() // VOCAB_PAD) * VOCAB_PAD
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=32, block_size=steps + 8, vocab_size=vocab)).eval()
    gen = Generator(model, resolve("cpu", quiet=True), max_batch_size=rows, grammars=Grammars(tok, eot, vocab))
    grammar = grammar_for({"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for constrained in (False, True) if r % 2 == 0 else (True, False):
            seqs = [gen.open([1, 2, 3], SamplingParams(temperature=temperature, top_k=None, max_new_tokens=steps,
                                                       seed=i, stop_token_ids=(eot,),
                                                       grammar=grammar if constrained else None))
                    for i in range(rows)]
            logits = torch.randn(rows, vocab)
            for _ in range(steps):
                if any(s.finish is not None for s in seqs):
                    break  # every timed step samples all the rows
                t = time.perf_counter()
                tokens = gen.sample_next(logits, seqs)
                times[constrained].append(time.perf_counter() - t)
                for s, token in zip(seqs, tokens, strict=True):
                    s.add(token)
            for s in seqs:
                gen.end(s)
    return {f"{'constrained' if c else 'plain'}_ms": round(statistics.median(times[c]) * 1e3, 3) for c in times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", nargs="*", default=[], help="tokenizer.json files with an end-of-text token")
    parser.add_argument("--vocab", nargs="*", type=int, default=[], help="train a stdlib BPE of this size")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; otherwise sampled, no top_k")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    tokenizers = [(path, Tokenizer.from_file(path)) for path in args.tokenizer]
    tokenizers += [(f"stdlib BPE {v}", trained(v)) for v in args.vocab]
    for name, tok in tokenizers or [("stdlib BPE 8192", trained(8192))]:
        print(json.dumps({"tokenizer": name, "vocab": tok.get_vocab_size(with_added_tokens=True), "rows": args.rows,
                          "temperature": args.temperature,
                          **measure(tok, rows=args.rows, temperature=args.temperature, rounds=args.rounds,
                                    steps=args.steps)}))


if __name__ == "__main__":
    main()
