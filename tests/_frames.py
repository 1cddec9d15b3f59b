"""Hand-edited object frames for tests: reseal what a test forges on purpose, so that the
frame's block sums and its seal pass and the check under test (a field, a block, a chain)
is reached. A crafted hostile file carries sums that fit: they guard against rot, not
against an attacker, so every field must still be checked behind them."""

from __future__ import annotations

import struct
from pathlib import Path

import xxhash

from weightvault._vault.objects.frame import HEADER_SIZE, SEAL_SIZE


def reseal_frame(data: bytearray, *, blocks: bool = True) -> None:
    """Make ``data`` (a frame's bytes, edited) carry the sums of what it now holds, in
    place: each block's sum (``blocks``, versions 2 and 3) and the seal (version 3). A
    header whose block table no longer fits the file is left as it is."""
    version = data[8]
    raw, block = struct.unpack_from("<QQ", data, 16)
    if not block:
        return
    n = -(-raw // block)
    end = HEADER_SIZE + (8 if version == 1 else 16) * n + (SEAL_SIZE if version >= 3 else 0)
    if end > len(data):
        return
    if blocks and version >= 2:
        offset = end
        for i in range(n):
            (length,) = struct.unpack_from("<Q", data, HEADER_SIZE + 16 * i)
            block_sum = xxhash.xxh3_64_intdigest(bytes(data[offset : offset + length]))
            struct.pack_into("<Q", data, HEADER_SIZE + 16 * i + 8, block_sum)
            offset += length
    if version >= 3:
        struct.pack_into("<Q", data, end - 8, xxhash.xxh3_64_intdigest(bytes(data[: end - 8])))


def reseal_file(path: Path, *, blocks: bool = True) -> None:
    """:func:`reseal_frame` on the frame in ``path``, written back by rename (a reader
    of the old file keeps reading it whole)."""
    data = bytearray(path.read_bytes())
    reseal_frame(data, blocks=blocks)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(bytes(data))
    tmp.replace(path)
