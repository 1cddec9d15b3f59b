"""The object frame: how a vault object that is not a tensor's raw bytes says what it is.

An object file under ``objects/`` is either the tensor's raw bytes (every object a save
writes, every object written before frames existed, a full object under
:data:`~.delta.SMALL`, and any object compression did not shrink) or a frame::

    offset  size  field
    0       8     magic  b"\\x89WVO\\r\\n\\x1a\\n"
    8       1     frame version (3; versions 1 and 2 are still read)
    9       1     codec id (0 stored, 1 blosc2: byte planes + zstd, 2 pcodec: a
                  delta's words as unsigned integers; see .codec)
    10      1     item size: the byte planes each block was split into (1 to 255)
    11      1     kind: 0 a full object; a delta otherwise, whose payload is the
                  transform of :mod:`.transforms` with this id applied to raw and base
                  (1 XOR, 2 zigzag integer difference of item-size words)
    12      2     depth: 0 for a full object; a delta's chain depth when it was written
                  (version 1: exactly its base's plus one; version 2: a hint, since the
                  compactor later turns a delta's full base into a delta itself)
    14      2     reserved, 0
    16      8     raw size: the bytes the object stands for (its name is their blake3)
    24      8     block size: raw bytes per block (the last block may be shorter)
    32      32    base: the blake3 digest of the delta's base object (zeros if full)
    64      e*n   the block table, one entry per block of the n = ceil(raw / block):
                  version 1 (e = 8): the block's compressed length; versions 2 and 3
                  (e = 16): its compressed length, then the xxh3-64 of its compressed
                  bytes
    64+e*n  16    version 3 only, the seal: the xxh3-64 of the base object's raw bytes
                  (0 for a full object), then the xxh3-64 of every byte before this
                  field (the header, the block table and the base's sum)
    ...           the blocks, in order

All integers are little-endian. The object is still named by the blake3 of its RAW
bytes, so deduplication and ``verify`` do not depend on how it is stored. A frame is
never exactly as long as its raw bytes (a compressed frame is kept only when shorter,
a stored one is longer by its header), so a reader that knows the tensor's size tells a
raw object from a frame by its length; one that does not (a ranged DCP read) goes by the
magic, which raw bytes starting with it never are (they are written as a stored frame).

The block sums of version 2 let a load check a compressed object by reading it, without
decoding it a second time (:func:`blocks_intact`): a frame is written only from raw bytes
whose blake3 matched the object's name, so blocks that are the bytes written decode to
the right tensor. Version 3 seals the header and block table too (a damaged header is
refused when the frame is parsed, before any block is decoded into a tensor), and
records the sum of a delta's base, so that a delta on a raw anchor is checked by reading
the anchor once (:func:`raw_intact`) and decoded once, straight into the tensor.

Everything here is bytes in, bytes out; :mod:`.objects` reads frames from a store and
follows delta chains. Errors here say what is wrong with the frame; the readers add
which object and which tensor.

Example:
    >>> from weightvault._vault.objects.codec import CODECS
    >>> parts = encode_frame(memoryview(bytes(1 << 16)), 4, CODECS["blosc2"])
    >>> frame = parse_frame(memoryview(b"".join(parts)), 1 << 16)
    >>> (frame.raw_size, frame.depth, frame.base)
    (65536, 0, None)
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from ..._base.errors import FormatError
from ..._file.checkpoint import HASH_WINDOW
from .codec import BLOCK, READABLE, Codec, codec_pool, compress_block, decompress_block
from .transforms import KINDS, apply_delta

__all__ = [
    "HEADER_SIZE",
    "MAGIC",
    "MAX_DEPTH",
    "SEAL_SIZE",
    "VERSION",
    "VERSIONS",
    "Frame",
    "blocks_intact",
    "decode_into",
    "decode_range",
    "drop_buffers",
    "encode_frame",
    "is_frame",
    "parse_frame",
    "parse_frame_header",
    "raw_intact",
    "table_size",
]

MAGIC = b"\x89WVO\r\n\x1a\n"
VERSION = 3
#: Frame versions this code reads; version 1 has no block sums and strict depths, and
#: versions 1 and 2 no seal.
VERSIONS = (1, 2, 3)
#: Bytes of a version 3 frame's seal (the base's sum, then the header's).
SEAL_SIZE = 16
_HEADER = struct.Struct("<8sBBBBHHQQ32s")
HEADER_SIZE = _HEADER.size  # 64
#: The longest delta chain a reader follows; writers keep far shorter ones (see .delta).
MAX_DEPTH = 64
#: Blocks smaller than this (or over 1 GiB) mark a frame no writer made.
_MIN_BLOCK, _MAX_BLOCK = 1 << 12, 1 << 30
#: Below this many raw bytes an object is (de)compressed on the calling thread.
_INLINE = 1 << 20

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Frame:
    """A parsed frame header and block table."""

    codec: int
    itemsize: int
    kind: int
    depth: int
    raw_size: int
    block_size: int
    base: str | None
    lengths: tuple[int, ...]
    version: int = VERSION
    #: The xxh3-64 of each compressed block (version 2; empty for version 1).
    sums: tuple[int, ...] = ()
    #: The xxh3-64 of a delta's base object's raw bytes (version 3; else ``None``).
    base_sum: int | None = None

    @property
    def table_end(self) -> int:
        """Where the first block starts: after the header, the block table and the seal."""
        return _table_end(self.version, len(self.lengths))

    def block(self, i: int) -> tuple[int, int, int]:
        """Block ``i``'s ``(raw start, raw length, file offset)``."""
        start = i * self.block_size
        offset = self.table_end + sum(self.lengths[:i])
        return start, min(self.block_size, self.raw_size - start), offset


