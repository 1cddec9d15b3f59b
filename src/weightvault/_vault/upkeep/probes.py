"""Anchor probes: what the compactor learns of a tensor's objects from frame headers alone.

An object stored as a delta names its base in its frame header. In the anchor layout
(:mod:`.compact`) every base is an *anchor*: a whole object (raw, or a full frame) of
the same tensor in an older checkpoint. These find the anchor a checkpoint's object
should point at, and whether some later checkpoint already points at an object, without
decoding any payload.

Example:
    >>> is_delta(vault.store, digest)
    False
"""

from __future__ import annotations

from typing import Any

from ..objects.address import object_key
from ..objects.frame import Frame
from ..objects.probe import probe
from ..store.backend import Store
from ..store.pack import find
from .records_cache import Records

__all__ = ["anchor_for", "base_of", "has_dependents", "is_delta"]  # and _head


def _head(store: Store, digest: str) -> tuple[int, Frame | None] | None:
    """``(file size, frame header or None for raw bytes)`` of ``digest`` in ``objects/``,
    or ``None`` when it is not there (a gc holds it, or it is gone)."""
    key = object_key(digest)
    size = store.size(key)
    if size is None:
        packed = find(store, digest)
        return None if packed is None else (packed.size, None)  # a pack holds raw bytes
    try:
        return size, probe(store, key)  # a header that does not parse: the decode says why
    except FileNotFoundError:
        return None


def base_of(store: Store, digest: str) -> str | None:
    """The base that object ``digest``'s delta frame names; ``None`` for a whole (raw or
    full) object, or one that is not there."""
    found = _head(store, digest)
    return None if found is None or found[1] is None else found[1].base


def is_delta(store: Store, digest: str) -> bool:
    """Whether ``digest`` is stored as a delta (the newest after its successor was
    deleted: a resume must not decode two objects per tensor)."""
    return base_of(store, digest) is not None


def anchor_for(
    records: Records, index: int, name: str, digest: str, dtype: str, shape: Any, most: int
) -> str | None:
    """The anchor that object ``digest`` of tensor ``name`` in checkpoint ``index`` should
    become a delta on: the whole object that the nearest older checkpoint holding another
    object for the tensor (same dtype and shape) is, or points at.

    ``None`` means ``digest`` stays whole and starts a new anchor: no older checkpoint
    holds the tensor, that one's object is gone, its base is not whole (a chain an older
    version of the compactor left), the anchor is ``digest`` itself (a tensor changed
    back), or ``most`` deltas already hang on the anchor.
    """
    anchor: str | None = None
    deltas: set[str] = set()
    store = records.store
    for older in reversed(records.names[:index]):
        tensors = records.tensors(older)
        entry = tensors.get(name) if tensors else None
        if entry is None or (entry[1], entry[2]) != (dtype, shape):
            break
        seen = entry[0]
        if seen == digest or seen in deltas:
            continue  # the tensor unchanged since then: the same object
        if anchor is not None and seen == anchor:
            break  # the anchor's own checkpoint: its group starts here
        found = _head(store, seen)
        if found is None:
            break
        base = found[1].base if found[1] is not None else None
        if anchor is None:
            anchor = seen if base is None else base
            if anchor == digest:
                return None
            if base is None:
                break
        if base != anchor:
            break  # an object of an older group: the anchor's is behind it
        deltas.add(seen)
    if anchor is None or len(deltas) >= most:
        return None
    if anchor in deltas or base_of(store, anchor) is not None:
        return None
    return anchor if _head(store, anchor) is not None else None


def has_dependents(records: Records, index: int, name: str, digest: str) -> bool:
    """Whether a checkpoint from ``index`` on holds, for tensor ``name``, a delta on
    ``digest``: then ``digest`` is an anchor and stays whole."""
    for later in records.names[index:]:
        tensors = records.tensors(later)
        entry = tensors.get(name) if tensors else None
        if entry is None or entry[0] == digest:
            continue
        if base_of(records.store, entry[0]) == digest:
            return True
    return False
