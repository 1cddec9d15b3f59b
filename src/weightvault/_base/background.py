"""Saves that finish in a background thread, with a handle to wait on."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class SnapshotPool:
    """Buffers one background save copied into, kept for the next one.

    Touching fresh memory is what a snapshot mostly costs (on some VMs it runs at under
    1 GB/s, far below a copy's speed), so a vault reuses the previous snapshot's buffers.
    They are handed back only once that save has finished, and a vault's next save waits
    for its previous one, so a buffer is never written while a save still reads it. The
    price is memory: the last snapshot's buffers stay allocated between saves.
    """

    def __init__(self) -> None:
        self._spare: dict[Hashable, list[Any]] = {}
        self._lent: list[tuple[Hashable, Any]] = []
        self._lock = threading.Lock()

    def copy(self, key: Hashable, fresh: Callable[[], Any], fill: Callable[[Any], None]) -> Any:
        """A copy for the running snapshot: a spare buffer of this ``key`` (device, size)
        filled with ``fill``, or else ``fresh()``; either is lent until :meth:`release`."""
        with self._lock:
            spare = self._spare.get(key)
            buffer = spare.pop() if spare else None
        if buffer is None:
            buffer = fresh()
        else:
            fill(buffer)
        with self._lock:
            self._lent.append((key, buffer))
        return buffer

    def release(self) -> None:
        """The save that used the lent buffers has finished: they are spare again."""
        with self._lock:
            for key, buffer in self._lent:
                self._spare.setdefault(key, []).append(buffer)
            self._lent = []


class SaveHandle(Generic[T]):
    """A save running in the background; what ``save(..., background=True)`` returns.

    Everything the checkpoint holds was copied before the call returned, so the caller
    may step the optimizer at once. The thread is not a daemon: a script that ends while
    a save runs waits for it to commit.

    Example:
        >>> handle = vault.save(model, optimizer=opt, background=True)
        >>> opt.step()                      # safe: the checkpoint holds the values at the call
        >>> record = handle.wait()          # re-raises the save's error, if it failed
    """

    def __init__(self, work: Callable[[], T], label: str) -> None:
        self._result: T | None = None
        self._error: BaseException | None = None
        self._observed = False
        self._thread = threading.Thread(target=self._run, args=(work,), name=label)
        self._thread.start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._result = work()
        except BaseException as e:  # re-raised in the caller's thread by wait()
            self._error = e

    def done(self) -> bool:
        """Whether the save has finished, successfully or not."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the save is committed and return its record or report.

        Raises:
            TimeoutError: ``timeout`` seconds passed first; the save keeps running.
            Exception: Whatever the save raised.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the background save {self._thread.name} is still running")
        self._observed = True
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def settle(self) -> None:
        """Wait for the save; re-raise its error only if nobody has seen it yet.

        A later save calls this first, so saves happen one at a time and in order, and
        the error of a save whose handle was dropped is not lost.
        """
        self._thread.join()
        if self._error is not None and not self._observed:
            self._observed = True
            raise self._error

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "done")
        return f"<SaveHandle {self._thread.name} {state}>"
