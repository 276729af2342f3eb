"""torch.distributed through torchrun: process group from the environment, DDP / FSDP2 wrapping.

No launcher of our own: `torchrun --nproc_per_node N -m gptopt train ...` sets RANK, LOCAL_RANK and
WORLD_SIZE; several machines use torchrun's rendezvous flags (--nnodes, --rdzv_endpoint) unchanged.

    torchrun --nproc_per_node 2 -m gptopt train --device cpu --preset debug --max_steps 20
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from gptopt.train.optim import AnyOptimizer, check_state
from gptopt.utils.errors import UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    enabled: bool = False  # a process group exists (under torchrun, even with one process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def init(device: str) -> tuple[DistInfo, str]:
    """Join the process group when launched by torchrun; returns the info and this rank's device string.

    NCCL for CUDA, gloo for CPU. Each rank takes the GPU of its LOCAL_RANK.
    """
    if not launched_by_torchrun():
        return DistInfo(), device
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    elif device == "auto":
        device = "cpu"
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(minutes=30),  # long first compile on one rank must not time out the rest
            **({"device_id": torch.device(device)} if use_cuda else {}),
        )
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, enabled=True), device


def cleanup() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def all_reduce_mean(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled and info.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= info.world_size
    return value


def all_reduce_sum(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled and info.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def any_rank(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """True on every rank if it is true on any: ranks must agree to stop, or collectives hang."""
    if not (info.enabled and info.world_size > 1):
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def spread(value: int, info: DistInfo, device: torch.device) -> tuple[int, int]:
    """The smallest and the largest of an integer over all ranks (the value twice on one process)."""
    if not (info.enabled and info.world_size > 1):
        return value, value
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    high, low = t.tolist()
    return -low, high


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def wrap_fsdp(model: nn.Module, *, param_dtype: torch.dtype | None, cpu_offload: bool) -> nn.Module:
    """FSDP2: shard each block, then the root (embeddings, final norm). Mixed precision by policy."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if param_dtype is not None:
        # compute in low precision, reduce gradients in fp32 so the sum over ranks keeps its bits
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in model.transformer.h:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


@contextlib.contextmanager
def no_sync(model: nn.Module, active: bool) -> Iterator[None]:
    """Skip the gradient all-reduce on all but the last micro-step of an accumulation (DDP, FSDP2)."""
    if not active:
        yield
        return
    if hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def full_state_dicts(model: nn.Module, optimizer: AnyOptimizer, sharded: bool) -> tuple[dict, dict]:
    """Unsharded model and optimizer state (on CPU) for a checkpoint every world size can read.

    Every rank must call this under FSDP (it gathers); with DDP or one process it is local.
    """
    if not sharded:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, optimizer: AnyOptimizer, optim_state: dict, sharded: bool) -> None:
    """Load a full (unsharded) optimizer state; under FSDP every rank keeps its own shard of it.

    The weights are already in place: they were loaded into the plain model before wrapping.
    """
    check_state(optimizer, optim_state)  # the other --optimizer's state: refused with the fix, before any is loaded
    if not sharded:
        optimizer.load_state_dict(optim_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(
        model, optimizer, optim_state_dict=optim_state_by_name(model, optimizer, optim_state),
        options=StateDictOptions(full_state_dict=True),
    )


def optim_state_by_name(model: nn.Module, optimizer: torch.optim.Optimizer, optim_state: dict) -> dict:
    """An optimizer state dict keyed by parameter name, the form set_state_dict reads.

    A checkpoint written without FSDP (one process, or DDP) keys it by position, 0, 1, ...; under
    FSDP it is keyed by name already. torch's own Optimizer.load_state_dict reads either.
    """
    saved = [key for group in optim_state["param_groups"] for key in group["params"]]
    if all(isinstance(key, str) for key in saved):
        return optim_state
    names = {id(p): name for name, p in model.named_parameters()}
    ours = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(saved) != len(ours):
        raise UserError(f"the checkpoint's optimizer holds {len(saved)} parameters, this model {len(ours)}")
    rename = dict(zip(saved, ours, strict=True))
    state = {rename[key]: value for key, value in optim_state["state"].items()}
    groups = [{**g, "params": [rename[key] for key in g["params"]]} for g in optim_state["param_groups"]]
    return {"state": state, "param_groups": groups}
