"""Fetching objects ahead: a remote store's object files, read concurrently before a load.

On a remote store each read waits on the network, so a load of many tensors first brings
their files (and their delta bases' files) into memory, a chain level at a time, and
then reads them from there (:data:`~.file.Files`).

Example:
    >>> from weightvault._vault.store.backend import LocalStore
    >>> import tempfile
    >>> prefetch(LocalStore(tempfile.mkdtemp()), [])
    {}
"""

from __future__ import annotations

from collections.abc import Iterator

from ..store.backend import Store
from ..store.pack import find, pack_key, pack_table
from .address import object_key
from .frame import MAX_DEPTH
from .probe import parse_head

__all__ = ["prefetch"]


def prefetch(store: Store, digests: Iterator[str] | list[str]) -> dict[str, bytes]:
    """The files of ``digests`` and of their delta bases, fetched concurrently, one
    chain level at a time; used for remote stores, where each read waits on the network.

    Objects in a save's pack come with one read of each pack they are in (a pack holds
    raw bytes only, so they name no bases). An object that is in neither (a gc may hold
    it in its trash) ends the prefetch early: reads then look for it one by one, and name
    its tensor if it is gone.
    """
    out: dict[str, bytes] = {}
    wanted = sorted(set(digests))
    pack_table(store).refresh(store)
    for _ in range(MAX_DEPTH + 1):
        _prefetch_packed(store, [d for d in wanted if d not in out], out)
        keys = {object_key(d): d for d in wanted if d not in out}
        if not keys:
            break
        try:
            got = store.get_many(list(keys))
        except FileNotFoundError:
            break
        bases = []
        for key, data in got.items():
            out[keys[key]] = data
            frame = parse_head(data)
            if frame is not None and frame.base is not None:
                bases.append(frame.base)
        wanted = bases
    return out


def _prefetch_packed(store: Store, digests: list[str], out: dict[str, bytes]) -> None:
    """Add to ``out`` the objects of ``digests`` a known pack holds, one read per pack (a
    pack gone since is left out: those objects are then read one by one)."""
    where = {d: w for d in digests if (w := find(store, d, refresh=False)) is not None}
    keys = sorted({pack_key(w.pack) for w in where.values()})
    if not keys:
        return
    try:
        got = store.get_many(keys)
    except FileNotFoundError:
        return
    for digest, w in where.items():
        data = got[pack_key(w.pack)]
        if w.offset + w.size <= len(data):
            out[digest] = bytes(memoryview(data)[w.offset : w.offset + w.size])
