"""The per-checkpoint policy: which objects of a checkpoint become full, and which deltas.

:func:`compact_one` compacts one checkpoint against the one before it; :func:`whole_ends`
then keeps the oldest and the newest loadable whole, and :func:`delta_oldest` turns a
weights-only oldest into history (see :mod:`.compact` for the rules and why they are
safe).

Example:
    >>> compact_one(work, records, index, make_full=True, pause=lambda: None)
"""

from __future__ import annotations

from collections.abc import Callable

from ..._base.dtypes import ITEMSIZE
from ..._file.layout import is_training
from ..objects.encoding import PAYS, SHARED_PAYS
from .probes import _depth, is_delta, run_behind
from .records_cache import Records, Tensors
from .reencode import Work, staging, to_delta, to_full

__all__ = ["compact_one", "delta_oldest", "resumable", "whole_ends"]


def compact_one(
    work: Work,
    records: Records,
    index: int,
    make_full: bool,
    pause: Callable[[], None],
    *,
    new_raw: bool = False,
) -> None:
    """Compact checkpoint ``records.names[index]`` (see :mod:`.compact`), tensor by
    tensor: its object made full, then the previous checkpoint's turned into a delta on
    it while its verified raw bytes are still at hand. ``new_raw`` leaves raw the objects
    the previous checkpoint does not hold."""
    store = work.store
    name = records.names[index]
    new = records.tensors(name)
    if new is None:
        return
    prev = records.names[index - 1] if index > 0 else None
    old = (records.tensors(prev) if prev else None) or {}
    # A resumable oldest's objects stay whole (going back to a run's start is one
    # decode), also where the checkpoint before this one shares them (a tensor unchanged
    # since then). A weights-only oldest is history like the rest: deltas.
    oldest = records.oldest()
    oldest_tensors = records.tensors(oldest) if oldest else None
    oldest_objects = (
        {d for d, *_ in oldest_tensors.values()}
        if oldest_tensors and resumable(oldest_tensors)
        else set()
    )
    # The intent names the new checkpoint's objects, the bases of every delta written
    # here: a gc keeps them even if that checkpoint is deleted meanwhile. The older
    # objects are named by their own record, or were dropped (training state a retain
    # took away): a gc may free those, and they are left alone (see still_named).
    keep_whole = {d for d, *_ in new.values()}  # what the newer checkpoint reads stays whole
    shared = {d for d, *_ in old.values()} & keep_whole
    # Read by every resume of the checkpoints that share it: compressed only if that
    # saves much (SHARED_PAYS).
    spared = shared | records.frozen(name)
    done: set[str] = set()
    limit = work.storage.max_chain
    with staging(work, keep_whole) as staged:
        for tensor, (digest, dtype, shape, nbytes) in new.items():
            itemsize = ITEMSIZE.get(dtype, 4)
            if (
                make_full
                and digest not in done
                and (not new_raw or digest in shared or is_delta(store, digest))
            ):
                done.add(digest)
                pause()
                pays = SHARED_PAYS if digest in spared else PAYS
                if to_full(work, digest, nbytes, itemsize, f"{name}: {tensor}", staged, pays):
                    work.publish(staged)  # it was a delta: full on disk before a delta names it
            old_entry = old.get(tensor)
            if old_entry is None or old_entry[0] in keep_whole or old_entry[0] in done:
                continue
            done.add(old_entry[0])
            pause()
            if prev is None or not records.still_named(prev, tensor, old_entry[0]):
                continue
            where = f"{prev}: {tensor}"
            if (
                limit > 0
                and old_entry[0] not in oldest_objects
                and (old_entry[1], old_entry[2]) == (dtype, shape)
                and run_behind(records, index - 1, tensor, old_entry[0], dtype, shape, limit)
                < limit
                and to_delta(
                    work, old_entry[0], digest, nbytes, itemsize, where, f"{name}: {tensor}", staged
                )
            ):
                continue
            to_full(work, old_entry[0], old_entry[3], ITEMSIZE.get(old_entry[1], 4), where, staged)
        for tensor, (digest, dtype, _, nbytes) in old.items():  # tensors the new one lacks
            if digest not in keep_whole and digest not in done:
                done.add(digest)
                pause()
                if prev is not None and records.still_named(prev, tensor, digest):
                    where = f"{prev}: {tensor}"
                    to_full(work, digest, nbytes, ITEMSIZE.get(dtype, 4), where, staged)
        work.publish(staged)


