"""A DCP save planner that finds ties by memory identity, so a tied tensor is stored once.

Each rank reports which of its write items read the same local memory as an earlier
one; the coordinator keeps ``alias -> canonical`` only where every rank holding the alias
agrees. Replicated tensors (DDP, HSDP replicas) are already written by one rank, by DCP's
own deduplication.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from .._base.errors import DistributedCheckpointError
from .plancache import cache_for, caching_supported, same_plan, unchanged, usable

__all__ = ["VaultSavePlanner", "storage_key"]


def storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of a local tensor's memory; ``None`` for empty tensors, which tie nothing."""
    if t.numel() == 0:
        return None
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.device,
    )


def _box(item: WriteItem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    chunk = item.tensor_data.chunk if item.tensor_data is not None else None
    if chunk is None:
        return ((), ())
    return (tuple(chunk.offsets), tuple(chunk.sizes))


def _agreed_ties(reports: list[dict[str, list[Any]]]) -> dict[str, str]:
    """``alias -> canonical`` where every rank holding the alias reported that canonical."""
    candidates: dict[str, str | None] = {}
    for rep in reports:
        for fqn, entries in rep.items():
            for canon, _ in entries:
                if canon == "empty":
                    continue
                if canon is None or candidates.get(fqn, canon) != canon:
                    candidates[fqn] = None
                else:
                    candidates.setdefault(fqn, canon)
    ties = {a: c for a, c in candidates.items() if c is not None and candidates.get(c) is None}
    return {a: c for a, c in ties.items() if c not in ties}


class VaultSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus ties found by memory identity, frozen flags, and
    a plan cache of its own.

    Each rank reports which of its write items read the same local memory as an earlier
    one. The coordinator accepts ``alias -> canonical`` only when every rank holding the
    alias agrees, drops the alias's items from every plan, and records the tie; the
    tensor is then written once. Replicated tensors (DDP, HSDP replicas) are already
    written by one rank, by DCP's own deduplication.

    With ``enable_plan_caching`` (DCP's option, here keyed per checkpointer: see
    :mod:`weightvault._dcp.plancache`), a save whose local plans did not change reuses
    the coordinator's last global plan instead of planning again.

    Args:
        frozen: Flattened names (``"model.<fqn>"`` under :func:`save`) of frozen tensors.
        names: Model names in model order, for the record's header.
        model_prefix: What the model's names start with in the flattened state.
        enable_plan_caching: Reuse the last plan when no rank's local plan changed.
        cache_key: The checkpointer the cache belongs to; planners with one key share a
            cache. By default each planner has its own (reuse the planner across saves).

    Example:
        >>> planner = VaultSavePlanner(model_prefix="model.", enable_plan_caching=True)
        >>> for step in steps:
        ...     dcp.save(state, storage_writer=VaultWriter(v, f"s{step}"), planner=planner)
    """

    def __init__(
        self,
        frozen: Sequence[str] = (),
        names: Sequence[str] | None = None,
        model_prefix: str = "",
        *,
        enable_plan_caching: bool = False,
        cache_key: str | None = None,
    ) -> None:
        super().__init__()  # DCP's own cache stays off: it is process-wide (see above)
        self.frozen = list(frozen)
        self.names = None if names is None else list(names)
        self.model_prefix = model_prefix
        self.ties: dict[str, str] = {}
        caching = enable_plan_caching and caching_supported()
        self.cache_key = (cache_key or f"planner-{uuid.uuid4().hex}") if caching else None
        self._pending: SavePlan | None = None

    def create_local_plan(self) -> SavePlan:
        plan = self._local_plan()
        self.plan = plan
        if self.cache_key is None:
            return plan
        if same_plan(plan, cache_for(self.cache_key).local):
            self._pending = None
            return unchanged()
        self._pending = plan  # kept once the coordinator has planned with it
        return plan

    def _local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        first: dict[tuple[Any, ...], WriteItem] = {}
        local: dict[str, list[Any]] = defaultdict(list)
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            t = self.lookup_object(item.index)
            key = storage_key(t) if isinstance(t, torch.Tensor) else None
            if key is None:
                # Empty shards cannot show identity: they agree with any tie.
                local[item.index.fqn].append(("empty", _box(item)))
            elif key in first:
                canon = first[key]
                ok = _box(canon) == _box(item)
                local[item.index.fqn].append((canon.index.fqn if ok else None, _box(item)))
            else:
                first[key] = item
                local[item.index.fqn].append((None, _box(item)))
        data = {"mappings": plan.planner_data, "same_memory": dict(local)}
        return dataclasses.replace(plan, planner_data=data)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if self.cache_key is None:
            return self._global_plan(all_plans)
        cache = cache_for(self.cache_key)
        if not all(usable(p) for p in all_plans) and (
            cache.all_plans is None or len(cache.all_plans) != len(all_plans)
        ):
            raise DistributedCheckpointError(
                f"plan cache {self.cache_key!r}: ranks sent unchanged plans the coordinator "
                "has not cached (its cache was dropped); save again with a new cache_key"
            )
        if cache.metadata is not None and not any(usable(p) for p in all_plans):
            self.ties, self.metadata = dict(cache.ties), cache.metadata
            return [unchanged() for _ in all_plans], cache.metadata
        old = cache.all_plans or []
        merged = [p if usable(p) else old[i] for i, p in enumerate(all_plans)]
        plans, metadata = self._global_plan(merged)
        before = cache.global_plans or []
        deltas = [
            unchanged() if i < len(before) and same_plan(p, before[i]) else p
            for i, p in enumerate(plans)
        ]
        cache.all_plans, cache.global_plans, cache.metadata = merged, plans, metadata
        cache.ties = dict(self.ties)
        return deltas, metadata

    def _global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Accept the ties, drop the aliases' items, then DCP's own global planning."""
        ties = _agreed_ties([p.planner_data["same_memory"] for p in all_plans])
        self.ties = ties
        plans = [
            dataclasses.replace(
                p,
                items=[i for i in p.items if i.index.fqn not in ties],
                planner_data=p.planner_data["mappings"],
            )
            for p in all_plans
        ]
        return super().create_global_plan(plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if self.cache_key is None:
            return super().finish_plan(new_plan)
        cache = cache_for(self.cache_key)
        if usable(new_plan):
            cache.final = new_plan
        elif cache.final is None:
            raise DistributedCheckpointError(
                f"plan cache {self.cache_key!r}: the coordinator reused a plan this rank has "
                "not cached; save again with a new cache_key"
            )
        if self._pending is not None:
            cache.local, self._pending = self._pending, None
        return super().finish_plan(cache.final)

    def info(self) -> dict[str, Any]:
        """What the writer records beside the chunks: ties, frozen names, model order."""
        return {
            "ties": dict(self.ties),
            "frozen": self.frozen,
            "names": self.names,
            "model_prefix": self.model_prefix,
        }
