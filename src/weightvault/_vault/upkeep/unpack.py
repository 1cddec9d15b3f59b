"""Unpacking: taking objects out of pack files, written loose and raw.

:func:`unpack` is the one way out of a pack, for the compactor (:func:`take_out`, once
its checkpoints are compacted) and for gc (a pack holding more dead bytes than live).
Every object is read and checked against its name before it is written loose; one that
does not match stays in its pack.

Example:
    >>> unpack(store, [(digest, nbytes)], read=verified)
    1
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from ..objects.address import object_key
from ..objects.file import write_loose
from ..records.todo import held_packs
from ..store.backend import Store
from ..store.pack import Packed, pack_key, pack_table
from .records_cache import Records
from .reencode import Damaged, Work

__all__ = ["take_out", "unpack"]


def unpack(
    store: Store,
    wanted: Iterable[tuple[str, int]],
    read: Callable[[str, int], memoryview | None],
) -> int:
    """Write each ``(digest, nbytes)`` of ``wanted`` loose, raw; return how many were.

    ``read`` gives an object's verified raw bytes, or ``None`` for one that is damaged
    (it says so itself), which stays in its pack. ``wanted`` is drawn one object at a
    time, so it may pause between them.
    """

    def verified() -> Iterator[tuple[str, memoryview]]:
        for digest, nbytes in wanted:
            raw = read(digest, nbytes)
            if raw is not None:
                yield digest, raw

    return write_loose(store, verified())


def take_out(work: Work, records: Records, held_by: set[str], pause: Callable[[], None]) -> None:
    """Take the objects of compacted checkpoints out of their packs, then delete every
    pack whose objects are all loose (:mod:`..store.pack`).

    The packs of checkpoints still to compact (``held_by``: the newest, left raw for a
    quick resume) stay as they are; objects no record names (training state a retain
    dropped) stay in their pack, which gc frees. Each object taken out is checked
    against its name first and written raw: the compaction before this decided it stays
    raw.
    """
    store = work.store
    table = pack_table(store)
    table.refresh(store)
    packs = table.packs()
    if not packs:
        return
    held = held_packs(store, held_by)
    packs = {k: v for k, v in packs.items() if k not in held}
    named = records.naming({d: pack for pack, index in packs.items() for d in index})

    def read(digest: str, nbytes: int) -> memoryview | None:
        ckpt, tensor, _ = named[digest]
        try:
            return work.raw(digest, nbytes, f"{ckpt}: {tensor}")
        except Damaged:
            return None  # reported (or gone), and left in its pack

    for pack, index in sorted(packs.items()):
        work.report.unpacked += unpack(store, _leftovers(work, index, named, pause), read)
        if all(store.exists(object_key(d)) for d in index):
            # Every object is loose now, and loose objects win every lookup: a reader
            # that found one in this pack and then cannot open it looks again.
            store.delete(pack_key(pack))
            table.forget(pack)
            work.report.packs_deleted += 1


def _leftovers(
    work: Work,
    index: dict[str, Packed],
    named: dict[str, tuple[str, str, int]],
    pause: Callable[[], None],
) -> Iterator[tuple[str, int]]:
    """Each object of a pack, with its size, that a record names and that has no loose
    copy yet."""
    for digest, packed in index.items():
        if digest not in named or work.store.exists(object_key(digest)):
            continue
        nbytes = named[digest][2]
        if packed.size != nbytes:
            continue  # not the object that record names: the load reports it
        pause()
        yield digest, nbytes
