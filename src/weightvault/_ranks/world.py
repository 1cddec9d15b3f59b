"""This run's ranks: how many, which one this is, and a gather of one value from each.

Without a process group (a single process) each answers at once, as for a world of one.

Example:
    >>> world_size()
    1
    >>> gather({"step": 2})
    [{'step': 2}]
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = ["gather", "rank", "sharded_parameter", "world_size"]


def world_size() -> int:
    """The processes of this run: the process group's size, or 1 without one."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def rank() -> int:
    """This process's rank in the process group, or 0 without one."""
    return int(dist.get_rank()) if world_size() > 1 else 0


def gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order; collective (every rank must call it)."""
    size = world_size()
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, value)
    return out


def sharded_parameter(model: nn.Module) -> str | None:
    """The name of a parameter ``model`` holds only a shard of (FSDP), or ``None``.

    Checked by type alone: no collective, so a rank may ask without the others.
    """
    if not dist.is_available():
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    for name, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel):  # FSDP1 wraps; FSDP2 makes DTensors
            return next((f"{name}.{n}".lstrip(".") for n, _ in module.named_parameters()), name)
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            return name
    return None
