"""Sparing: checkpoints a mirror has queued and not pushed yet, left whole by retention.

A mirror (:class:`~weightvault.Mirror`) pushes what was committed: a checkpoint it has
queued must not lose its training state, or be deleted, before the push. It spares each
one as it queues it and lets it go once pushed (or given up); a checkpoint queued twice
stays spared until both let go.

Example:
    >>> spared = Spared(); spared.spare("000004"); spared.names()
    frozenset({'000004'})
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

__all__ = ["Spared"]


class Spared:
    """A count per checkpoint of the mirrors' holds on it."""

    def __init__(self) -> None:
        self._held: collections.Counter[str] = collections.Counter()

    def names(self) -> frozenset[str]:
        """The checkpoints at least one hold keeps whole now."""
        return frozenset(n for n, c in self._held.items() if c > 0)

    def spare(self, name: str) -> None:
        """Keep ``name`` whole (retention skips it) until :meth:`release`."""
        self._held[name] += 1

    def release(self, names: Iterable[str]) -> None:
        """Let go one hold on each of ``names``."""
        for name in names:
            if self._held[name] > 0:
                self._held[name] -= 1
            if self._held[name] <= 0:
                del self._held[name]
