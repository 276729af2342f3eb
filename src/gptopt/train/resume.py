"""A run's folder and where it starts: the checks of --output_dir before any work, the checkpoint a run
resumes from (--resume), the lineage its new checkpoints continue, and the RNG state a checkpoint carries.

    python -c "from gptopt.train.resume import RUN_ENTRIES; print(RUN_ENTRIES)"

Exactness: batches are a pure function of (seed, micro-step), so a checkpoint needs only the step, the
optimizer, the scaler and the RNGs to continue bit for bit.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from gptopt import outputs
from gptopt.config import (
    ARCH_FIELDS,
    DEFAULT_PRESET,
    PRESETS,
    GPTConfig,
    TrainConfig,
    arch_overrides,
    preset,
    preset_for_data,
)
from gptopt.data.loader import TokenData
from gptopt.data.tokenizer import TOKENIZER, tokenizer_digest
from gptopt.infer import chat
from gptopt.infer.load import model_source, own_tokenizer
from gptopt.models import checkpoint, hf, hf_files, lora
from gptopt.models.gpt import GPT
from gptopt.train import distributed
from gptopt.train.distributed import DistInfo
from gptopt.utils.errors import UserError

log = logging.getLogger("gptopt")

RUN_KIND = "train-run"  # the output-folder mark (outputs.mark) of a training run
# Every top-level entry a run writes into --output_dir: a folder holding any of them holds a run, which
# only --resume continues and only --overwrite replaces. The user's other files there are never touched.
# What a run writes inside its folders: anything else there is the user's, and --overwrite keeps away.
RUN_CONTENTS = {f"{checkpoint.PREFIX}*": [checkpoint.WEIGHTS, checkpoint.META, checkpoint.TRAIN_STATE, TOKENIZER,
                                          *hf_files.CHAT_FILES, hf_files.GENERATION_CONFIG, lora.ADAPTER,
                                          lora.PEFT_WEIGHTS, lora.PEFT_CONFIG],
                "logs": ["events.out.tfevents.*", "profile/*"]}
RUN_ENTRIES = (f"{checkpoint.PREFIX}*", checkpoint.LATEST, "metrics.jsonl", "run.json", "monitor.json", "logs")


def check_run_output(cfg: TrainConfig, info: DistInfo) -> list[Path]:
    """Refuse a bad --output_dir before any work; returns the old run's entries that --overwrite replaces.

    Rank 0 also gives back what a killed --overwrite had moved aside and removes dead processes'
    staging folders (kill -9 mid-save), in every mode: the other ranks wait, then judge the same folder."""
    out, main = Path(cfg.output_dir), info.is_main
    if main:
        outputs.recover(out, RUN_ENTRIES)
        outputs.check_output(out, kind=RUN_KIND, overwrite=False)  # a file? writable? (+ the clean-up)
    distributed.barrier(info)
    found = sorted(p.name for p in out.iterdir() if any(fnmatch.fnmatchcase(p.name, g) for g in RUN_ENTRIES)) \
        if out.is_dir() else []
    # A run of gptopt's is marked, or (from before marks) has its checkpoints. Files of a run's names that
    # are not one are the user's: neither --resume nor --overwrite writes over them, so that is said now.
    if found and outputs.marked_kind(out) != RUN_KIND and not checkpoint.checkpoint_dirs(out):
        raise UserError(f"--output_dir {out} holds {outputs.some(found)}, which gptopt did not write (no run of "
                         "its own is there); nothing was written, and neither --resume nor --overwrite would write "
                         "over them: move them out, or choose another --output_dir")
    if cfg.resume:
        return []
    if found and not cfg.overwrite:
        raise UserError(f"--output_dir {out} holds a training run ({outputs.some(found)}); nothing was written: "
                         "pass --resume auto to continue it, --overwrite to replace it (kept until the new run "
                         "saves its first checkpoint), or choose another --output_dir")
    if not found or not main:
        return []
    return outputs.check_output(out, kind=RUN_KIND, overwrite=True, ours=RUN_ENTRIES, contents=RUN_CONTENTS)


def resume_dir(cfg: TrainConfig) -> Path | None:
    """The checkpoint --resume names (auto: the run's latest), or None for a fresh start."""
    if cfg.resume == "auto":
        latest = checkpoint.latest_checkpoint(cfg.output_dir)
        if latest is None:
            log.info(f"--resume auto: no checkpoint in {cfg.output_dir}, starting afresh")
        return latest
    if cfg.resume:
        path = Path(cfg.resume)
        if not (path / checkpoint.TRAIN_STATE).is_file():
            what = ("no such directory" if not path.exists()
                    else f"not a training checkpoint (no {checkpoint.TRAIN_STATE})")
            raise UserError(f"--resume {cfg.resume}: {what}; pass --resume auto or a ckpt-* directory of a run")
        return path
    return None


def lineage(out: Path, resumed: Path | None, info: DistInfo) -> list[str]:
    """The chain the new checkpoints continue: the resumed checkpoint's, when it lies in --output_dir
    (one from elsewhere starts a chain here). Later checkpoints of another branch are named, and kept."""
    if resumed is None or resumed.resolve().parent != out.resolve():
        return []
    abandoned = checkpoint.abandoned_after(resumed)
    if abandoned and info.is_main:
        log.warning(f"resuming from {resumed.name}: {', '.join(d.name for d in abandoned)} belong to an "
                    "abandoned branch of this run; they are kept (retention and `latest` follow this run's "
                    "lineage), except where this run saves a checkpoint of the same step")
    return checkpoint.lineage(resumed)


def check_ranks_resume_alike(state: dict[str, Any], resumed: Path | None, info: DistInfo,
                             device: torch.device) -> None:
    """Every rank reads its checkpoint from its own file system: on machines that do not share the output
    folder, one rank could resume while another starts afresh, and DDP would then train one model under
    optimizer states and data positions that differ between ranks. Refused on every rank alike."""
    step = int(state["step"]) if state else -1  # -1: no checkpoint, a fresh start
    low, high = distributed.spread(step, info, device)
    if low != high:
        def at(s: int) -> str:
            return "start afresh" if s < 0 else f"resume at step {s}"
        raise UserError(
            f"the ranks disagree on where to start: some would {at(low)}, others {at(high)} (rank "
            f"{info.rank}: {at(step)}, from {resumed or 'no checkpoint'}). Each rank reads "
            "--output_dir (for --resume auto) or --resume on its own machine: put the output folder on storage "
            "every machine shares, or the same checkpoint at the same path on each")


def build_model(cfg: TrainConfig, attention: str, data_vocab: int, resumed: Path | None) -> GPT:
    """The model a run starts from: its checkpoint's (resumed), a new one of --preset and --arch sized for the
    data's vocabulary (data_vocab), or --init_from's pretrained weights; with the run's own runtime switches
    (the attention kernel, checkpointing, dropout, the loss)."""
    runtime = dict(attention=attention, gradient_checkpointing=cfg.gradient_checkpointing, dropout=cfg.dropout,
                   loss="full" if cfg.loss == "auto" else cfg.loss)  # auto is settled by memory, in the loop's setup
    if resumed is not None:
        meta = checkpoint.read_meta(resumed)
        stored = GPTConfig.from_dict(meta["model"])
        check_resumed_shape(cfg, stored, meta.get("train_config") or {}, resumed)
        # a LoRA run's frozen weights as they were: with_lora puts its adapters back over them
        return _with_config(checkpoint.load_model(resumed, merge_lora=False), dataclasses.replace(stored, **runtime))
    if cfg.init_from == "scratch":
        return GPT(preset_for_data(cfg.preset or DEFAULT_PRESET, data_vocab, vocab_pad_multiple=cfg.vocab_padding,
                                   **arch_overrides(cfg.arch), **runtime))
    if cfg.arch:
        raise UserError(f"--arch designs a new model; {cfg.init_from} comes with its own: drop --arch, or "
                         "train from scratch")
    if cfg.init_from in ("debug", "tiny"):
        raise UserError(f"--init_from {cfg.init_from}: no pretrained weights exist; use --preset {cfg.init_from}")
    source = model_source(cfg.init_from, "--init_from")  # as generate --model: an output dir is its latest checkpoint
    return hf.load_pretrained(source, vocab_pad_multiple=cfg.vocab_padding, **runtime)


def carried_files(cfg: TrainConfig, resumed: Path | None, data: TokenData | None = None) -> dict[str, bytes]:
    """What the run's checkpoints keep of the model it starts from (hf_files.carried: its chat template, special
    tokens and every end id), from the resumed checkpoint, --init_from's folders (those generate --model reads
    them from), or a hub name's snapshot (build_model fetched it, with these files), so that a fine-tuned chat
    model chats and ends its turns as its source did; and over those, chat data's own template and special tokens
    (`data`: what the conversations were rendered with, which the model learns). None for a run from scratch on
    text."""
    ours = hf_files.carried([data.directory]) if data and data.chat else {}
    if resumed is None and cfg.init_from == "scratch":
        return ours
    if resumed is None and isinstance(source := model_source(cfg.init_from, "--init_from"), str):
        return {**hf_files.carried([hf.hub_folder(source, fetched=True)]), **ours}
    return {**hf_files.carried(chat.template_folders(str(resumed) if resumed is not None else cfg.init_from)),
            **ours}


def with_lora(model: GPT, cfg: TrainConfig, resumed: Path | None) -> GPT:
    """The model with --lora_rank's adapters (models.lora.add_lora): new ones, or a resumed run's own, which must
    be of the rank it asks. Unchanged without --lora_rank and without adapters to resume."""
    had = checkpoint.read_meta(resumed).get("lora") if resumed is not None else None
    if resumed is not None and not had and cfg.lora_rank:
        raise UserError(f"--lora_rank {cfg.lora_rank}: the run resumed from {resumed} trains every weight; resume it "
                         "without --lora_rank, or start LoRA from it with --init_from and a new --output_dir")
    if had and had["rank"] != cfg.lora_rank:
        raise UserError(f"--lora_rank {cfg.lora_rank}: the run resumed from {resumed} trains adapters of rank "
                         f"{had['rank']}; give --lora_rank {had['rank']}")
    if not cfg.lora_rank:
        return model
    if had and had["alpha"] != cfg.lora_alpha:
        raise UserError(f"--lora_alpha {cfg.lora_alpha}: the run resumed from {resumed} scales its adapters by "
                         f"{had['alpha']}; give --lora_alpha {had['alpha']}")
    lora.add_lora(model, cfg.lora_rank, cfg.lora_alpha)
    if had:
        tensors = load_file(str(resumed / lora.ADAPTER))  # type: ignore[operator]
        missing = set(lora.adapters(model)) - set(tensors)
        if missing:
            raise UserError(f"{resumed}: its adapters lack {sorted(missing)[:3]}; the checkpoint is incomplete")
        model.load_state_dict(tensors, strict=False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("LoRA rank %d (alpha %g) on %d projections: %s trainable parameters of %s", cfg.lora_rank,
             cfg.lora_alpha, len(lora.adapters(model)) // 2, f"{trainable:,}", f"{model.num_params():,}")
    return model


def fit_added_tokens(model: GPT, data: TokenData) -> GPT:
    """The model with room for the special tokens chat data added to its tokenizer (gptopt's default template's
    markers, ids past its vocabulary): its embedding (and untied head) grown to the data's vocabulary, the new rows
    the mean of the old (a token the model has never seen starts as an average one, not as noise), but the end of a
    turn starts as the end-of-text token, which it is most like: under LoRA, whose embedding stays frozen, the two
    markers would otherwise tie in every prediction and a reply could not end. Unchanged otherwise."""
    vocab = data.vocab_size
    if data.chat is None or not data.chat.get("added_tokens") or vocab is None or vocab <= model.config.vocab_size:
        return model
    old = model.config.vocab_size
    tok = data.tokenizer()
    end = tok.token_to_id(chat.DEFAULT_END) if tok is not None else None
    eot = data.eot_id
    grown = GPT(dataclasses.replace(model.config, vocab_size=vocab))
    state = model.state_dict()
    for name in ("transformer.wte.weight", "lm_head.weight"):
        w = state[name]
        new = grown.state_dict()[name].clone()
        new[:old] = w[:old]
        new[old:vocab] = w[:old].mean(dim=0)
        if end is not None and eot is not None and old <= end < vocab and eot < old:
            new[end] = w[eot]
        new[vocab:] = 0  # padding rows are never tokens
        state[name] = new
    grown.load_state_dict(state)
    log.info("grew the vocabulary from %d to %d for the chat data's special tokens (%s)", old, vocab,
             ", ".join(data.chat["added_tokens"]))
    return grown


def _with_config(model: GPT, config: GPTConfig) -> GPT:
    """Same weights, new runtime switches (attention kernel, checkpointing, dropout)."""
    fresh = GPT(config)
    fresh.load_state_dict(model.state_dict())
    return fresh


def check_tokenizer(cfg: TrainConfig, data: TokenData, resumed: Path | None) -> None:
    """Refuse data tokenized by another tokenizer than the model's (ValueError naming both and the fix): the model
    would train on ids that mean other text, and its checkpoints would carry the data's tokenizer. The model's:
    the resumed checkpoint's (its recorded digest, else its tokenizer.json), or --init_from's own. Data without
    a tokenizer (nanoGPT's) and a model whose tokenizer is not at hand (a hub name) are not compared."""
    ours = data.tokenizer()
    if ours is None or (resumed is None and cfg.init_from == "scratch"):
        return
    what = f"the run's checkpoint {resumed}" if resumed is not None else f"--init_from {cfg.init_from}"
    source = resumed if resumed is not None else model_source(cfg.init_from, "--init_from")
    recorded = checkpoint.read_meta(source).get("tokenizer_digest") if isinstance(source, Path) and \
        checkpoint.is_gptopt_dir(source) else None
    theirs = own_tokenizer(source)
    digest = recorded or (tokenizer_digest(theirs) if theirs is not None else None)
    # chat data tokenized by the model's tokenizer with the default template's markers added (fit_added_tokens)
    base = data.chat.get("base_tokenizer") if data.chat else None
    if digest is None or digest in (tokenizer_digest(ours), base):
        return
    where = source / TOKENIZER if isinstance(source, Path) and (source / TOKENIZER).is_file() else source
    raise UserError(f"--data_dir {cfg.data_dir} was tokenized with another tokenizer than {what}'s (tokenizer "
                     f"{tokenizer_digest(ours)} against the model's {digest}): the model would train on ids that "
                     f"mean other text; nothing was written. Tokenize your text with the model's tokenizer: gptopt "
                     f"prepare --input YOUR_TEXT --tokenizer {where} --output_dir NEW_DATA, then train with "
                     "--data_dir NEW_DATA")


# What --preset decides of a model: its size and its block's design (zero_init only how it starts)
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", *(f for f in ARCH_FIELDS if f != "zero_init"))


def check_resumed_shape(cfg: TrainConfig, stored: GPTConfig, run: dict[str, Any], resumed: Path) -> None:
    """--preset, --arch and --vocab_pad_multiple shape a new run only: those given for a resumed run must be its
    checkpoint's."""
    pad = cfg.vocab_pad_multiple
    if pad is not None and pad != stored.vocab_pad_multiple:
        raise UserError(f"--vocab_pad_multiple {pad} does not apply to a resumed run: {resumed} holds a vocabulary "
                         f"padded to a multiple of {stored.vocab_pad_multiple} ({stored.padded_vocab_size} rows of the "
                         "embedding, its optimizer state with them); drop --vocab_pad_multiple to go on with it, or "
                         f"give a run padded to {pad} another --output_dir")
    changed = {k: v for k, v in arch_overrides(cfg.arch).items() if getattr(stored, k) != v}
    if changed:
        raise UserError(f"--arch {cfg.arch} does not apply to a resumed run: {resumed} holds "
                         + ", ".join(f"{k}={getattr(stored, k)}" for k in changed)
                         + "; drop --arch to go on with it, or give the new design another --output_dir")
    stored_preset = run.get("preset", DEFAULT_PRESET) or DEFAULT_PRESET  # None: the default, as train read it
    pretrained = run.get("init_from", "scratch") != "scratch"
    if cfg.preset is None:
        return
    # the preset's shape and family (its block's design, with --arch's changes): --preset llama-tiny over a tiny
    # run has tiny's size, and is still another model
    asked = preset(cfg.preset, **arch_overrides(cfg.arch))
    differ = [k for k in SHAPE_FIELDS if getattr(stored, k) != getattr(asked, k)]
    if not differ:
        return
    name = "" if pretrained or stored_preset not in PRESETS else f"{stored_preset} "
    held = f"{resumed} holds the run's {name}model ({', '.join(f'{k} {getattr(stored, k)}' for k in differ)})"
    raise UserError(f"--preset {cfg.preset} does not apply to a resumed run: {held}, where {cfg.preset} has "
                     f"{', '.join(f'{k} {getattr(asked, k)}' for k in differ)}; drop --preset to go on with it, or "
                     f"give a new {cfg.preset} run another --output_dir")


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2])},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(_tuples(state["python"]))
    np.random.set_state(("MT19937", state["numpy"]["keys"].numpy().astype(np.uint32), state["numpy"]["pos"], 0, 0.0))


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
