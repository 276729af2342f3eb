"""The generation ladder's lever rungs: gptopt's eager decode (the kv rung) with one of its levers taken away and
done the textbook way instead, so that each lever's gain is measured on the user's machine, sampled and greedy,
on any family.

    gptopt bench --mode infer --preset smollm2-135m --rungs levers --temperature 1

- kv-hf-sampling: the sampled rows drawn as transformers' `generate` draws them (its temperature, top-k and top-p
  warpers, the top-p one sorting the whole vocabulary; softmax, torch.multinomial), where gptopt's sampler races
  noise among each row's candidates and sorts a vocabulary only for a nucleus wider than them (infer/sampling.py).
- kv-repeat-kv: each forward's cached keys and values repeated to every query head (the textbook `repeat_kv`:
  transformers' eager attention, and its SDPA attention before SDPA's grouped-query support), where gptopt attends a
  grouped-query cache as it is stored (models/gpt.py).
- kv-plain-weights: the weights in the layout they load in, where gptopt gives a CPU's linears the layout their
  products read fastest (infer/cpu_layout.py): optimize_for_inference(layout=False), nothing of this module.

The kv rung is the same decode with every lever, so the lever's gain is kv's rate over its rung's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gptopt.infer.generator import Generator
from gptopt.infer.kv_cache import PagedKVCache
from gptopt.infer.sampling import SamplingParams
from gptopt.models.gpt import KVCacheLayer
from gptopt.utils.extras import require


class HFSamplingGenerator(Generator):
    """A Generator whose sampled rows are drawn by transformers' logits warpers and torch.multinomial, those that
    `generate` applies for the setting, in its order (temperature unless 1, top-k, top-p unless 1). Greedy rows take
    the argmax as ever.

    For the bench's generations only: every row shares one setting, unseeded, with no penalties, logit bias or
    grammar (what `gptopt bench --mode infer` sends)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._warpers: dict[tuple[float, int | None, float], Any] = {}  # by setting: built once, not every step

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
               generators: list[torch.Generator | None], *, prompt_lens: Sequence[int] | None = None,
               allowed: torch.Tensor | None = None) -> list[int]:
        p = params[0]
        if p.temperature == 0:
            return super().sample(logits, params, histories, generators, prompt_lens=prompt_lens, allowed=allowed)
        # the bench's rows share one SamplingParams object, so the check is an identity test a row
        assert all(q is p or q == p for q in params) and allowed is None and not any(generators), \
            "the bench's rows share one unseeded setting"
        key = (p.temperature, p.top_k, p.top_p)
        if key not in self._warpers:
            self._warpers[key] = _warpers(p)
        scores = self._warpers[key](None, logits)  # these warpers read no input ids
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1).tolist()


def _warpers(p: SamplingParams) -> Any:
    """transformers' LogitsProcessorList for p, as generate builds it for sampling."""
    transformers = require("transformers", "hf", "the kv-hf-sampling rung")
    warpers = []
    if p.temperature != 1.0:
        warpers.append(transformers.TemperatureLogitsWarper(p.temperature))
    if p.top_k is not None:
        warpers.append(transformers.TopKLogitsWarper(top_k=p.top_k))
    if p.top_p < 1.0:
        warpers.append(transformers.TopPLogitsWarper(top_p=p.top_p))
    return transformers.LogitsProcessorList(warpers)


class _RepeatedLayer:
    """One layer of a RepeatedKVCache: the cache's keys and values, each key/value head repeated for the query
    heads it serves (the attention then sees as many as there are query heads)."""

    def __init__(self, layer: KVCacheLayer, groups: int) -> None:
        self.layer, self.groups = layer, groups

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.layer.update(k, v)  # (B, nkv, S, hs)
        return k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)  # (B, nh, S, hs)


class RepeatedKVCache(PagedKVCache):
    """A PagedKVCache whose layers hand each forward its keys and values repeated to every query head: a copy of the
    attended cache per layer and step, which gptopt's grouped-query attention does without."""

    def __init__(self, *args: Any, groups: int, **kwargs: Any) -> None:
        """PagedKVCache's arguments; groups: the query heads of each key/value head."""
        super().__init__(*args, **kwargs)
        self.groups = groups

    def layers(self, write: torch.Tensor, read: torch.Tensor | None, length: int, *,
               lengths: torch.Tensor | None = None) -> list[KVCacheLayer]:
        # the gather path always: the rung times keys and values repeated to every query head
        return [_RepeatedLayer(layer, self.groups) for layer in super().layers(write, read, length)]


class RepeatedKVGenerator(Generator):
    """A Generator (eager) whose cache repeats its key/value heads to every query head for each forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert not self.bucketed, "the kv-repeat-kv rung times the eager decode"
        cfg, c = self.model.config, self.cache
        shape = dict(blocks=c.blocks, block_size=c.block_size, device=c.device, dtype=c.k[0].dtype)
        del self.cache, c  # the plain cache's memory goes before the repeated one's is allocated
        self.cache = RepeatedKVCache(cfg, shape["blocks"], shape["block_size"], device=shape["device"],
                                     dtype=shape["dtype"], groups=cfg.n_head // cfg.kv_heads)