def resumable(tensors: Tensors) -> bool:
    """Whether a checkpoint of ``tensors`` holds training state: one a run resumes from,
    which the compactor keeps whole when it is the oldest."""
    return any(is_training(n) for n in tensors)


def whole_ends(
    work: Work,
    records: Records,
    compacted: set[str],
    marked: set[str],
    pause: Callable[[], None],
) -> None:
    """Make the delta objects of the oldest and the newest checkpoint full.

    Deleting the oldest or the newest checkpoint leaves its neighbour a to-do marker
    (``Vault.delete``), but a compaction running at that moment may remove the marker as
    it finishes that neighbour with a view of the records from before the deletion. So
    each compaction also checks both ends (one header read per object), except one it
    has ``compacted`` with a view of the records that is still current.

    A weights-only oldest is left to :func:`delta_oldest`, only when it had a to-do
    marker in this pass (``marked``: a retention dropped its state): an object whose
    delta does not pay would otherwise be decoded and hashed again by every pass."""
    oldest = records.oldest()
    oldest_tensors = records.tensors(oldest) if oldest else None
    if oldest and oldest_tensors and not resumable(oldest_tensors):
        if oldest in marked:
            delta_oldest(work, records, oldest, pause)
        oldest = None  # weights-only: history like the rest, left as deltas
    ends = {n for n in (oldest, records.names[-1] if records.names else None) if n}
    for name in sorted(ends - compacted):
        tensors = records.tensors(name)
        if not tensors:
            continue
        deltas: dict[str, tuple[str, str, int]] = {}
        for tensor, (digest, dtype, _, nbytes) in tensors.items():
            if digest not in deltas and is_delta(work.store, digest):
                deltas[digest] = (tensor, dtype, nbytes)
        if not deltas:
            continue
        with staging(work, {d for d, *_ in tensors.values()}) as staged:
            for digest, (tensor, dtype, nbytes) in deltas.items():
                pause()
                if records.still_named(name, tensor, digest):
                    where = f"{name}: {tensor}"
                    to_full(work, digest, nbytes, ITEMSIZE.get(dtype, 4), where, staged)
                    work.publish(staged)


def delta_oldest(work: Work, records: Records, oldest: str, pause: Callable[[], None]) -> None:
    """Turn the full objects of a weights-only oldest checkpoint into deltas on the next
    checkpoint's, where the chain stays within ``max_chain``.

    The oldest was kept whole while it held training state; a retain that drops it later
    (``retain(training_state_last=N)`` after a run) leaves it a to-do marker, and this
    makes the disk what ``Vault(training_state_last=N)`` would have made it. The next
    checkpoint's object is usually a delta by then, so the chain from it is followed
    first: it must end at a full object within ``max_chain - 1`` links and never pass
    through the object being rewritten (no cycle).
    """
    limit = work.storage.max_chain
    index = records.names.index(oldest)
    after = records.names[index + 1 : index + 2]
    tensors, newer = records.tensors(oldest), records.tensors(after[0]) if after else None
    if limit <= 0 or not tensors or not newer:
        return
    pairs = []
    for tensor, (digest, dtype, shape, nbytes) in tensors.items():
        entry = newer.get(tensor)
        if entry is None or entry[0] == digest or (entry[1], entry[2]) != (dtype, shape):
            continue
        if is_delta(work.store, digest):
            continue  # a delta already (from a compaction before the training state went)
        pairs.append((tensor, digest, entry[0], dtype, nbytes))
    if not pairs:
        return  # before reading every record below
    # An object a later checkpoint also names (a tensor changed, then changed back) is
    # left whole: chains through it were counted with it as their end.
    elsewhere = {
        d for n in records.names if n != oldest for d, *_ in (records.tensors(n) or {}).values()
    }
    pairs = [p for p in pairs if p[1] not in elsewhere]
    if not pairs:
        return
    names = {d for _, d, *_ in pairs} | {b for _, _, b, *_ in pairs}
    done: set[str] = set()
    with staging(work, names) as staged:
        for tensor, digest, base, dtype, nbytes in pairs:
            if digest in done:
                continue
            done.add(digest)
            pause()
            if not records.still_named(oldest, tensor, digest):
                continue
            if _depth(work.store, base, digest, limit - 1) is None:
                continue
            where, base_where = f"{oldest}: {tensor}", f"{after[0]}: {tensor}"
            itemsize = ITEMSIZE.get(dtype, 4)
            to_delta(
                work, digest, base, nbytes, itemsize, where, base_where, staged, onto_chain=True
            )
            work.publish(staged)  # one at a time: the next one's chain check sees it
