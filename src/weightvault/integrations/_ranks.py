"""How a training loop's ranks agree on a checkpoint one of them writes.

Under ``torchrun`` every rank runs the loop's save hook, but one rank writes (a DDP
replica is the same on every rank). The others must neither write nor enter a collective
the writer skips, and they must learn when the write failed: a rank that raised alone
leaves the others waiting at their next collective. :func:`agree` is that one extra
collective; in a single process it costs nothing and re-raises the error as it was.

Example:
    >>> world_size()
    1
    >>> gather({"step": 2})
    [{'step': 2}]
    >>> agree(None, "the save of checkpoint-2", "resume from 'latest'")
"""

from __future__ import annotations

import pickle
import uuid
from typing import Any

import torch.distributed as dist
from torch import nn

from .._base.errors import DistributedCheckpointError, capped

__all__ = [
    "agree",
    "announce",
    "announced",
    "gather",
    "portable",
    "rank",
    "revive",
    "sharded_parameter",
    "world_size",
]

#: The key of the process group's store under which a lone writer leaves its failure.
_ANNOUNCED = "weightvault/integrations/failed-save"
#: The announcements this process has raised already (a later error is not that failure).
_heard: set[str] = set()


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


def agree(error: Exception | None, what: str, fix: str) -> None:
    """Raise on every rank when ``what`` failed on any; collective (every rank calls it).

    It is also the barrier after the write: no rank moves on before the writer is done.

    Args:
        error: What this rank raised doing its part, or ``None``.
        what: The step, for the message (``"the vault save of checkpoint-4 into runs/v"``).
        fix: The one fix to suggest.

    Raises:
        DistributedCheckpointError: Some rank failed; ``failures`` maps each failed rank to
            its error, and this rank's own error (if any) is the ``__cause__``. In a single
            process, ``error`` itself is raised unchanged.
    """
    if world_size() == 1:
        if error is not None:
            raise error
        return
    sent = None if error is None else portable(error)
    failures: dict[int, BaseException] = {
        r: revive(x) for r, x in enumerate(gather(sent)) if x is not None
    }
    if not failures:
        return
    shown = capped(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(failures.items()))
    raise DistributedCheckpointError(
        f"{what} failed on {len(failures)} of {world_size()} rank(s): {shown}; every rank "
        f"stops here and the checkpoints committed before stay loadable; {fix}",
        failures,
    ) from error


def announce(error: DistributedCheckpointError) -> None:
    """Leave ``error`` where the other ranks find it without a collective.

    Some loops (Lightning) call the checkpoint plugin on rank 0 alone while the other ranks
    wait in the loop's own barrier, so no :func:`agree` can run; those ranks only learn
    that rank 0 stopped when their barrier breaks. This writes the failure into the
    process group's key-value store (which ``torchrun``'s agent hosts, so it outlives rank
    0), where :func:`announced` reads it. Without a store nothing is written.
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


def portable(error: Exception) -> tuple[str, bytes | None]:
    """``error`` as a peer can rebuild it: its text, and its pickle when it has one."""
    text = f"{type(error).__name__}: {error}"
    try:
        blob: bytes | None = pickle.dumps(error)
    except Exception:  # an exception holding a lock, a file, a lambda
        blob = None
    return text, blob


def revive(sent: tuple[str, bytes | None]) -> Exception:
    """The error :func:`portable` sent, rebuilt here (its text in a ``RuntimeError`` if not)."""
    # Peers are ranks of this one job, the same program: their pickles are as trusted as
    # the all_gather_object that carried them (itself a pickle).
    text, blob = sent
    if blob is not None:
        try:
            out = pickle.loads(blob)
        except Exception:  # a class this rank cannot import, an __init__ pickle breaks
            out = None
        if isinstance(out, Exception):
            return out
    return RuntimeError(text)
