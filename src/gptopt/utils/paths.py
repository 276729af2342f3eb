"""Telling a local path from a Hugging Face Hub name before anything is fetched.

    python -c "from gptopt.utils.paths import looks_local; print(looks_local('out/ckpt-typo'), looks_local('gpt2'))"
"""

from __future__ import annotations

from pathlib import Path


def missing_model(name: str, option: str) -> str:
    """The refusal of a model option (--model, --draft_model, --init_from) that names no folder, in the words the
    command line (as it reads the options) and the loader (infer.load.model_source) both use."""
    return f"{option} {name}: no such directory; " + model_advice(name, option)


def model_advice(name: str, option: str) -> str:
    return (f"train one first (`gptopt train --output_dir {name}`), or pass {option}: a training output dir, a "
            "checkpoint dir, a Hugging Face model dir or a hub name like gpt2")


def looks_local(name: str) -> bool:
    """Whether `name`, which names nothing on disk, was meant as a local path: it starts as a path does
    ('/', '.', '~'), has more than one '/' or a backslash, ends in '/', or its first part is a folder here
    ('out/ckpt-0000002x' where out/ exists). Such a name fails at once, naming the path, instead of being tried
    on the Hub ('org/name'), which offline costs its retries, then says something else."""
    if name.startswith(("/", ".", "~")) or "\\" in name or name.endswith("/") or name.count("/") > 1:
        return True
    first, sep, _ = name.partition("/")
    return bool(sep) and Path(first).expanduser().is_dir()
