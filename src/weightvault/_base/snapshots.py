"""Saves that finish in a background thread, with a handle to wait on."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class SnapshotPool:
    """Buffers one background save copied into, kept for the next one.

    Touching fresh memory is what a snapshot mostly costs (on some VMs it runs at under
    1 GB/s, far below a copy's speed), so a vault reuses the previous snapshot's buffers.
    They are handed back only once that save has finished, and a vault's next save waits
    for its previous one, so a buffer is never written while a save still reads it. The
    price is memory: the last snapshot's buffers stay allocated between saves.

    A pool made with ``deferred=True`` copies nothing when asked: :meth:`later` queues the
    copy and :meth:`stage` runs the queue, in the save's own thread. Only what changes
    solely at a known moment may be copied later (a parameter and its optimizer state
    change in ``optimizer.step()``, which the caller makes wait for :meth:`staged`).
    """

    def __init__(self, deferred: bool = False) -> None:
        self.deferred = deferred
        self._spare: dict[Hashable, list[Any]] = {}
        self._lent: list[tuple[Hashable, Any]] = []
        self._queue: list[Callable[[], object]] = []
        self._staged = threading.Event()
        self._staged.set()
        self._lock = threading.Lock()

    def copy(self, key: Hashable, fresh: Callable[[], Any], fill: Callable[[Any], None]) -> Any:
        """A copy for the running snapshot: a spare buffer of this ``key`` (device, size)
        filled with ``fill``, or else ``fresh()``; either is lent until :meth:`release`."""
        buffer = self._spare_buffer(key)
        if buffer is None:
            buffer = fresh()
        else:
            fill(buffer)
        with self._lock:
            self._lent.append((key, buffer))
        return buffer

    def later(self, key: Hashable, empty: Callable[[], Any], fill: Callable[[Any], None]) -> Any:
        """A buffer that :meth:`stage` fills (a spare one of this ``key``, or ``empty()``,
        which need not touch its memory); without ``deferred``, filled now."""
        if not self.deferred:
            return self.copy(key, lambda: _filled(empty(), fill), fill)
        buffer = self._spare_buffer(key)
        if buffer is None:
            buffer = empty()  # touched by the copy, in the save's thread
        with self._lock:
            self._lent.append((key, buffer))
            self._queue.append(lambda: fill(buffer))
            self._staged.clear()
        return buffer

    def stage(self) -> None:
        """Run the copies :meth:`later` queued; :meth:`staged` is true afterwards even if
        one failed (the failure is raised here, and fails the save)."""
        with self._lock:
            queue, self._queue = self._queue, []
        try:
            for fill in queue:
                fill()
        finally:
            with self._lock:
                if not self._queue:
                    self._staged.set()

    def staged(self, timeout: float | None = None) -> bool:
        """Wait until the queued copies are done; False if ``timeout`` passed first."""
        return self._staged.wait(timeout)

    def cancel(self) -> None:
        """The save failed before its thread started: drop the queued copies (nothing
        will read them) and take the lent buffers back."""
        with self._lock:
            self._queue = []
            self._staged.set()
        self.release()

    def release(self) -> None:
        """The save that used the lent buffers has finished: they are spare again."""
        with self._lock:
            for key, buffer in self._lent:
                self._spare.setdefault(key, []).append(buffer)
            self._lent = []

    def _spare_buffer(self, key: Hashable) -> Any:
        with self._lock:
            spare = self._spare.get(key)
            return spare.pop() if spare else None


def _filled(buffer: Any, fill: Callable[[Any], None]) -> Any:
    fill(buffer)
    return buffer


class SaveHandle(Generic[T]):
    """A save running in the background; what ``save(..., background=True)`` returns.

    The caller may step the optimizer at once: what the checkpoint holds was either
    copied before the call returned or is copied first thing in the save's thread, and a
    PyTorch optimizer's step waits for that copy. The thread is not a daemon (nor is an
    ``executor``'s, which Python joins at exit): a script that ends while a save runs
    waits for it to commit.

    Args:
        work: The save.
        label: Its name in messages (and the thread's, without an ``executor``).
        executor: Run it there instead of on a thread of its own: a vault keeps one
            thread for its saves, since starting one costs milliseconds on a busy GIL.
        copied: Waits (up to a timeout) for the copies the save makes in its thread.

    Example:
        >>> handle = vault.save(model, optimizer=opt, background=True)
        >>> opt.step()                      # safe: the checkpoint holds the values at the call
        >>> record = handle.wait()          # re-raises the save's error, if it failed
    """

    def __init__(
        self,
        work: Callable[[], T],
        label: str,
        executor: Executor | None = None,
        copied: Callable[[float | None], bool] | None = None,
    ) -> None:
        self._copied = copied
        self._result: T | None = None
        self._error: BaseException | None = None
        self._observed = False
        self._label = label
        self._finished = threading.Event()
        if executor is not None:
            executor.submit(self._run, work)
        else:
            threading.Thread(target=self._run, args=(work,), name=label).start()

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._result = work()
        except BaseException as e:  # re-raised in the caller's thread by wait()
            self._error = e
        finally:
            self._finished.set()

    def copied(self, timeout: float | None = None) -> bool:
        """Wait until the checkpoint's values are copied; False if ``timeout`` passed.

        An optimizer step waits for this by itself. Call it before changing a trainable
        weight in place any other way (``p.data.mul_(...)``, loading into the model)
        while the save may still be copying it.
        """
        return True if self._copied is None else self._copied(timeout)

    def done(self) -> bool:
        """Whether the save has finished, successfully or not."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the save is committed and return its record or report.

        Raises:
            TimeoutError: ``timeout`` seconds passed first; the save keeps running.
            Exception: Whatever the save raised.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the background save {self._label} is still running")
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
        self._finished.wait()
        if self._error is not None and not self._observed:
            self._observed = True
            raise self._error

    def __repr__(self) -> str:
        state = "running" if not self.done() else ("failed" if self._error else "done")
        return f"<SaveHandle {self._label} {state}>"
