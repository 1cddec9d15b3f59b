"""Save-plan caching for :class:`~weightvault.dcp.VaultSavePlanner`, one cache per checkpointer.

DCP's ``enable_plan_caching`` lets every rank send an empty "unchanged" plan when its
local plan equals the last one, and the coordinator reuse the global plan and metadata
it built then: at 1,024 ranks that skips most of the coordinator's planning. DCP keys its
caches by the planner's class name, process-wide, so two checkpointers in one process
(a model and an EMA copy, two runs) share one cache (NeMo Automodel #2070, #3369); and it
compares only the write items, not the planner data that carries the vault's ties.

Here each checkpointer has its own key (the vault's URL and the objects it saves, or one
you give), a plan is unchanged only if its items *and* planner data are equal, and a
rank's cached plan is kept only once the coordinator has built the global plan from it.

Example:
    >>> planner = VaultSavePlanner(enable_plan_caching=True, cache_key="run-1/model")
    >>> dcp.save(state, storage_writer=VaultWriter(vault, "a"), planner=planner)
    >>> dcp.save(state, storage_writer=VaultWriter(vault, "b"), planner=planner)  # cached
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

__all__ = [
    "CACHED_KEYS",
    "PlanCache",
    "cache_for",
    "caching_supported",
    "same_plan",
    "unchanged",
    "usable",
]

#: Checkpointers whose plans one process keeps; the least recently used goes first.
CACHED_KEYS = 8

_caches: OrderedDict[str, PlanCache] = OrderedDict()
_lock = threading.Lock()


@dataclass
class PlanCache:
    """What one checkpointer's last save planned, on this process.

    Attributes:
        local: This rank's last local plan.
        final: This rank's last final plan (what it wrote from).
        all_plans: On the coordinator: every rank's last local plan.
        global_plans: On the coordinator: every rank's last global plan.
        metadata: On the coordinator: the global metadata.
        ties: On the coordinator: the ties accepted.
    """

    local: SavePlan | None = None
    final: SavePlan | None = None
    all_plans: list[SavePlan] | None = None
    global_plans: list[SavePlan] | None = None
    metadata: Metadata | None = None
    ties: dict[str, str] = field(default_factory=dict)


def caching_supported() -> bool:
    """Whether this torch's ``SavePlan`` can say "unchanged" (``usable``)."""
    return any(f.name == "usable" for f in dataclasses.fields(SavePlan))


def cache_for(key: str) -> PlanCache:
    """The cache of checkpointer ``key`` (made on first use)."""
    with _lock:
        cache = _caches.pop(key, None) or PlanCache()
        _caches[key] = cache
        while len(_caches) > CACHED_KEYS:
            _caches.popitem(last=False)
        return cache


def unchanged() -> SavePlan:
    """What a rank sends, and the coordinator scatters, for a plan equal to the cached one."""
    return SavePlan([], usable=False)  # type: ignore[call-arg]


def usable(plan: SavePlan) -> bool:
    return bool(getattr(plan, "usable", True))


def same_plan(a: SavePlan | None, b: SavePlan | None) -> bool:
    """Equal write items (index, type, chunk, dtype, size) and equal planner data."""
    if a is None or b is None:
        return False
    return a.items == b.items and _same_data(a.planner_data, b.planner_data)


def _same_data(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # data whose == is not a bool (tensors): never assume equal
        return False
