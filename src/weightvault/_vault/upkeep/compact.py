"""The compactor: compression and backward deltas, after a save has committed.

A save writes raw objects and leaves a to-do marker, ``compact/<name>.todo``, beside its
record (:func:`mark`). Compacting checkpoint N then does two things:

1. **The newest loads whole.** Each object of N becomes a full compressed object (a
   frame, when that saves at least 5%), or stays raw. The background compactor
   (``settle=False``) leaves raw the objects that are new in the newest checkpoint, and
   its marker in place: a resume, which reads the newest, then copies raw bytes instead
   of decoding them, and the next save's compaction turns them into deltas (or full
   compressed objects) anyway. Objects the newest shares with the checkpoint before it,
   and its frozen tensors' objects (a frozen backbone), are compressed at once, but only
   when that saves at least ``1 - SHARED_PAYS`` (a quarter) of them: every resume of every
   checkpoint that shares one decodes it, and the vault stores it once already, so on
   trained fp32 weights (about 0.84) they stay raw. :meth:`Vault.compact`, ``gc`` and
   ``weightvault vault compact`` settle: they compress the newest too.
2. **Deltas point back.** Each object X of the checkpoint before N (P) whose tensor (same
   name, dtype and shape) has another object Y in N becomes a delta on Y, when that is
   smaller than X in full. So a resume reads one object per tensor, and older
   checkpoints read a chain that ends at a newer full object. At most ``max_chain``
   deltas ever hang behind one full object: an X with that many behind it stays full
   (a *key object*), so any checkpoint reads at most ``max_chain + 1`` objects per
   tensor. Training state dropped from old checkpoints is never the base of a kept one.
3. **A resumable oldest loads whole too.** The oldest checkpoint, when it holds training
   state (a run's start, what a user restarts from), is never turned into deltas. When
   deleting checkpoints makes a delta checkpoint the oldest (or the newest: deleting the
   newest leaves the one before it a delta on what went), ``Vault.delete`` and
   ``retain`` leave it a to-do marker, and its compaction makes its delta objects full
   again (the newest's too when the background compactor leaves its raw objects raw); a
   crash between the two leaves it deltas, loadable. In a run of ``max_chain + 1``
   checkpoints that costs nothing (the two full objects are the newest and the oldest
   instead of the newest and the one ``max_chain`` behind it); otherwise at most one
   more full object per tensor than chains alone would keep. A weights-only oldest
   (``training_state_last``, or a retain that dropped its state later and left it a
   marker) is history: its full objects become deltas on the next checkpoint's, onto
   that object's chain when it is short enough (:func:`.policy.delta_oldest`), so a retain
   after the run leaves what ``Vault(training_state_last=N)`` would have.

An object is named by the blake3 of its raw bytes, so a new encoding replaces the old
one atomically (a rename over it) and every reader, before or after, gets the same raw
bytes. Safety, point by point:

- **Never from damaged bytes.** Every object is decoded and its blake3 checked against
  its name before anything is encoded from it. A damaged object is reported and left as
  it is; nothing is built on it.
- **No cycle.** A delta's base is always a full (or raw) object when the delta is
  written: Y is made full and published before X is encoded against it. Only one
  compactor runs per vault at a time (:class:`~.compact_lease.CompactLease`: an ``flock``
  on a local disk, which the kernel releases when a process dies; an exclusive lease
  file with a heartbeat on object stores), so nothing turns Y into a delta meanwhile.
- **gc.** The compactor registers an intent naming every object it touches
  (:func:`~.reencode.staging`, :mod:`..writing.commit`) and checks them in ``objects/``
  after that, as a save does; gc keeps every base a live object's frame names, read
  afresh each time (:mod:`.live`).
- **Crashes.** Each replacement is written to a temporary file, made durable, then
  renamed into place; a SIGKILL leaves the old encoding or the new, and at most a
  temporary file gc removes. The marker goes only once its checkpoint is done, so work
  left when a process exits is picked up by the next compaction.

A pass, in calling order: take the lease (:mod:`.compact_lease`), read the records
(:mod:`.records_cache`), compact each checkpoint to do (:mod:`.policy`, which probes
chains with :mod:`.probes` and re-encodes with :mod:`.reencode`), keep the ends whole,
then take packs apart (:mod:`.unpack`); :class:`CompactReport` (:mod:`.report`) says
what was done.

Example:
    >>> report = compact(vault.store, vault.storage)
    >>> report.checkpoints
    ['000001', '000002']
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..objects.encoding import Storage
from ..records.names import record_names
from ..records.todo import TODO, held_packs, mark, pending, todo_key
from ..store.backend import Store
from ..store.pack import pack_table
from .compact_lease import CompactLease
from .policy import compact_one, whole_ends
from .records_cache import Records
from .reencode import Work
from .report import CompactReport
from .unpack import take_out

__all__ = [
    "TODO",
    "CompactReport",
    "compact",
    "held_packs",
    "mark",
    "pending",
]


def compact(
    store: Store,
    storage: Storage,
    *,
    pause: Callable[[], None] = lambda: None,
    stop: threading.Event | None = None,
    settle: bool = True,
) -> CompactReport:
    """Compact every checkpoint left to the compactor, oldest first.

    Args:
        store: The vault's store.
        storage: Its codec and chain length (no codec: the to-do markers are dropped,
            and packs are taken apart all the same).
        pause: Called before each object; blocks while a save or load of this process
            runs, so compaction yields to them.
        stop: Set to stop after the current object (the rest stays to do).
        settle: Compress the newest checkpoint's new objects too. ``False`` (the
            background compactor) leaves them raw, and the newest's marker in place, for
            the next save's compaction or a settling one (see the module docstring).

    Returns:
        What was done; ``busy`` if another compactor holds the vault.
    """
    start = time.monotonic()
    report = CompactReport()
    lease = CompactLease(store)
    if not lease.acquire():
        report.busy = True
        return report
    try:
        todo = set(pending(store))
        table = pack_table(store)
        table.refresh(store)
        if not todo and not table.packs():
            return report
        records = Records(store)
        work = Work(store, storage, report)
        order = [n for n in records.names if n in todo]
        whole: set[str] = set()
        for name in order:
            if stop is not None and stop.is_set():
                break
            if storage.codec is not None:
                index = records.names.index(name)
                # The next checkpoint's compaction turns these objects into deltas on its
                # own anyway, if it is still to do and an ordinary one: no full pass first.
                after = records.names[index + 1 : index + 2]
                make_full = not (
                    after and after[0] in todo and records.tensors(after[0]) is not None
                )
                leave_raw = not after and not settle  # the newest, for a quick resume
                compact_one(
                    work, records, index, make_full, _stopping(pause, stop, lease.beat),
                    new_raw=leave_raw,
                )  # fmt: skip
                if make_full:
                    whole.add(name)  # no delta object of its own is left
                if leave_raw:
                    continue  # the next save's compaction, or a settling one, finishes it
            store.delete(todo_key(name))
            report.checkpoints.append(name)
        # Markers of checkpoints deleted meanwhile.
        for name in todo - set(records.names):
            store.delete(todo_key(name))
        if storage.codec is not None:
            # A deletion meanwhile may have moved the ends: then read the records again.
            same = set(record_names(store)) == records.listed
            ends = records if same else Records(store)
            whole_ends(
                work, ends, whole if same else set(), set(order),
                _stopping(pause, stop, lease.beat),
            )  # fmt: skip
        # Without a codec too: a load that finds an object in no pack it knows reads
        # every pack's index, so packs left in place would cost a resume in a new
        # process one index per save the vault ever took.
        take_out(work, records, set(pending(store)), _stopping(pause, stop, lease.beat))
    except _Stopped:
        pass
    finally:
        lease.release()
        report.seconds = time.monotonic() - start
    return report


class _Stopped(Exception):
    """Raised from ``pause`` once ``stop`` is set: leave the rest for later."""


def _stopping(
    pause: Callable[[], None], stop: threading.Event | None, beat: Callable[[], None]
) -> Callable[[], None]:
    def check() -> None:
        pause()
        beat()
        if stop is not None and stop.is_set():
            raise _Stopped

    return check
