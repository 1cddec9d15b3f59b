"""numpy ``.npz`` / ``.npy`` files, MXNet 2's ``npx.savez`` and ``save_parameters`` included.

The ``.npy`` header is parsed here rather than by ``numpy.load`` so that MXNet's
bfloat16 descriptor ``<b2`` (which numpy rejects) reads as bfloat16, so that pickled
object arrays are refused without touching ``allow_pickle``, and so that uncompressed
members (``np.savez``, MXNet) are handed out as slices of a file map instead of copies.
Each member ``<name>.npy`` becomes the name ``<name>``; a single ``.npy`` is ``arr_0``.
Equal arrays under different names are recorded as copies.

Inflated members and byte-swapped or Fortran-order arrays are new memory: each is charged
to the file's :class:`~weightvault._base.limits.DecodeBudget` before it is allocated, so a
deflate bomb is refused however its members add up.

MXNet 2 stores a sparse array as a folder (``w/data.npy``, ``w/indices.npy``,
``w/format.npy``, ...); such arrays are refused with a message naming them.
"""

from __future__ import annotations

import ast
import mmap
import os
import struct
import zipfile
import zlib
from typing import Any

from .._base.dtypes import ITEMSIZE, numel
from .._base.errors import FormatError
from .._base.limits import DecodeBudget
from .._base.types import PathLike
from .._file.sharing import Source
from ._common import (
    ForeignCheckpoint,
    build,
    check_shape,
    decoding,
    map_file,
    need,
    plain,
    stored_zip_member,
)

#: ``.npy`` dtype descriptors (without the byte-order mark) -> safetensors dtype names.
DESCRS = {
    "f2": "F16",
    "f4": "F32",
    "f8": "F64",
    "i1": "I8",
    "i2": "I16",
    "i4": "I32",
    "i8": "I64",
    "u1": "U8",
    "u2": "U16",
    "u4": "U32",
    "u8": "U64",
    "b1": "BOOL",
    "c8": "C64",
    "b2": "BF16",  # MXNet 2's bfloat16; numpy itself cannot parse it
}
#: numpy's own loader refuses headers over 10 kB by default; we allow more, not unbounded.
MAX_HEADER_BYTES = 1 << 16
#: Deflate cannot compress better than about 1032:1; a member claiming more is a bomb.
MAX_DEFLATE_RATIO = 1100
SPARSE_PARTS = frozenset({"data.npy", "indices.npy", "indptr.npy", "shape.npy", "format.npy"})
FIX = "the file is truncated or damaged; save it again with numpy.savez"


def open_npz(path: PathLike, *, max_decoded_bytes: int | None = None) -> ForeignCheckpoint:
    """Open a ``.npz`` archive or a single ``.npy`` file as a checkpoint.

    Args:
        path: The ``.npz`` or ``.npy`` file.
        max_decoded_bytes: The most bytes inflating and byte-swapping may allocate in all;
            ``None`` means the default of :mod:`weightvault._base.limits`.

    Raises:
        FormatError: An array is malformed, pickled (``dtype=object``), of an unsupported
            dtype, or sparse, or decoding would pass the limit; the message names it.

    Example:
        >>> import numpy as np
        >>> np.savez("w.npz", a=np.ones(3), b=np.ones(3))
        >>> open_npz("w.npz").entry("b").kind
        'copy'
    """
    where = os.fspath(path)
    mm, size = map_file(where)
    budget = DecodeBudget(where, size, max_decoded_bytes)
    with decoding(where, FIX):
        return _open(where, mm, budget)


def _open(where: str, mm: mmap.mmap | None, budget: DecodeBudget) -> ForeignCheckpoint:
    buf = memoryview(mm) if mm is not None else memoryview(b"")
    if bytes(buf[:6]) == b"\x93NUMPY":
        return build(where, [_array(where, "arr_0", buf, budget)], "numpy", keep=mm)
    sources: list[Source] = []
    try:
        z = zipfile.ZipFile(where)
    except zipfile.BadZipFile as e:
        raise FormatError(f"{where}: not a valid npz (zip) archive ({e}); {FIX}") from None
    with z:
        infos = [i for i in z.infolist() if not i.is_dir()]
        files = {i.filename for i in infos}
        for info in infos:
            folder, _, base = info.filename.rpartition("/")
            if folder and base in SPARSE_PARTS and f"{folder}/format.npy" in files:
                raise FormatError(
                    f"{where}: array {folder!r} is sparse (MXNet stores it as a folder of "
                    "data/indices/format); densify it in MXNet (arr.tostype('default')) "
                    "and save again"
                )
        names: set[str] = set()
        for info in infos:
            if not info.filename.endswith(".npy"):
                raise FormatError(
                    f"{where}: member {info.filename[:100]!r} is not a .npy array; {FIX}"
                )
            name = info.filename[: -len(".npy")]
            if name in names:
                raise FormatError(f"{where}: array {name!r} appears twice; {FIX}")
            names.add(name)
            raw = _member(z, info, buf, where, name, budget)
            sources.append(_array(where, name, raw, budget))
    return build(where, sources, "numpy", keep=mm)


