"""Background saves: one save at a time in a thread, with the copies it needs made first.

``Vault.save(background=True)`` returns at once with a :class:`~weightvault.SaveHandle`.
The adapter queues the copies of what training will change (trainable parameters,
optimizer state) in a :class:`~.._base.snapshots.SnapshotPool`; the save's thread stages
them first thing, and every optimizer step waits for that. :meth:`Deferred.settle` waits
for the save in flight: a later save, load or retention of the same vault calls it first,
so "latest" includes a save still being written.

Example:
    >>> saves = Deferred(); handle = saves.start(lambda: record, "000004")
    >>> saves.settle()      # the record is committed, or its error raised
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from ..._base.pools import LazyPool
from ..._base.snapshots import SaveHandle, SnapshotPool

__all__ = ["Deferred"]

T = TypeVar("T")


class Deferred(Generic[T]):
    """The background save of one vault, and the snapshot buffers its saves reuse."""

    def __init__(self) -> None:
        self.snapshots = SnapshotPool(deferred=True)
        self._saver = LazyPool(1, "weightvault-background-save")
        self._pending: SaveHandle[T] | None = None

    def start(self, work: Callable[[], T], name: str | None) -> SaveHandle[T]:
        """Run ``work`` (the save of checkpoint ``name``) in the save thread, after it
        staged the copies the adapter queued."""

        def run() -> T:
            try:
                self.snapshots.stage()  # the copies the adapter queued, first
                return work()
            finally:
                self.snapshots.release()  # read in full: the next snapshot may reuse them

        try:
            self._pending = SaveHandle(
                run, f"vault save {name or '(next)'}", self._saver(), self.snapshots.staged
            )
        except BaseException:  # no thread (an interpreter shutting down refuses work)
            self.snapshots.cancel()  # or every optimizer step would wait for ever
            raise
        return self._pending

    def settle(self) -> None:
        """Wait for the save in flight, if any (raising what it raised)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.settle()