def _entry(version: int) -> int:
    """Bytes of one block-table entry in a frame of ``version``."""
    return 8 if version == 1 else 16


def _table_end(version: int, blocks: int) -> int:
    """Where the first of ``blocks`` blocks starts in a frame of ``version``."""
    return HEADER_SIZE + _entry(version) * blocks + (SEAL_SIZE if version >= 3 else 0)


def is_frame(data: bytes | memoryview) -> bool:
    """Whether ``data`` starts like a frame."""
    return bytes(data[: len(MAGIC)]) == MAGIC


def encode_frame(
    raw: memoryview,
    itemsize: int,
    codec: Codec,
    *,
    base: str | None = None,
    kind: int = 0,
    depth: int = 0,
    base_sum: int = 0,
    compressed: bytes | memoryview | None = None,
) -> list[bytes | memoryview]:
    """The frame of ``raw`` (already a delta against its base, for one), as parts to join.

    Args:
        raw: The bytes to store (for a delta, :func:`~.diff.make_delta`'s output).
        itemsize: Bytes per element, the byte planes blocks are split into.
        codec: How to compress each block.
        base: The base object's digest, for a delta.
        kind: The delta's transform (:mod:`.transforms`), for a delta.
        depth: The chain depth, for a delta (its base's plus one).
        base_sum: The xxh3-64 of the base's raw bytes, for a delta.
        compressed: ``raw``'s one block, already compressed with ``codec`` by the caller
            (``raw`` must then be non-empty and no longer than a block).
    """
    raw = raw.cast("B")
    planes = itemsize if 0 < itemsize < 256 and raw.nbytes % itemsize == 0 else 1
    spans = [(i, min(i + BLOCK, raw.nbytes)) for i in range(0, raw.nbytes, BLOCK)]
    if compressed is not None:
        assert len(spans) == 1, "an already compressed frame is one block"
        blocks = [compressed]
    else:
        compress = lambda s: compress_block(codec, raw[s[0] : s[1]], planes)  # noqa: E731
        blocks = _map(compress, spans, raw.nbytes)
    header = _HEADER.pack(
        MAGIC, VERSION, codec.id, planes, kind if base else 0, depth, 0,
        raw.nbytes, BLOCK, bytes.fromhex(base) if base else bytes(32),
    )  # fmt: skip
    entries = [v for b in blocks for v in (len(b), xxhash.xxh3_64_intdigest(b))]
    head = header + struct.pack(f"<{len(entries)}Q", *entries)
    head += struct.pack("<Q", base_sum if base else 0)
    head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    return [head, *blocks]


