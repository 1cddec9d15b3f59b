"""The frame-header probe: what an object's file holds, from its first bytes only.

A frame's fixed header (:data:`~.frame.HEADER_SIZE` bytes) says whether an object is
compressed or a delta, on which base, and how many raw bytes it holds, without its
block table or payload. Gc (which keeps every base a frame names), the compactor, a
transfer and a writer asking what the store holds already all ask this; a read of the
object itself checks the header fully instead (:func:`~.chain.chain`).

Example:
    >>> parse_head(b"not a frame") is None
    True
"""

from __future__ import annotations

from ..._base.errors import FormatError
from ..store.backend import Store
from .address import search_order
from .frame import HEADER_SIZE, Frame, is_frame, parse_frame_header

__all__ = ["object_frame", "object_size", "parse_head", "probe"]


def parse_head(head: bytes | memoryview) -> Frame | None:
    """The frame header that ``head`` (a file's first bytes, or all of them) starts with,
    or ``None`` for raw bytes or a header that does not parse (the full read says why)."""
    if not is_frame(head):
        return None
    try:
        return parse_frame_header(memoryview(head))
    except FormatError:
        return None


def probe(store: Store, key: str) -> Frame | None:
    """The frame header of the file at ``key`` (:func:`parse_head` of its first bytes).

    Raises:
        FileNotFoundError: Nothing is at ``key``.
    """
    return parse_head(store.get_range(key, 0, HEADER_SIZE))


def object_frame(store: Store, digest: str) -> Frame | None:
    """The frame header of object ``digest`` (its block table unread), or ``None`` if the
    object is raw bytes, absent, or its header does not parse (the full read says why)."""
    for key, packed in search_order(store, digest):
        if packed is not None:
            return None  # a pack holds raw bytes only
        try:
            return probe(store, key)
        except FileNotFoundError:
            continue
    return None


def object_size(store: Store, digest: str, nbytes: int | None = None) -> int | None:
    """The raw size of object ``digest`` wherever a gc may hold it, or ``None`` if gone.

    A file of exactly ``nbytes`` (the size the record expects) is raw bytes; any other
    is asked for its frame header.
    """
    for key, packed in search_order(store, digest):
        if packed is not None:
            if store.size(key) is None:
                continue
            return packed.size  # a pack holds raw bytes only
        size = store.size(key)
        if size is None:
            continue
        if size == nbytes or size < HEADER_SIZE:
            return size
        frame = object_frame(store, digest)
        return frame.raw_size if frame is not None else size
    return None
