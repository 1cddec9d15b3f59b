"""Chain probes: what the compactor learns of an object from its frame header alone.

An object stored as a delta names its base in its frame header; these follow those
names without decoding any payload.

Example:
    >>> is_delta(vault.store, digest)
    False
"""

from __future__ import annotations

from typing import Any

from ..._base.errors import FormatError
from ..objects.address import object_key
from ..objects.frame import HEADER_SIZE, is_frame, parse_frame_header
from ..store.backend import Store
from ..store.pack import find
from .records_cache import Records

__all__ = ["is_delta", "run_behind"]  # and _head, _links_to, _depth, kept as they were


def _head(store: Store, digest: str) -> tuple[int, Any] | None:
    """``(file size, frame header or None for raw bytes)`` of ``digest`` in ``objects/``,
    or ``None`` when it is not there (a gc holds it, or it is gone)."""
    key = object_key(digest)
    size = store.size(key)
    if size is None:
        packed = find(store, digest)
        return None if packed is None else (packed.size, None)  # a pack holds raw bytes
    try:
        head = store.get_range(key, 0, HEADER_SIZE)
    except FileNotFoundError:
        return None
    if not is_frame(head):
        return size, None
    try:
        return size, parse_frame_header(memoryview(head))
    except FormatError:
        return size, None  # decoding it below says what is wrong


def run_behind(
    records: Records, index: int, name: str, digest: str, dtype: str, shape: Any, limit: int
) -> int:
    """How many deltas already hang behind object ``digest`` of tensor ``name``, counted
    back from checkpoint ``index`` (each older object whose chain of frames reaches the
    next), up to ``limit``. A chain may pass through objects no record names any more
    (a checkpoint deleted in the middle keeps its objects as bases): they count too."""
    run, newer = 0, digest
    for older in reversed(records.names[:index]):
        tensors = records.tensors(older)
        entry = tensors.get(name) if tensors else None
        if entry is None or (entry[1], entry[2]) != (dtype, shape):
            return run
        if entry[0] == newer:
            continue
        links = _links_to(records.store, entry[0], newer, limit - run)
        if links is None:
            return run
        run += links
        if run >= limit:
            return run
        newer = entry[0]
    return run


def _links_to(store: Store, digest: str, target: str, most: int) -> int | None:
    """The number of delta frames from ``digest`` to ``target`` following bases; ``None``
    if the chain ends (a full or raw object) first. Past ``most`` links the count stops
    there: the caller only compares it with its limit."""
    links = 0
    while links < max(most, 1) + 1:
        found = _head(store, digest)
        if found is None or found[1] is None or found[1].base is None:
            return None
        links += 1
        if found[1].base == target:
            return links
        digest = found[1].base
    return links


def _depth(store: Store, digest: str, avoid: str, most: int) -> int | None:
    """The delta links from ``digest`` to the full (or raw) object its chain ends at;
    ``None`` if the chain passes through ``avoid``, is longer than ``most``, or breaks."""
    links = 0
    while True:
        if digest == avoid:
            return None
        found = _head(store, digest)
        if found is None:
            return None
        if found[1] is None or found[1].base is None:
            return links
        links += 1
        if links > most:
            return None
        digest = found[1].base


def is_delta(store: Store, digest: str) -> bool:
    """Whether ``digest`` is stored as a delta (the newest after its successor was
    deleted: a resume must not decode a chain)."""
    found = _head(store, digest)
    return found is not None and found[1] is not None and found[1].base is not None