def _fields(data: memoryview) -> tuple[int, ...]:
    try:
        magic, version, codec, planes, kind, depth, _, raw, block, base = _HEADER.unpack_from(data)
    except struct.error:
        raise FormatError(
            f"the object is {data.nbytes} bytes, shorter than a frame header"
        ) from None
    if magic != MAGIC:
        raise FormatError("the object is not a frame (bad magic)")
    if version not in VERSIONS:
        raise FormatError(f"unknown object frame version {version}; upgrade weightvault")
    if codec not in READABLE:
        raise FormatError(f"unknown codec id {codec}; upgrade weightvault")
    if kind != 0 and kind not in KINDS:
        raise FormatError(f"unknown delta kind {kind}; upgrade weightvault")
    delta = kind != 0
    if planes == 0 or delta != (depth > 0) or depth > MAX_DEPTH:
        raise FormatError(f"inconsistent frame header (kind {kind}, depth {depth})")
    if delta == (base == bytes(32)) or not _MIN_BLOCK <= block <= _MAX_BLOCK:
        raise FormatError("inconsistent frame header (base or block size)")
    based = int.from_bytes(base, "big") if delta else -1
    return codec, planes, kind, depth, raw, block, based, version


def parse_frame_header(data: memoryview) -> Frame:
    """The fixed header of a frame (``lengths`` left empty), for gc and size checks.

    Raises:
        FormatError: The header is inconsistent or of an unknown version.
    """
    codec, planes, kind, depth, raw, block, base, version = _fields(data.cast("B"))
    digest = f"{base:064x}" if base >= 0 else None
    return Frame(codec, planes, kind, depth, raw, block, digest, (), version)


