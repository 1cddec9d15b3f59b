"""A lone writer's failure, left where the other ranks find it without a collective.

Some loops (Lightning) call the checkpoint plugin on rank 0 alone while the other ranks
wait in the loop's own barrier, so no :func:`~weightvault._ranks.agree` can run; those
ranks only learn that rank 0 stopped when their barrier breaks. :func:`announce` writes
the failure into the process group's key-value store, and :func:`announced` reads it.

Example:
    >>> announced(RuntimeError("barrier broke"))   # a single process: nothing to hear
"""

from __future__ import annotations

import pickle
import uuid
from typing import Any

import torch.distributed as dist

from .._base.errors import DistributedCheckpointError
from .failures import portable, revive
from .world import world_size

__all__ = ["announce", "announced"]

#: The key of the process group's store under which a lone writer leaves its failure.
_ANNOUNCED = "weightvault/integrations/failed-save"
#: The announcements this process has raised already (a later error is not that failure).
_heard: set[str] = set()


def announce(error: DistributedCheckpointError) -> None:
    """Leave ``error`` where the other ranks find it without a collective.

    Some loops (Lightning) call the checkpoint plugin on rank 0 alone while the other ranks
    wait in the loop's own barrier, so no :func:`~weightvault._ranks.agree` can run; those
    ranks only learn that rank 0 stopped when their barrier breaks. This writes the failure
    into the process group's key-value store (which ``torchrun``'s agent hosts, so it
    outlives rank 0), where :func:`announced` reads it. Without a store nothing is written.
    """
    store = _store()
    if store is None:
        return
    failures = {r: portable(x) for r, x in error.failures.items() if isinstance(x, Exception)}
    store.set(_ANNOUNCED, pickle.dumps((uuid.uuid4().hex, str(error), failures)))


def announced(cause: BaseException | None) -> DistributedCheckpointError | None:
    """The failure another rank announced (:func:`announce`), for this rank to raise.

    ``cause`` is the error this rank is stopping with (its broken barrier); without one,
    or when it already is a :class:`~weightvault.DistributedCheckpointError`, or when no
    new failure was announced, the answer is ``None``. Never waits: a store that cannot
    be read counts as no announcement.
    """
    if cause is None or isinstance(cause, DistributedCheckpointError) or world_size() == 1:
        return None
    store = _store()
    try:
        if store is None or not store.check([_ANNOUNCED]):
            return None
        # Written by a rank of this job, as trusted as the collectives' own pickles.
        key, text, sent = pickle.loads(store.get(_ANNOUNCED))
    except Exception:  # the store went with the process that hosted it
        return None
    if key in _heard:
        return None
    _heard.add(key)
    return DistributedCheckpointError(text, {r: revive(x) for r, x in sent.items()})


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store() if world_size() > 1 else None
    except Exception:  # a process group without a store (or a torch without this helper)
        return None