def _member(
    z: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    buf: memoryview,
    where: str,
    name: str,
    budget: DecodeBudget,
) -> memoryview:
    if info.compress_type == zipfile.ZIP_STORED:
        return stored_zip_member(info, buf, where, f"array {name!r}", FIX)
    if info.compress_type != zipfile.ZIP_DEFLATED:
        # bzip2 and lzma compress far better than deflate, so the ratio check below would
        # not hold for them; numpy never writes them.
        raise FormatError(
            f"{where}: array {name!r} uses zip compression method {info.compress_type}, "
            "which numpy never writes; save it again with numpy.savez"
        )
    # np.savez_compressed: inflate, but only as much as the archive can honestly hold.
    if info.file_size > MAX_DEFLATE_RATIO * max(info.compress_size, 1) + (1 << 20):
        raise FormatError(
            f"{where}: array {name!r} claims {info.file_size} bytes from "
            f"{info.compress_size} compressed; {FIX}"
        )
    # Each member passes the ratio check alone; the budget bounds what they add up to.
    budget.charge(f"array {name!r} (inflated)", info.file_size)
    try:
        with z.open(info) as f:
            data = f.read(info.file_size + 1)
    except (
        zipfile.BadZipFile,
        OSError,
        EOFError,
        ValueError,
        zlib.error,
    ) as e:
        raise FormatError(f"{where}: array {name!r} cannot be inflated ({e}); {FIX}") from None
    if len(data) != info.file_size:
        raise FormatError(f"{where}: array {name!r} is not the size its zip entry records")
    return memoryview(data)


def parse_header(raw: memoryview, where: str, name: str) -> tuple[dict[str, Any], int]:
    """The ``.npy`` header dict and the offset of the data.

    Raises:
        FormatError: The magic, version, length or dict is malformed.
    """
    head = bytes(raw[:12])
    if head[:6] != b"\x93NUMPY" or len(head) < 10:
        raise FormatError(f"{where}: array {name!r} is not a .npy array (bad magic); {FIX}")
    major = head[6]
    if major == 1:
        (length,), start = struct.unpack("<H", head[8:10]), 10
    elif major in (2, 3) and len(head) == 12:
        (length,), start = struct.unpack("<I", head[8:12]), 12
    else:
        raise FormatError(f"{where}: array {name!r} has unknown .npy version {major}; {FIX}")
    if length > MAX_HEADER_BYTES or start + length > raw.nbytes:
        raise FormatError(
            f"{where}: array {name!r} has a {length}-byte header in a "
            f"{raw.nbytes}-byte member; {FIX}"
        )
    text = bytes(raw[start : start + length]).decode("utf-8" if major == 3 else "latin-1")
    try:
        doc = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        doc = None
    if not isinstance(doc, dict) or not {"descr", "fortran_order", "shape"} <= set(doc):
        raise FormatError(
            f"{where}: array {name!r} has a malformed .npy header {text[:80]!r}; {FIX}"
        )
    return doc, start + length


def _array(where: str, name: str, raw: memoryview, budget: DecodeBudget) -> Source:
    doc, start = parse_header(raw, where, name)
    descr, fortran = doc["descr"], doc["fortran_order"]
    shape = check_shape(where, name, doc["shape"])
    if not isinstance(descr, str) or descr[1:] not in DESCRS or descr[0] not in "<>|=":
        raise FormatError(
            f"{where}: array {name!r} has dtype {str(descr)[:60]!r}, which safetensors "
            "cannot store (object arrays are never unpickled); convert it to a numeric "
            "dtype and save again"
        )
    dtype = DESCRS[descr[1:]]
    n = numel(shape) * ITEMSIZE[dtype]
    if raw.nbytes - start != n:
        raise FormatError(
            f"{where}: array {name!r} is {dtype}{list(shape)}, {n} bytes, but the member "
            f"holds {raw.nbytes - start}; {FIX}"
        )
    data = raw[start:]
    swap = descr[0] == ">" and ITEMSIZE[dtype] > 1
    if swap or fortran is True:
        budget.charge(f"array {name!r} (byte-swapped or Fortran-order copy)", n)
        data = _normalise(data, dtype, shape, swap, fortran is True)
    return plain(name, dtype, shape, data)


def _normalise(
    data: memoryview, dtype: str, shape: tuple[int, ...], swap: bool, fortran: bool
) -> memoryview:
    """Little-endian, C-order bytes of a big-endian or Fortran-order array (a copy)."""
    np = need("numpy", "reading a big-endian or Fortran-order .npy array")
    size = ITEMSIZE[dtype]
    arr = np.frombuffer(data, dtype=f"{'>' if swap else '<'}u{size}" if size > 1 else "u1")
    arr = arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)
    out = np.ascontiguousarray(arr, dtype=f"<u{size}" if size > 1 else "u1")
    return memoryview(out.reshape(-1).view(np.uint8))