def parse_frame(data: memoryview, expected: int | None, size: int | None = None) -> Frame:
    """The frame at the start of ``data``, every field checked.

    Args:
        data: The object file's bytes, or a prefix of them that holds at least the header
            and the block table (then ``size`` gives the file's length).
        expected: The raw size the checkpoint record gives, if known.
        size: The whole file's length, when ``data`` is only its prefix.

    Raises:
        FormatError: Anything is inconsistent: a raw size other than ``expected``, a block
            table longer than the file, block lengths that do not add up to the file's
            length (truncated or padded), an unknown version or codec.
    """
    data = data.cast("B")
    size = data.nbytes if size is None else size
    codec, planes, kind, depth, raw, block, base, version = _fields(data)
    if expected is not None and raw != expected:
        raise FormatError(f"the frame claims {raw} raw bytes, the record says {expected}")
    n = -(-raw // block)
    entry = _entry(version)
    end = _table_end(version, n)
    if end > min(size, data.nbytes):
        raise FormatError(f"the frame's block table ({n} blocks) runs past its end (truncated)")
    table = struct.unpack_from(f"<{n * entry // 8}Q", data, HEADER_SIZE)
    lengths, sums = (table, ()) if version == 1 else (table[0::2], table[1::2])
    base_sum = None
    if version >= 3:
        base_sum, seal = struct.unpack_from("<QQ", data, end - SEAL_SIZE)
        if xxhash.xxh3_64_intdigest(data[: end - 8]) != seal:
            raise FormatError("the frame's header or block table does not match its seal (damaged)")
        if base < 0:
            base_sum = None  # a full object has no base
    total = end + sum(lengths)
    if total != size:
        raise FormatError(
            f"the frame's blocks add up to {total} bytes, the object holds {size} "
            "(truncated or padded)"
        )
    digest = f"{base:064x}" if base >= 0 else None
    return Frame(
        codec, planes, kind, depth, raw, block, digest, tuple(lengths), version, sums, base_sum
    )


def table_size(head: memoryview) -> int:
    """Bytes of a frame's header and block table, from its header (for a ranged read).

    Raises:
        FormatError: The header is inconsistent or of an unknown version.
    """
    _, _, _, _, raw, block, _, version = _fields(head.cast("B"))
    return _table_end(version, -(-raw // block))


#: Reads ``length`` bytes of a frame's file at ``offset`` (a slice, or a ``pread``).
Read = Callable[[int, int], "bytes | memoryview"]
#: Fills a buffer from a frame's file at ``offset``, or raises FormatError if it ends first.
ReadInto = Callable[[int, memoryview], None]


def decode_into(data: memoryview, frame: Frame, out: memoryview, start: int) -> None:
    """Decode bytes ``[start, start + len(out))`` of ``frame`` (whose file is ``data``)
    into ``out``: :func:`decode_range` over a file already in memory."""
    data = data.cast("B")
    decode_range(lambda offset, n: data[offset : offset + n], frame, out, start)


def decode_range(
    read: Read,
    frame: Frame,
    out: memoryview,
    start: int,
    *,
    parallel: bool = True,
    read_into: ReadInto | None = None,
) -> None:
    """Decode bytes ``[start, start + len(out))`` of ``frame`` into ``out``.

    Each block's bytes come from ``read`` (a slice of a mapping, or one ``pread`` of the
    file), so nothing beyond the blocks being decoded is read or held. For a delta,
    ``out`` holds the base's bytes and the decoded delta is applied to them
    (:func:`~.diff.apply_delta`); the range must then start and end on whole items. Only
    the blocks that cover the range are decoded, on all cores for large ranges unless
    ``parallel`` is false; a block that covers its part of the range whole is decoded
    straight into ``out``, any other into a block-sized buffer of a shared pool. With
    ``read_into`` (a ``preadv`` of the file), compressed blocks are read into a few
    buffers of one size that the call reuses: reading each into a new ``bytes`` of its
    own length left the allocator's heaps of every thread holding freed blocks it could
    not reuse, several MiB of RSS beside a streaming load (docs/benchmarks-log.md, 10).

    Raises:
        FormatError: A block does not decode to its recorded size.
    """
    out = out.cast("B")
    end = start + out.nbytes
    if not 0 <= start <= end <= frame.raw_size:
        raise FormatError(f"bytes [{start}, {end}) lie outside the object's {frame.raw_size}")
    first, last = start // frame.block_size, -(-end // frame.block_size)
    offsets = [frame.table_end]
    for length in frame.lengths[: max(0, last - 1)]:
        offsets.append(offsets[-1] + length)
    wanted = [i for i in range(first, last) if i * frame.block_size < frame.raw_size]

    def one(i: int) -> None:
        if read_into is None:
            src: bytes | memoryview = read(offsets[i], frame.lengths[i])
            if len(src) != frame.lengths[i]:
                raise FormatError("the object ended inside a block (truncated while read)")
            _one(i, src)
            return
        buffer = _BUFFERS.take(frame.lengths[i])
        try:
            with memoryview(buffer)[: frame.lengths[i]] as src:
                read_into(offsets[i], src)
                _one(i, src, private=True)
        finally:
            _BUFFERS.give(buffer)

    def _one(i: int, src: bytes | memoryview, *, private: bool = False) -> None:
        b_start = i * frame.block_size
        length = min(frame.block_size, frame.raw_size - b_start)
        lo, hi = max(start, b_start), min(end, b_start + length)
        target = out[lo - start : hi - start]
        # ``src`` goes on as it came: bytes from a pread are not copied again to decode.
        if not frame.kind and (lo, hi) == (b_start, b_start + length):
            _decompress(frame, src, target, private)
            return
        # Scratch from the pool: a new bytearray is zeroed, and fresh memory faulted in
        # page by page, for every delta block a load applies.
        scratch = _BUFFERS.take(length)
        try:
            block = memoryview(scratch)[:length]
            _decompress(frame, src, block, private)
            part = block[lo - b_start : hi - b_start]
            if frame.kind:
                apply_delta(target, part, frame.kind, frame.itemsize)
            else:
                target[:] = part
        finally:
            _BUFFERS.give(scratch)

    if parallel:
        _map(one, wanted, out.nbytes)
    else:
        for i in wanted:
            one(i)


def blocks_intact(read_into: ReadInto | None, read: Read, frame: Frame) -> bool | None:
    """Whether every compressed block of ``frame`` holds the bytes its table's sum says
    (``None`` for a version 1 frame, which has no sums: decode it to check it).

    One read of the file, no decoding; ``read_into`` (a ``preadv``) reads through a
    cache-sized window (:data:`HASH_WINDOW`), else ``read`` slices.
    """
    if frame.version == 1:
        return None
    offset = frame.table_end
    buffer = _BUFFERS.take(HASH_WINDOW) if read_into is not None else None
    try:
        for length, expected in zip(frame.lengths, frame.sums, strict=True):
            if buffer is None:
                src: bytes | memoryview = read(offset, length)
                ok = len(src) == length and xxhash.xxh3_64_intdigest(src) == expected
            else:
                assert read_into is not None
                h = xxhash.xxh3_64()
                with memoryview(buffer) as window:
                    for lo in range(0, length, HASH_WINDOW):
                        part = window[: min(HASH_WINDOW, length - lo)]
                        try:
                            read_into(offset + lo, part)
                        except FormatError:
                            return False
                        h.update(part)
                ok = h.intdigest() == expected
            if not ok:
                return False
            offset += length
        return True
    finally:
        if buffer is not None:
            _BUFFERS.give(buffer)


def raw_intact(read_into: ReadInto, size: int, expected: int) -> bool:
    """Whether the ``size`` raw bytes that ``read_into`` reads (a delta's raw base) have
    the xxh3-64 ``expected`` that the delta's version 3 frame records for its base.

    One read through a cache-sized window (:data:`HASH_WINDOW`), hashed while cached.
    """
    buffer = _BUFFERS.take(HASH_WINDOW)
    try:
        h = xxhash.xxh3_64()
        with memoryview(buffer) as window:
            for lo in range(0, size, HASH_WINDOW):
                part = window[: min(HASH_WINDOW, size - lo)]
                try:
                    read_into(lo, part)
                except FormatError:
                    return False
                h.update(part)
        return h.intdigest() == expected
    finally:
        _BUFFERS.give(buffer)


class _Buffers:
    """Buffers that compressed blocks are read into, shared by every decoding thread.

    All are one size (a block and a little more) unless a larger block comes, so a
    freed one always fits the next read; :func:`drop_buffers` frees them all.
    """

    def __init__(self) -> None:
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> Any:
        """A buffer of at least ``n`` bytes (a numpy array: a bytearray would be zeroed
        first, several MiB of writes per load that a read overwrites anyway)."""
        with self._lock:
            for k, b in enumerate(self._free):
                if len(b) >= n:
                    return self._free.pop(k)
        import numpy as np  # not at import: `import weightvault` stays numpy-free

        return np.empty(max(n, BLOCK + 1024), np.uint8)

    def give(self, buffer: Any) -> None:
        with self._lock:
            self._free.append(buffer)

    def drop(self) -> None:
        with self._lock:
            self._free.clear()


_BUFFERS = _Buffers()


def drop_buffers() -> None:
    """Free the buffers decoding keeps for reading compressed blocks (after a load)."""
    _BUFFERS.drop()


def _decompress(frame: Frame, src: bytes | memoryview, out: memoryview, private: bool) -> None:
    try:
        decompress_block(frame.codec, src, out, frame.itemsize, private=private)
    except ValueError as e:
        raise FormatError(str(e)) from None


def _map(fn: Callable[[T], R], items: Sequence[T], nbytes: int) -> list[R]:
    """``fn`` over ``items``: in this thread when small, else on the codec threads."""
    if nbytes < _INLINE or len(items) < 2:
        return [fn(i) for i in items]
    futures = [codec_pool().submit(fn, i) for i in items]
    try:
        return [f.result() for f in futures]
    finally:
        wait(futures)
