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
from ..objects.encoding import ANCHOR_PAYS, PAYS, SHARED_PAYS
from .probes import anchor_for, base_of, has_dependents, is_delta
from .records_cache import Records, Tensors
from .reencode import Work, staging, to_delta, to_full

__all__ = ["compact_one", "delta_oldest", "resumable", "whole_ends", "whole_pays"]


def whole_pays(tensor: str, shared: bool) -> float:
    """The most a whole object of ``tensor`` may keep of its raw bytes once compressed
    (:func:`~.reencode.to_full`'s ``pays``): weights are anchors, read by every delta on
    them (:data:`~..objects.encoding.ANCHOR_PAYS`); training state is read by its own
    checkpoint alone, unless checkpoints share it (``shared``)."""
    if not is_training(tensor):
        return ANCHOR_PAYS
    return SHARED_PAYS if shared else PAYS


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
    tensor: its objects made whole, then the previous checkpoint's objects turned into
    deltas on their tensors' anchors, or kept whole as new anchors. ``new_raw`` leaves
    raw the objects the previous checkpoint does not hold."""
    store = work.store
    name = records.names[index]
    new = records.tensors(name)
    if new is None:
        return
    prev = records.names[index - 1] if index > 0 else None
    old = (records.tensors(prev) if prev else None) or {}
    # A resumable oldest's objects stay whole (going back to a run's start is one
    # read), also where the checkpoint before this one shares them (a tensor unchanged
    # since then). A weights-only oldest is history like the rest.
    oldest = records.oldest()
    oldest_tensors = records.tensors(oldest) if oldest else None
    oldest_objects = (
        {d for d, *_ in oldest_tensors.values()}
        if oldest_tensors and resumable(oldest_tensors)
        else set()
    )
    # The intent names the new checkpoint's objects and the previous one's anchors: a
    # gc keeps them even if their checkpoints are deleted meanwhile. The older objects
    # are named by their own record, or were dropped (training state a retain took
    # away): a gc may free those, and they are left alone (see still_named).
    keep_whole = {d for d, *_ in new.values()}  # what the newer checkpoint reads stays whole
    shared = {d for d, *_ in old.values()} & keep_whole
    spared = shared | records.frozen(name)
    anchors = _anchors(records, index, old, keep_whole | oldest_objects, work.storage.max_chain)
    done: set[str] = set()
    with staging(work, keep_whole | set(anchors.values())) as staged:
        for tensor, (digest, dtype, _, nbytes) in new.items():
            if (
                make_full
                and digest not in done
                and (not new_raw or digest in shared or is_delta(store, digest))
            ):
                done.add(digest)
                pause()
                pays = whole_pays(tensor, digest in spared)
                where = f"{name}: {tensor}"
                if to_full(work, digest, nbytes, ITEMSIZE.get(dtype, 4), where, staged, pays):
                    work.publish(staged)  # it was a delta: whole before a delta names it
        for tensor, (digest, dtype, _, nbytes) in old.items():
            if digest in keep_whole or digest in done:
                continue
            done.add(digest)
            pause()
            if prev is None or not records.still_named(prev, tensor, digest):
                continue
            where, itemsize = f"{prev}: {tensor}", ITEMSIZE.get(dtype, 4)
            anchor = anchors.get(digest)
            if anchor is not None and to_delta(
                work, digest, anchor, nbytes, itemsize, where, f"the anchor of {where}", staged
            ):
                continue
            # Whole: training state, a resumable oldest's, an anchor, or the next anchor.
            to_full(work, digest, nbytes, itemsize, where, staged, whole_pays(tensor, False))
        work.publish(staged)


def _anchors(
    records: Records, index: int, old: Tensors, whole: set[str], most: int
) -> dict[str, str]:
    """``{object: its anchor}`` for the objects of checkpoint ``index - 1`` (``old``) that
    may become deltas: weights, not in ``whole`` (what the newer checkpoint or a
    resumable oldest reads), and not an anchor that a later delta points at already."""
    out: dict[str, str] = {}
    if most <= 0 or index < 1:
        return out
    for tensor, (digest, dtype, shape, _) in old.items():
        if digest in whole or digest in out or is_training(tensor):
            continue
        if has_dependents(records, index, tensor, digest):
            continue
        anchor = anchor_for(records, index - 1, tensor, digest, dtype, shape, most)
        if anchor is not None:
            out[digest] = anchor
    return out


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
    """Make the delta objects of the oldest and the newest checkpoint whole.

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
                    pays = whole_pays(tensor, False)
                    to_full(work, digest, nbytes, ITEMSIZE.get(dtype, 4), where, staged, pays)
                    work.publish(staged)


def delta_oldest(work: Work, records: Records, oldest: str, pause: Callable[[], None]) -> None:
    """Turn the whole objects of a weights-only oldest checkpoint into deltas on the next
    checkpoint's anchors, where no later delta points at them.

    The oldest was kept whole while it held training state; a retain that drops it later
    (``retain(training_state_last=N)`` after a run) leaves it a to-do marker, and this
    makes the disk what ``Vault(training_state_last=N)`` would have made it. Usually the
    oldest is the anchor of the checkpoints after it and stays whole; an object the next
    checkpoint does not point at becomes a delta on the anchor that one reads.
    """
    index = records.names.index(oldest)
    after = records.names[index + 1 : index + 2]
    tensors, newer = records.tensors(oldest), records.tensors(after[0]) if after else None
    if work.storage.max_chain <= 0 or not tensors or not newer:
        return
    pairs = []
    for tensor, (digest, dtype, shape, nbytes) in tensors.items():
        entry = newer.get(tensor)
        if entry is None or entry[0] == digest or (entry[1], entry[2]) != (dtype, shape):
            continue
        if is_training(tensor) or is_delta(work.store, digest):
            continue
        anchor = base_of(work.store, entry[0]) or entry[0]
        if anchor == digest or is_delta(work.store, anchor):
            continue  # the oldest is the next one's anchor, or an older chain
        pairs.append((tensor, digest, anchor, dtype, nbytes))
    if not pairs:
        return  # before reading every record below
    # An object a later checkpoint also names (a tensor changed, then changed back), or
    # that a later delta points at, is left whole.
    elsewhere = {
        d for n in records.names if n != oldest for d, *_ in (records.tensors(n) or {}).values()
    }
    pairs = [
        p
        for p in pairs
        if p[1] not in elsewhere and not has_dependents(records, index + 1, p[0], p[1])
    ]
    if not pairs:
        return
    names = {d for _, d, *_ in pairs} | {b for _, _, b, *_ in pairs}
    done: set[str] = set()
    with staging(work, names) as staged:
        for tensor, digest, anchor, dtype, nbytes in pairs:
            if digest in done:
                continue
            done.add(digest)
            pause()
            if not records.still_named(oldest, tensor, digest):
                continue
            where = f"{oldest}: {tensor}"
            itemsize = ITEMSIZE.get(dtype, 4)
            to_delta(
                work, digest, anchor, nbytes, itemsize, where, f"the anchor of {where}", staged
            )
        work.publish(staged)
