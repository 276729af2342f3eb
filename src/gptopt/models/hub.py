"""The Hugging Face Hub: whether a model name that is no local folder can be had from it, told at once.

    python -c "from gptopt.models.hub import check_name; check_name('openai-community/gpt2')"

A name such as `ot/ckpt-0000030` (a typo of `out/ckpt-0000030`) looks like the Hub's `org/name`. Asked of an
unreachable Hub, huggingface_hub and tokenizers retry for most of a minute, then fail on something else (the
tokenizer). check_name asks once, without retries, and names the model and why; models.hf downloads the files.
"""

from __future__ import annotations

import os
from typing import Any

from gptopt.models.hf_files import HF_CONFIG
from gptopt.utils.errors import UserError
from gptopt.utils.extras import require

PROBE_TIMEOUT = 10.0  # seconds the one request of check_name waits for the Hub: huggingface_hub's own default


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set. huggingface_hub reads it once, at import; read here each
    time, so that a later setting counts."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def check_name(name: str, option: str = "--model") -> None:
    """Refuse at once, naming `option` and the model, a hub name the Hub cannot provide: not in the local cache, and
    the Hub offline (HF_HUB_OFFLINE), unreachable, or without such a model. One request, no retries. A model the
    Hub has behind a licence, or without a config.json, passes: its download says what is wrong."""
    hub = require("huggingface_hub", "hf", f"{option} {name} (a Hugging Face Hub name)")
    from huggingface_hub import errors

    try:
        if isinstance(hub.try_to_load_from_cache(name, HF_CONFIG), str):
            return  # in the local cache: it loads offline too
    except errors.HFValidationError:
        pass  # not a name the Hub accepts: the request below says so
    neither = f"{option} {name} is neither a local folder nor"
    if offline():
        raise UserError(f"{neither} reachable: HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache; "
                         "check the path, or unset HF_HUB_OFFLINE to download it")
    try:
        _probe(hub, name)
    except errors.GatedRepoError:
        return
    except (errors.RepositoryNotFoundError, errors.HFValidationError):
        raise UserError(f"{neither} a model on the Hugging Face Hub; check the path, or the model's name") from None
    except errors.HfHubHTTPError:
        return  # the Hub answered about the model: its download tells the rest
    except Exception as e:  # the network's errors: no route, no name service, a timeout
        lines = str(e).strip().splitlines()
        raise UserError(f"{neither} reachable: the Hugging Face Hub did not answer ({type(e).__name__}: "
                         f"{lines[0] if lines else ''}); check the path, or the network") from None


def _probe(hub: Any, name: str) -> None:
    """One request for the model's config.json (no retries: huggingface_hub retries only when asked)."""
    hub.get_hf_file_metadata(hub.hf_hub_url(name, HF_CONFIG), timeout=PROBE_TIMEOUT)
