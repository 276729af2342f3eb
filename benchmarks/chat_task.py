"""A synthetic chat task for fine-tuning tests and demos: reverse the order of a few words, over two turns.

    python benchmarks/chat_task.py --output_dir data/chat_task [--train 4000] [--heldout 200] [--seed 0]

Writes train.jsonl ({"messages": [...]}, every turn answered) and heldout.jsonl (the same form; the last assistant
turn is the answer that `gptopt eval --task chat` compares with the model's reply). A model pretrained on text
cannot do it: it has never seen the turns' format nor the task; a few CPU minutes of `gptopt train` on train.jsonl
teach the tiny preset both. The words are common English and Python words, so that each is a token or two of any
BPE; the held-out lists are lists the training set does not hold.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("apple", "river", "stone", "green", "table", "light", "house", "water", "music", "paper", "class", "import",
         "return", "value", "print", "list", "string", "number", "open", "close", "yield", "first", "last", "bird",
         "cloud", "train", "glass", "plant", "sugar", "smile")
SYSTEM = "You reverse the order of the words the user gives."


def exchange(rng: random.Random) -> tuple[list[str], str, str]:
    words = rng.sample(WORDS, rng.randint(3, 5))
    return words, "Reverse: " + " ".join(words), " ".join(reversed(words))


def conversation(rng: random.Random) -> tuple[list[dict[str, str]], tuple[str, ...]]:
    """Two exchanges, and the word list of the last (what makes a conversation held out)."""
    messages = [{"role": "system", "content": SYSTEM}]
    words: list[str] = []
    for _ in range(2):
        words, question, answer = exchange(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages, tuple(words)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--train", type=int, default=4000, help="training conversations")
    ap.add_argument("--heldout", type=int, default=200, help="held-out conversations")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    heldout, held = [], set()
    while len(heldout) < args.heldout:
        messages, last = conversation(rng)
        if last not in held:
            held.add(last)
            heldout.append(messages)
    train = []
    while len(train) < args.train:
        messages, last = conversation(rng)
        if last not in held:
            train.append(messages)
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        with open(out / name, "w") as fh:
            fh.writelines(json.dumps({"messages": m}) + "\n" for m in rows)
    print(f"wrote {len(train)} training and {len(heldout)} held-out conversations to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
