"""Where an object lives: its name, its key, and the order in which a read looks for it.

Every object is one tensor (or one DCP chunk), named by the blake3 hex digest of its raw
bytes (:func:`content_hash`) and kept at ``objects/<digest[:2]>/<digest>``, or in a pack
(:mod:`..store.pack`). While a gc runs it may hold an object in its trash,
``trash/<gc id>/<digest>``, until it either deletes it (no checkpoint names it) or puts
it back; the trash of a gc that died stays until the next gc or
:meth:`~weightvault.Vault.break_gc_lock` puts it back. So every read looks in
``objects/`` first, then in any trash, then in ``objects/`` again (the object may have
been put back meanwhile): :func:`locations` is that order, :func:`search_order` adds the
packs, and every reader of objects (whole-tensor checkpoints, DCP chunks, ranged DCP
reads, verify) goes through them.

Example:
    >>> object_key(content_hash(b"abc"))[:11]
    'objects/64/'
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import blake3
import xxhash

from ..store.backend import Store
from ..store.pack import Packed, find, forget, pack_key

__all__ = [
    "DIGEST",
    "checksum",
    "content_hash",
    "in_trash",
    "is_temp",
    "locations",
    "object_key",
    "pack_locations",
    "search_order",
]

#: An object's name: a blake3 hex digest.
DIGEST = re.compile(r"[0-9a-f]{64}")


def content_hash(data: memoryview | bytes) -> str:
    """The blake3 hex digest that names an object (multithreaded for large buffers)."""
    view = memoryview(data).cast("B")
    threads = blake3.blake3.AUTO if view.nbytes >= 1 << 22 else 1
    return blake3.blake3(view, max_threads=threads).hexdigest()


def checksum(data: memoryview | bytes) -> str:
    """The xxh3-64 hex digest a manifest records for a stored tensor (what loads check)."""
    return xxhash.xxh3_64(data).hexdigest()


def object_key(digest: str) -> str:
    """The key of object ``digest`` under ``objects/``."""
    return f"objects/{digest[:2]}/{digest}"


def is_temp(key: str) -> bool:
    """Whether ``key`` is a file a writer is still writing (or died writing)."""
    # LocalStore writes "<dir>/.<random>.tmp" and renames it into place.
    return key.rsplit("/", 1)[-1].startswith(".")


def in_trash(store: Store, digest: str) -> str | None:
    """The key of object ``digest`` in some gc's trash, or ``None``."""
    for blob in store.list("trash"):
        if blob.key.rsplit("/", 1)[-1] == digest and not is_temp(blob.key):
            return blob.key
    return None


def locations(store: Store, digest: str) -> Iterator[str]:
    """Keys to try, in order, for object ``digest`` (see the module docstring).

    The trash is listed only when ``objects/`` did not serve the first key, so a healthy
    read costs one lookup.
    """
    key = object_key(digest)
    yield key
    trashed = in_trash(store, digest)
    if trashed is not None:
        yield trashed
    yield key


def pack_locations(store: Store, digest: str) -> Iterator[tuple[str, Packed]]:
    """``(key, where)`` to try, in order, for object ``digest`` in a pack (:mod:`..store.pack`):
    the pack under ``packs/``, then in a gc's trash, then under ``packs/`` again. Nothing
    when no pack holds it. A pack found gone everywhere is forgotten, and the packs
    listed once more (the object may be in another)."""
    for _ in range(2):
        where = find(store, digest)
        if where is None:
            return
        key = pack_key(where.pack)
        yield key, where
        trashed = in_trash(store, where.pack)
        if trashed is not None:
            yield trashed, where
        yield key, where
        forget(store, where.pack)


def search_order(
    store: Store, digest: str, *, known_first: bool = False
) -> Iterator[tuple[str, Packed | None]]:
    """Where to look for object ``digest``: ``objects/``, a pack, a gc's trash,
    ``objects/`` again (loose objects win: see :mod:`..store.pack`).

    ``known_first`` (for reads of the bytes only) tries first a pack this process
    already knows to hold the object: it holds the same raw bytes any loose copy decodes
    to, and the failed open of the loose name it saves was a tenth of a small resume. A
    pack deleted since fails to open, and the loose file is next. Never for what an
    object's frame says (its delta base, which gc must keep): that is the loose file's.
    """
    known = find(store, digest, refresh=False) if known_first else None
    if known is not None:
        yield pack_key(known.pack), known
    keys = locations(store, digest)
    yield next(keys), None
    yield from pack_locations(store, digest)
    for key in keys:
        yield key, None
