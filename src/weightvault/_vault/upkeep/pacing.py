"""Pacing: a gc after every save that never takes more than a share of a loop's time.

gc reads every record, so its cost grows with the vault; a training loop that frees
after each save would spend more and more of its time there. :func:`paced_collect` runs
a gc only when the previous one was quick, or took at most ``pace`` of the time since
it ended: the loop then spends at most about that share in gc, and what one put off is
freed a few saves later at worst.

Example:
    >>> freed, last = paced_collect(vault.store, GC_PACE, None)
"""

from __future__ import annotations

import time

from ..store.backend import Store
from .gc import collect

__all__ = ["GC_PACE", "Timing", "paced_collect"]

#: The share of a loop's time that freeing after each save may take (see ``Vault.gc``).
GC_PACE = 0.1
#: A gc this quick (seconds) is never put off by ``pace``.
_QUICK_GC = 1.0

#: The previous gc: (seconds it took, when it ended), on the monotonic clock.
Timing = tuple[float, float]


def paced_collect(
    store: Store, pace: float | None, last: Timing | None
) -> tuple[int, Timing | None]:
    """Free what nothing names (:func:`~.gc.collect`), unless ``pace`` puts it off after
    the gc ``last``; return the bytes freed (0 when put off) and the timing to keep."""
    now = time.monotonic()
    if pace is not None and last is not None:
        took, ended = last
        if took > max(_QUICK_GC, pace * (now - ended)):
            return 0, last
    freed = collect(store)
    return freed, (time.monotonic() - now, time.monotonic())
