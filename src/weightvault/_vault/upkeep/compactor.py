"""The compactor thread of one :class:`~weightvault.Vault`: compaction after each save.

A save commits raw objects and returns; this thread then compacts (:mod:`.compact`)
while training goes on. It yields: before each object it waits while a save or a load of
the same ``Vault`` runs (:meth:`Compactor.busy`), so it never competes with the work a
user waits for. :meth:`Compactor.wait` waits for it to finish. At interpreter exit it is
told to stop after the object at hand (it never holds a process up for long); what is
left is picked up by the next compaction, since each checkpoint's to-do marker goes only
once it is done.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator

from .compact import CompactReport

__all__ = ["Compactor"]

log = logging.getLogger("weightvault")

#: How long interpreter exit waits for a compactor to stop after its current object.
EXIT_WAIT = 10.0


class Compactor:
    """Runs ``work`` (one compaction pass) on a thread of its own whenever kicked."""

    def __init__(self, work: Callable[[Callable[[], None], threading.Event], CompactReport]):
        self._work = work
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._wanted = False
        self._active = 0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        #: Every pass's report, newest last (what ``Vault.wait()`` returns).
        self.reports: list[CompactReport] = []
        _LIVE.add(self)

    def kick(self) -> None:
        """Compact soon: start the thread, or have it run once more."""
        with self._cond:
            self._wanted = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="weightvault-compact", daemon=True
                )
                self._thread.start()

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Hold the compactor back while a save or a load runs."""
        with self._cond:
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def wait(self, *, errors: bool = True) -> list[CompactReport]:
        """Wait until no pass runs or is due; the reports since the last wait.

        Raises:
            Exception: With ``errors``, what a pass raised (once; the thread stopped
                there; it was logged when it happened).
        """
        with self._cond:
            while self._thread is not None:
                self._cond.wait()
            reports, self.reports = self.reports, []
            error, self._error = self._error, None
        if error is not None and errors:
            raise error
        return reports

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the object at hand; wait up to ``timeout`` seconds for that."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def pause_while_busy(self) -> None:
        """Block while a save or a load of this ``Vault`` runs (until the stop at exit)."""
        with self._cond:
            while self._active and not self._stop.is_set():
                self._cond.wait(0.5)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._wanted or self._stop.is_set():
                    self._done()
                    return
                self._wanted = False
            try:
                report = self._work(self.pause_while_busy, self._stop)
            except BaseException as e:  # reported by wait(); the data is safe either way
                log.warning(
                    "weightvault compaction failed (%s: %s); what is left is done later",
                    type(e).__name__,
                    e,
                )
                with self._cond:
                    self._error = e
                    self._done()
                return
            for line in report.damaged:
                log.warning("compaction left a damaged object as it is: %s", line)
            with self._cond:
                self.reports.append(report)
                if report.busy:  # another process compacts this vault; it takes the rest
                    self._wanted = False
                    self._done()
                    return

    def _done(self) -> None:
        """Mark the thread gone (called with the condition held)."""
        self._thread = None
        self._cond.notify_all()


_LIVE: weakref.WeakSet[Compactor] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for compactor in list(_LIVE):
        compactor.stop(EXIT_WAIT)
