"""Ranged reads of chunk objects straight into the tensors a load fills.

A load asks, per destination, for a box of a stored chunk. Where the box is one run of
the chunk's bytes and the destination is a contiguous CPU tensor, the bytes are read
into the destination's own memory: ``preadv`` from a local file, or the one copy from an
object store's response. Any other box is read as the run that covers it into a buffer
no larger than the chunk, then copied into place. So a load holds at most one chunk's
bytes beyond the tensors it fills.

Example:
    >>> span((4, 3), (1, 0), (2, 3), 4)
    Span(start=12, end=36, strides=(3, 1), contiguous=True)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._base.dtypes import ITEMSIZE, numel
from .._base.errors import FormatError
from .._file.checkpoint import read_fully
from .._torch.tensors import DTYPES
from .._vault.objects.address import content_hash, locations
from .._vault.objects.frame import HEADER_SIZE, is_frame
from .._vault.objects.read import read_range
from .._vault.records.dcp_layout import Chunk
from .._vault.store.backend import Store

__all__ = ["Span", "host_bytes", "read_box", "read_into", "span"]


@dataclass(frozen=True)
class Span:
    """The bytes of a chunk that cover a box: ``[start, end)``, and the chunk's strides."""

    start: int
    end: int
    strides: tuple[int, ...]
    contiguous: bool


def span(sizes: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], item: int) -> Span:
    """The run of a row-major chunk of ``sizes`` that covers box ``offsets + [0, lengths)``."""
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
    count = last + 1 - first
    return Span(first * item, (last + 1) * item, tuple(strides), count == numel(tuple(lengths)))


def host_bytes(t: torch.Tensor) -> memoryview | None:
    """The writable bytes of ``t`` if it is one contiguous run of CPU memory, else ``None``."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    flat = t.detach().reshape(-1)
    if flat.numel() == 0 or flat.stride() != (1,):
        return None
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def read_into(store: Store, digest: str, start: int, out: memoryview, name: str) -> None:
    """Bytes ``[start, start + len(out))`` of object ``digest``, read into ``out``.

    The object is looked for wherever a gc may hold it (:func:`locations`).

    Raises:
        FileNotFoundError: The object is nowhere.
        FormatError: It is shorter than the range.
    """
    for key in locations(store, digest):
        path = store.local_path(key)
        if path is None:
            try:
                if is_frame(store.get_range(key, 0, HEADER_SIZE)):
                    # A compressed (or delta) object: its range is decoded from its blocks.
                    out[:] = read_range(store, digest, start, start + out.nbytes)
                    return
                data = store.get_range(key, start, start + out.nbytes)
            except FileNotFoundError:
                continue
            if len(data) != out.nbytes:
                raise FormatError(
                    f"{store.url}/{key}: tensor {name!r}: the object ended before its bytes did"
                )
            out[:] = data  # the response is the one copy
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            # The frame check reads the already-open file: no second open per chunk read.
            if is_frame(os.pread(fd, HEADER_SIZE, 0)):
                out[:] = read_range(store, digest, start, start + out.nbytes)
            else:
                read_fully(fd, out, start, f"{store.url}/{key}", name)
        finally:
            os.close(fd)
        return
    # Not loose anywhere: a pack may hold it (a save's small objects, see _vault.store.pack).
    data = read_range(store, digest, start, start + out.nbytes)
    if len(data) != out.nbytes:
        raise FormatError(f"{store.url}: tensor {name!r}: the object ended before its bytes did")
    out[:] = data


def read_box(
    store: Store,
    name: str,
    dtype: str,
    chunk: Chunk,
    offsets: Sequence[int],
    lengths: Sequence[int],
    dst: torch.Tensor,
) -> int:
    """Fill ``dst`` with box ``offsets + [0, lengths)`` of ``chunk``; return bytes read.

    A whole-object read is checked against the object's name.

    Raises:
        FileNotFoundError: The object is nowhere.
        FormatError: The object is short, or corrupt.
    """
    item = ITEMSIZE[dtype]
    s = span(chunk.sizes, offsets, lengths, item)
    # Straight into dst only where its memory is the run itself: same dtype, one run.
    direct = s.contiguous and dst.dtype == DTYPES[dtype] and dst.numel() == numel(tuple(lengths))
    out = host_bytes(dst) if direct else None
    buf: Any = None
    if out is None or out.nbytes != s.end - s.start:
        buf = torch.empty(s.end - s.start, dtype=torch.uint8)
        out = memoryview(buf.numpy()).cast("B")
    read_into(store, chunk.digest, s.start, out, name)
    if s.start == 0 and s.end == chunk.nbytes(dtype) and content_hash(out) != chunk.digest:
        raise FormatError(
            f"{store.url}: tensor {name!r}: object {chunk.digest[:12]} is corrupt (hash "
            "mismatch); run 'weightvault vault ROOT verify'"
        )
    if buf is not None:
        src = buf.view(DTYPES[dtype]).as_strided(tuple(lengths), s.strides, 0)
        dst.copy_(src)
    return s.end - s.start
