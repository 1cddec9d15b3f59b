"""The compactor: compression and deltas on anchors, after a save has committed.

A save writes raw objects and leaves a to-do marker, ``compact/<name>.todo``, beside its
record (:func:`mark`). Every object the compactor leaves is either *whole* (raw bytes,
or a full compressed frame) or one delta on a whole object of the same tensor (same
name, dtype and shape) in an older checkpoint, its *anchor*; never a delta on a delta,
so a load of any checkpoint reads at most two objects per tensor. Compacting checkpoint
N then does two things:

1. **The newest loads whole.** Each object of N is made whole. A whole weight is
   compressed only when that saves at least a quarter of it
   (:data:`~..objects.encoding.ANCHOR_PAYS`): a resume reads the newest, and every delta
   on an anchor reads the anchor, so trained fp32 weights (about 0.84) stay raw and such
   a read is a copy, not a decode; bf16 weights (about 0.7) and constant buffers are
   compressed. Training state is compressed when that saves at least 5%. The background
   compactor (``settle=False``) leaves raw the objects that are new in the newest
   checkpoint, and its marker in place, so a resume copies raw bytes; objects the newest
   shares with the checkpoint before it (a frozen backbone) are encoded at once.
   :meth:`Vault.compact`, ``gc`` and ``weightvault vault compact`` settle: they encode
   the newest's own objects too.
2. **Deltas on anchors.** Each changed weight object X of the checkpoint before N (P, the
   former newest) becomes a delta on its tensor's anchor: the whole object that the
   checkpoint before P holds for the tensor, or the base that one is a delta on
   (:func:`.probes.anchor_for`). X stays whole instead, and is the next anchor, when
   ``max_chain`` deltas (``Vault(delta_chain=...)``, 9 by default) point at the anchor
   already, when the delta is not smaller than X whole (it stops paying), or when no
   older checkpoint holds the tensor alike or its object is not whole. An object a later
   checkpoint's delta points at is an anchor and stays whole. A vault chained by an
   older compactor (an older checkpoint a delta on the next one) keeps its chains as
   they are: an object on such a chain is no anchor, so anchors start from the next
   save on. **Training state is never a delta**: retention drops the oldest state
   first, so a kept checkpoint's state built on an older anchor would rest on state
   that goes; and a delta of Adam's first moment does not pay at all.
3. **A resumable oldest loads whole too.** The oldest checkpoint, when it holds training
   state (a run's start, what a user restarts from), stays whole; it is the first anchor
   anyway. When deleting checkpoints makes a delta checkpoint the oldest or the newest,
   ``Vault.delete`` and ``retain`` leave it a to-do marker, and its compaction makes its
   delta objects whole (:func:`.policy.whole_ends`); a crash between the two leaves it
   deltas, loadable. A weights-only oldest (``training_state_last``, or a retain that
   dropped its state later and left it a marker) stays whole where it is the anchor of
   the checkpoints after it; an object of it that no later delta points at becomes a
   delta on the anchor the next checkpoint reads (:func:`.policy.delta_oldest`), so a
   retain after the run leaves what ``Vault(training_state_last=N)`` would have.
   Deleting an anchor's checkpoint rebases nothing: the anchor object stays as the base
   of its deltas, and gc frees it once no delta points at it. A rebase would decode and
   encode every dependent to free about one delta's bytes (one of them becomes whole).

An object is named by the blake3 of its raw bytes, so a new encoding replaces the old
one atomically (a rename over it) and every reader, before or after, gets the same raw
bytes. Safety, point by point:

- **Never from damaged bytes.** Every object is decoded and its blake3 checked against
  its name before anything is encoded from it. A damaged object is reported and left as
  it is; nothing is built on it.
- **No cycle.** A delta's base is always whole when the delta is written: the anchor is
  a whole object (a base that is itself a delta is refused), and the pass's intent
  names it, so a gc meanwhile keeps it. Only one compactor runs per vault at a time
  (:class:`~.compact_lease.CompactLease`: an ``flock`` on a local disk, which the kernel
  releases when a process dies; an exclusive lease file with a heartbeat on object
  stores), and it never turns an object a delta points at into a delta, so an anchor
  stays whole.
- **gc.** The compactor registers an intent naming every object it touches, the new
  checkpoint's and the anchors it points at (:func:`~.reencode.staging`,
  :mod:`..writing.commit`), and checks them in ``objects/`` after that, as a save does;
  gc keeps every base a live object's frame names, read afresh each time (:mod:`.live`).
- **Crashes.** Each replacement is written to a temporary file, made durable, then
  renamed into place; a SIGKILL leaves the old encoding or the new, and at most a
  temporary file gc removes. The marker goes only once its checkpoint is done, so work
  left when a process exits is picked up by the next compaction.

A pass, in calling order: take the lease (:mod:`.compact_lease`), read the records
(:mod:`.records_cache`), compact each checkpoint to do (:mod:`.policy`, which finds
anchors with :mod:`.probes` and re-encodes with :mod:`.reencode`), keep the ends whole,
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
