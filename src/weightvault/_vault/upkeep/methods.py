"""The upkeep half of :class:`~weightvault.Vault`: compaction, retention, gc and verify.

:class:`UpkeepMethods` is a base of ``Vault``: its methods are the vault's public upkeep
API, each a thin call into this folder (:mod:`.compact`, :mod:`.retention`,
:mod:`.pacing`, :mod:`.gc`, :mod:`.verify`). What they need of the vault (its store,
storage, compactor, retention state) the ``Vault`` sets up in its ``__init__``.

Example:
    >>> vault.retain(keep_last=2)
    ['000001']
    >>> vault.gc()
    1048576
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..objects.encoding import Storage
from ..records.record import CheckpointRecord
from ..store.backend import Store
from ..writing.save import Progress
from .compact import CompactReport, compact
from .compactor import Compactor
from .gc import break_gc_lock
from .pacing import GC_PACE, Timing, paced_collect
from .retain import Split
from .retention import Retention, delete_checkpoints
from .verify import VaultVerifyReport, verify_vault

__all__ = ["UpkeepMethods"]


class UpkeepMethods:
    """What a :class:`~weightvault.Vault` does to checkpoints after they are committed."""

    store: Store
    storage: Storage
    training_state_last: int | None
    compaction: str | None
    _compactor: Compactor
    _retention: Retention
    _last_gc: Timing | None
    #: A save dropped training state: the compactor's thread frees it after its pass.
    _gc_due: bool

    if TYPE_CHECKING:

        @property
        def url(self) -> str: ...

        def _require(self) -> None: ...

        def _settle(self) -> None: ...

        def list(self) -> builtins.list[CheckpointRecord]: ...

    def _drop_training(
        self, last: int, split: Split | None = None, *, free: bool = False, kick: bool = True
    ) -> None:
        """Drop the training state of all but the newest ``last`` checkpoints (see
        :func:`drop_training_except_last`), then free what it alone held.

        A run that keeps one resumable checkpoint expects its disk to stay at one
        optimizer state, as a Trainer's save_total_limit does, not to grow until someone
        thinks of gc: a gc frees what the dropped state alone held, paced so that it never
        takes more than a tenth of the run's time. It reads every record, so with a
        background compactor it runs on that thread, off the loop's time (in the save it
        took 0.75 s of each after 150 saves of the lm run). ``free``: run that gc even if
        nothing was dropped (Lightning's plugin, whose deleted checkpoints it frees too).
        """
        dropped = self._retention.drop_training(last, split)
        if dropped or free:
            if self.compaction == "background":
                self._gc_due = True
                if kick:  # a second kick during a save made a second pass read every record
                    self._compactor.kick()
            else:
                self._collect(GC_PACE)

    def _compact_pass(self, pause: Callable[[], None], stop: Any) -> CompactReport:
        # The newest's new objects stay raw for a quick resume (see compact.py).
        report = compact(self.store, self.storage, pause=pause, stop=stop, settle=False)
        if self._gc_due and not stop.is_set():
            self._gc_due = False
            self._collect(GC_PACE)  # what a save's training_state_last dropped
        return report

    def compact(self) -> CompactReport:
        """Compact now, in this thread, what saves left raw; return what was done.

        Waits for this ``Vault``'s background compactor first. Each checkpoint's objects
        become full compressed objects, and the previous checkpoint's turn into deltas
        on them where that is smaller (see docs/vault.md). Safe at any moment: a SIGKILL
        leaves every object in its old encoding or its new one, and another process
        compacting the same vault meanwhile makes this one return ``busy``.

        Example:
            >>> vault.save(model)
            >>> vault.compact().checkpoints
            ['000001']
        """
        self._require()
        self._settle()
        self._compactor.wait(errors=False)  # logged; this pass runs what failed again
        return compact(self.store, self.storage)

    def wait(self, *, raise_errors: bool = True) -> builtins.list[CompactReport]:
        """Wait for a background save and for the background compactor to finish.

        Args:
            raise_errors: Raise what a compaction raised (it was logged as a warning when
                it happened, and what it left is done later); ``False`` only waits.

        Returns:
            The background compactor's reports since the last ``wait``.

        Raises:
            Exception: What the background save raised, or with ``raise_errors`` what a
                compaction raised.

        Example:
            >>> with Vault("runs/ft") as vault:   # the block's end waits the same way
            ...     vault.save(model)
        """
        self._settle()
        return self._compactor.wait(errors=raise_errors)

    def verify(self, *, progress: Progress | None = None) -> VaultVerifyReport:
        """Check every checkpoint's record and every object's size and hash.

        Each object is hashed once however many checkpoints share it. Damage of any kind
        (records, objects) is reported in ``problems``, never raised.
        """
        self._require()
        return verify_vault(self.store, progress)

    def delete(self, name: str) -> None:
        """Remove checkpoint ``name``; its objects are freed by the next :meth:`gc`.

        If it was the oldest or the newest, the next compaction (a save's,
        :meth:`compact`, :meth:`gc`) makes the new oldest or newest whole: neither is
        kept as deltas.

        Raises:
            CheckpointNameError: ``name`` is not a valid name (``latest`` is refused too).
            CheckpointNotFoundError: No checkpoint has that name.
        """
        self._require()
        delete_checkpoints(self.store, [name], compacts=self.storage.codec is not None)

    def retain(
        self,
        keep_last: int | None = None,
        keep_every: int | None = None,
        *,
        training_state_last: int | None = None,
    ) -> builtins.list[str]:
        """Delete checkpoints except the last ``keep_last``, every ``keep_every``-th and
        the one a label marks (:meth:`mark`), and drop the training state of all but the
        last ``training_state_last`` (a marked one's too: its weights and label stay).

        A checkpoint whose training state is dropped keeps its weights (it loads as
        before); resuming from it raises :class:`~weightvault.TrainingStateError`. What
        either frees goes at the next :meth:`gc`, except objects a kept checkpoint's
        deltas are built on.

        Returns:
            The names deleted. With no argument, nothing changes.

        Example:
            >>> vault.retain(training_state_last=1)   # weights of every checkpoint, one resumable
            []
        """
        listing = self.list
        compacts = self.storage.codec is not None
        return self._retention.retain(
            listing, keep_last, keep_every, training_state_last, compacts=compacts
        )

    @property
    def spared(self) -> frozenset[str]:
        """Checkpoints retention leaves whole for now: a mirror has yet to push them."""
        return self._retention.spared.names()

    def _spare(self, name: str) -> None:
        """Keep ``name`` whole (retention skips it) until :meth:`_unspare`; a mirror
        calls this when it queues a checkpoint, so that it pushes what was committed."""
        self._retention.spared.spare(name)

    def _unspare(self, names: Iterable[str]) -> None:
        self._retention.spared.release(names)

    def _retain_deferred(self) -> None:
        """Apply the last retention that spared checkpoints, now that none is spared."""
        if self._retention.apply_deferred(self.retain, self.training_state_last):
            self.gc(pace=GC_PACE)

    def gc(self, *, pace: float | None = None) -> int:
        """Compact what is left to compact (:meth:`compact`), then delete objects no
        checkpoint or in-flight save references; return the object bytes freed (stale
        bookkeeping files are removed too, uncounted). A paced gc (what training loops
        call after each save) does not compact: that stays with the background compactor,
        off the loop's time.

        With ``pace`` (a fraction such as 0.1), a gc whose previous run in this ``Vault``
        took over a second runs only if that was at most ``pace`` of the time since it
        ended, and otherwise returns 0 at once: a loop that frees after every save then
        spends at most about that share of its time in gc (which reads every record, so
        it grows with the vault), and frees what it let go of a few saves later at worst.

        gc takes its candidates out of ``objects/`` into its trash, re-reads every intent
        and checkpoint, puts back whatever is now named, and deletes only the rest: a gc
        stalled at any point never deletes an object a newer save relies on (the
        :mod:`.gc` docstring gives the argument). It first puts back the trash of gcs
        that died.

        Raises:
            FormatError: A checkpoint record or intent is unreadable, so gc cannot know
                which objects it needs; every object is left in place. Fix or remove that
                record first.
        """
        self._require()
        if pace is None:
            self.compact()
        return self._collect(pace)

    def _collect(self, pace: float | None) -> int:
        """The gc half of :meth:`gc`: free what nothing names (paced as it says)."""
        freed, self._last_gc = paced_collect(self.store, pace, self._last_gc)
        return freed

    def break_gc_lock(self) -> builtins.list[str]:
        """Remove the markers of gcs that died, after putting their trash back.

        A gc's marker is dead when its heartbeat is older than the staleness window (a
        minute), or at once when it was written on this machine by a process that has
        exited. Objects such a gc had moved to its trash go back to ``objects/`` (the next
        gc frees them if nothing needs them), so breaking a lock never loses data.

        Returns:
            The markers removed.

        Raises:
            VaultBusyError: A marker's gc may still be running; nothing was changed.
        """
        self._require()
        return break_gc_lock(self.store)
