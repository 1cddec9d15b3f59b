"""How the ranks agree on a step one or all of them did: did any rank fail it?

Under ``torchrun`` every rank runs a training loop's save hook, but one rank writes (a
DDP replica is the same on every rank); under :mod:`weightvault.dcp` every rank does its
part of one save or load. Either way a rank that raised alone leaves the others waiting
at their next collective, so every rank, failed or not, calls :func:`agree`: one
``all_gather_object`` of a short text, after which every rank raises or none does. In a
single process it costs nothing and re-raises the error as it was. The error travels as
:func:`portable` makes it, and :func:`revive` rebuilds it on the other ranks.

Example:
    >>> agree(None, "the save of checkpoint-2", "resume from 'latest'")
    >>> revive(portable(ValueError("bad shape")))
    ValueError('bad shape')
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

from .._base.errors import DistributedCheckpointError, capped
from .world import gather, world_size

__all__ = ["agree", "portable", "revive"]

#: What a training loop's ranks do once one failed, said before the fix.
_LOOPS_STOP = "every rank stops here and the checkpoints committed before stay loadable; "


def agree(
    error: BaseException | None,
    what: str,
    fix: str,
    *,
    outcome: str = _LOOPS_STOP,
    raise_own: bool = False,
    broken: Callable[[str, RuntimeError], BaseException] | None = None,
) -> None:
    """Raise on every rank when any rank failed its part of ``what``; collective.

    Every rank calls it, failed or not, so it must sit where no rank can skip it (for
    :mod:`weightvault.dcp`: before DCP's call, or after it returned on every rank). It is
    also a barrier: no rank moves on before every rank has done its part.

    Args:
        error: What this rank raised doing its part, or ``None``.
        what: The step, for the message (``"the vault save of checkpoint-4 into runs/v"``).
        fix: The one fix to suggest, last in the message.
        outcome: What every rank does now, said between the failed ranks and ``fix``,
            its punctuation included (by default, a training loop's: it stops, and the
            checkpoints committed before stay loadable).
        raise_own: A rank that failed raises its own ``error`` as it is, and only the
            others raise the joint error; by default every rank raises the joint error,
            with its own (if any) as the ``__cause__``.
        broken: Makes the error for a process group that broke under the gather (a rank
            died), from ``what`` and the gather's ``RuntimeError``; without it, that
            ``RuntimeError`` propagates.

    Raises:
        DistributedCheckpointError: Some rank failed; ``failures`` maps each failed rank
            to its error, rebuilt from its pickle where it has one. In a single process,
            ``error`` itself is raised unchanged.
        BaseException: With ``raise_own``, this rank's own ``error``, as it is.
    """
    size = world_size()
    if size == 1:
        if error is not None:
            raise error
        return
    sent = None if not isinstance(error, Exception) else portable(error)
    if error is not None and sent is None:  # KeyboardInterrupt, SystemExit: their text
        sent = (f"{type(error).__name__}: {error}", None)
    try:
        everyone = gather(sent)
    except RuntimeError as e:
        if broken is None:
            raise
        if error is not None and raise_own:
            raise error from None
        raise broken(what, e) from e
    if error is not None and raise_own:
        raise error
    failures: dict[int, BaseException] = {
        r: revive(x) for r, x in enumerate(everyone) if x is not None
    }
    if not failures:
        return
    shown = capped(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(failures.items()))
    joint = DistributedCheckpointError(
        f"{what} failed on {len(failures)} of {size} rank(s): {shown}; {outcome}{fix}",
        failures,
    )
    if raise_own:  # this rank did not fail: nothing of its own to chain
        raise joint
    raise joint from error


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
