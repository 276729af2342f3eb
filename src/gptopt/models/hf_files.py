"""What a Hugging Face model folder holds beside its weights, and what a model made from it keeps.

    python -c "from pathlib import Path; import gptopt.models.hf_files as f; print(f.special_ids([Path('.')]))"

A chat model's folder says how to talk to it: tokenizer_config.json (its chat template, its bos and eos tokens),
chat_template.jinja (newer transformers keep the template there), special_tokens_map.json, and the ids that begin
and end a sequence (bos_token_id and eos_token_id of config.json and generation_config.json; Qwen3's and Llama 3's
eos is a list, their end of turn among them). A model trained from it (train --init_from), resumed or exported
keeps all of them (carried, write_carried), so that it chats, and ends its turns, as its source did.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gptopt.utils.errors import UserError

HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"  # transformers' generate reads its defaults (eos_token_id) here
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # transformers >= 4.43 saves the template here
# The files a chat model's folder carries beside its tokenizer.json: its template and special tokens, kept verbatim
CHAT_FILES = (TOKENIZER_CONFIG, TEMPLATE_FILE, "special_tokens_map.json")


def read_json(path: Path, fix: str = "fix or remove the file") -> dict[str, Any]:
    """A model file's JSON object; a file that is not one names itself and the fix."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read it as JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object; {fix}")
    return data


def token_ids(path: Path, data: dict[str, Any], key: str, *, many: bool = True) -> list[int]:
    """data[key] as a list of ids: absent or null is none, an id is one, a list (where many) is each. Anything else
    is refused naming the file and the field: an end id skipped in silence lets a reply run past its end."""
    value = data.get(key)
    if value is None:
        return []
    ids = value if many and isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        kind = "a token id or a list of them" if many else "a token id"
        raise UserError(f"{path}: {key} must be {kind}, not {value!r}; fix the file")
    return ids


def special_ids(folders: Sequence[Path]) -> tuple[int | None, list[int]]:
    """The model's own beginning-of-sequence id and every end-of-sequence id, from generation_config.json, then
    config.json, of each folder in turn: bos the first given, eos each id of all of them in that order, once.
    (None, []) where no file names any (a gptopt checkpoint trained from scratch)."""
    bos: int | None = None
    eos: list[int] = []
    for d in folders:
        for name in (GENERATION_CONFIG, HF_CONFIG):
            path = d / name
            if not path.is_file():
                continue
            data = read_json(path)
            first = token_ids(path, data, "bos_token_id", many=False)
            bos = first[0] if bos is None and first else bos
            eos += token_ids(path, data, "eos_token_id")
    return bos, list(dict.fromkeys(eos))


def chat_files(folders: Sequence[Path]) -> list[Path]:
    """Each of CHAT_FILES from the first of `folders` that has it."""
    found: dict[str, Path] = {}
    for d in folders:
        for name in CHAT_FILES:
            if name not in found and (d / name).is_file():
                found[name] = d / name
    return list(found.values())


def carried(folders: Sequence[Path]) -> dict[str, bytes]:
    """What a model made from the model in `folders` keeps of it, as file name -> contents: its CHAT_FILES as they
    are, and a generation_config.json of its bos and every eos id (what a gptopt folder holds of its ids, which
    generate, serve and export read as they read a Hugging Face folder's). Read once, when a run starts: the
    source may be gone, or retention may delete the checkpoint a run resumed from, before the run saves."""
    files = {f.name: f.read_bytes() for f in chat_files(folders)}
    bos, eos = special_ids(folders)
    if bos is not None or eos:
        ids = {"bos_token_id": bos, "eos_token_id": eos[0] if len(eos) == 1 else eos or None}
        files[GENERATION_CONFIG] = (json.dumps(ids, indent=2) + "\n").encode()
    return files


def write_carried(files: Mapping[str, bytes], directory: Path) -> None:
    """carried's files into a model directory being written (a staged one)."""
    for name, data in files.items():
        (directory / name).write_bytes(data)
