"""A mirror beside training: each committed checkpoint pushed to another vault, off the
training thread.

Training loops (``VaultCallback(mirror=...)``, ``VaultCheckpointIO(mirror=...)``, the Keras
``VaultCheckpoint(mirror=...)``) call :meth:`Mirror.after_save` once a checkpoint has
committed locally; that only queues its name. A thread of the mirror's own then pushes
what is queued (:func:`~.transfer.transfer`: only the objects the mirror lacks). The
training step never waits for the network, and never fails because of it:

- Retention waits for the mirror: ``retain`` and ``training_state_last`` leave a queued
  checkpoint whole (its training state too) until it is pushed, so the mirror gets each
  checkpoint as it committed; :meth:`Mirror.wait` then applies what they left.
- A push that fails (network down, credentials wrong) logs one warning per checkpoint on
  the ``weightvault`` logger and keeps the checkpoint queued; the next save tries again.
  Retention no longer waits for those (an outage must not fill the local disk), so a
  checkpoint retention deletes meanwhile is dropped from the queue; so is one deleted by
  name (``delete``); local ``retain`` and ``gc`` never touch the mirror, which keeps what
  it was sent.
- A name the mirror holds with other content (a resumed run that replaced a checkpoint)
  is warned about once and not retried: the mirror never overwrites.
- :meth:`Mirror.wait` (called at the end of training) waits for the push in flight, then
  tries once more for what is still queued.

The thread runs nicer than training (on Linux), and between batches of objects it holds
back while the local vault saves or loads, so the loop's own checkpoint work comes first.

The mirror sees both vaults through what it needs of them (:class:`Local` and
:class:`Receiver`, which a :class:`~weightvault.Vault` is): a mirror given as a path or a
URL is opened as a vault of the local vault's own class.

Example:
    >>> mirror = Mirror(vault, "s3://bucket/run1")
    >>> mirror.after_save(vault.save(model).name)   # returns at once
    >>> mirror.wait().checkpoints                   # at the end of training
    ['000001']
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast

from ..._base.errors import CheckpointExistsError, SourceDamagedError
from ..._base.priority import lower_priority
from ..records.names import record_names
from ..store.backend import Store
from ..upkeep.compactor import Compactor
from .transfer import TransferReport, transfer

__all__ = ["Destination", "Local", "Mirror", "Receiver"]

log = logging.getLogger("weightvault")


class Local(Protocol):
    """What a mirror needs of the vault training saves into (a :class:`~weightvault.Vault`):
    its store, its compactor's pause, and the sparing that makes retention wait."""

    store: Store
    _compactor: Compactor

    @property
    def url(self) -> str: ...

    def _spare(self, name: str) -> None: ...

    def _unspare(self, names: Iterable[str]) -> None: ...

    def _retain_deferred(self) -> None: ...


class Receiver(Protocol):
    """What a mirror needs of the vault it pushes to (a :class:`~weightvault.Vault`)."""

    store: Store
    gc_wait: float


#: A mirror as given: a vault, or the path or URL of one.
Destination = Receiver | str | os.PathLike[str]


class Mirror:
    """Pushes ``vault``'s checkpoints to ``dest`` in a background thread, as they commit.

    Args:
        vault: The local vault training saves into.
        dest: The mirror: a :class:`~weightvault.Vault`, a path or an fsspec URL. It is
            opened in the mirror's thread, at the first push, so a mirror that cannot be
            reached never fails the training loop that makes it.
        **storage_options: For ``dest`` given as a URL (endpoint, credentials, timeouts).
    """

    def __init__(self, vault: Local, dest: Destination, **storage_options: Any) -> None:
        self.vault = vault
        self._dest_spec = dest
        self._options = storage_options
        self._dest: Receiver | None = None
        self._queue: list[str] = []
        self._warned: set[str] = set()
        self._released: set[str] = set()  # queued, but retention may take them
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._added = 0  # names queued so far: a save during a push is pushed after it
        #: The last successful push's report.
        self.last: TransferReport | None = None

    def __repr__(self) -> str:
        return f"Mirror({self.vault.url!r} -> {self._dest_spec!r})"

    def after_save(self, name: str) -> None:
        """Queue checkpoint ``name`` (committed locally) and what failed before; return at
        once."""
        with self._cond:
            if name not in self._queue:
                self._queue.append(name)
                self.vault._spare(name)  # retention waits until it is pushed
            self._added += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="weightvault-mirror", daemon=True
                )
                self._thread.start()

    def wait(self, timeout: float | None = None) -> TransferReport | None:
        """Wait for the push in flight, then push once more what is still queued (in this
        thread); return the last successful push's report. Never raises for the mirror's
        failures: they are logged."""
        with self._cond:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if self._queue and (thread is None or not thread.is_alive()):
            self._push_queued()
        if thread is None or not thread.is_alive():
            self.vault._retain_deferred()  # what retention left for the mirror
        return self.last

    def _run(self) -> None:
        lower_priority()  # training's cores come first; the push is work nobody waits for
        while True:
            with self._cond:
                seen = self._added
            ok = False
            try:
                ok = self._push_queued()
            finally:
                with self._cond:
                    # A failed push waits for the next save; a save made meanwhile goes now.
                    stop = not ok or self._added == seen
                    if stop:
                        self._thread = None
            if stop:
                return

    def _push_queued(self) -> bool:
        """One push of everything queued; whether it worked. Failures are logged, never
        raised."""
        with self._cond:
            names = list(self._queue)
        if not names:
            return True
        try:
            present = set(record_names(self.vault.store))
            self._forget([n for n in names if n not in present])  # deleted locally
            names = [n for n in names if n in present]
            if not names:
                return True
            dest = self._receiver()
            # Between batches the push waits while the local vault saves or loads.
            report = transfer(
                self.vault.store,
                dest.store,
                names,
                gc_wait=dest.gc_wait,
                pause=self.vault._compactor.pause_while_busy,
            )
        except (CheckpointExistsError, SourceDamagedError) as e:
            self._warn(names, e, retry=False)  # a retry cannot succeed
            self._forget(names)
            return True
        except Exception as e:  # the network, credentials, the mirror's disk: retried
            self._warn(names, e, retry=True)
            self._release(names)  # an outage must not stop local retention for long
            return False
        self.last = report
        self._forget(report.checkpoints)
        return True

    def _release(self, names: list[str]) -> None:
        """Let retention have ``names`` again while they stay queued for a retry."""
        with self._cond:
            fresh = [n for n in names if n not in self._released]
            self._released |= set(fresh)
            self.vault._unspare(fresh)

    def _receiver(self) -> Receiver:
        if self._dest is None:
            spec = self._dest_spec
            if isinstance(spec, str | os.PathLike):
                # Opened as the local vault is: the same class, never compacting here.
                opener = cast("Callable[..., Receiver]", type(self.vault))
                spec = opener(spec, compaction=None, **self._options)
            self._dest = spec
        return self._dest

    def _forget(self, names: list[str]) -> None:
        with self._cond:
            gone = [n for n in self._queue if n in names and n not in self._released]
            self._released -= set(names)
            self._queue = [n for n in self._queue if n not in names]
            self._warned -= set(names)
            self.vault._unspare(gone)

    def _warn(self, names: list[str], error: Exception, *, retry: bool) -> None:
        new = [n for n in names if n not in self._warned]
        if not new:
            return
        self._warned |= set(new)
        then = "retrying at the next save" if retry else "not retried"
        log.warning(
            "mirror %s: could not push %s (%s: %s); %s",
            self._dest_spec,
            ", ".join(new),
            type(error).__name__,
            error,
            then,
        )
