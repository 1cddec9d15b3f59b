"""numpy ``.npz`` / ``.npy`` files, MXNet 2's ``npx.savez`` and ``save_parameters`` included.

The ``.npy`` header is parsed here rather than by ``numpy.load`` so that MXNet's
bfloat16 descriptor ``<b2`` (which numpy rejects) reads as bfloat16, so that pickled
object arrays are refused without touching ``allow_pickle``, and so that an array's bytes
are read only when its tensor is asked for, straight into the model's memory. Each member
``<name>.npy`` becomes the name ``<name>``; a single ``.npy`` is ``arr_0``. Equal arrays
under different names are recorded as copies.

The file is never mapped (see :mod:`._common`): a stored member (``np.savez``, MXNet) is
read with ``preadv``, a deflated one (``np.savez_compressed``) is inflated through
:mod:`zipfile` into the destination, so a load holds at most one array beside the model
and a file cut short meanwhile is a :class:`~weightvault.FormatError` naming the array.
Deflated members are inflated once when the file is opened as well (through a small
window), so a corrupt stream is refused before anything is loaded.

Inflated members and byte-swapped or Fortran-order arrays are decoded memory: each is
charged to the file's :class:`~weightvault._base.limits.DecodeBudget` when the file is
opened, so a deflate bomb is refused however its members add up.

MXNet 2 stores a sparse array as a folder (``w/data.npy``, ``w/indices.npy``,
``w/format.npy``, ...); such arrays are refused with a message naming them.
"""

from __future__ import annotations

import ast
import contextlib
import os
import struct
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

from .._base.dtypes import ITEMSIZE, numel
from .._base.errors import FormatError
from .._base.limits import DecodeBudget
from .._base.types import PathLike
from .._file.sharing import Source
from ._common import (
    NPY_MAGIC,
    ForeignCheckpoint,
    build,
    check_shape,
    need,
    parse_file,
    zip_member_start,
)
from ._lazy import FileReader, Lazy

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
#: The first read of a member's header; numpy's headers are 128 bytes or a few more.
HEAD_READ = 4096
#: A member is inflated this many bytes at a time (into the destination, or only to
#: check it): 1 MiB windows made a deflated load peak at 6 MiB beside the model, not 4.
CHECK_WINDOW = 256 << 10
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
    return parse_file(where, max_decoded_bytes, FIX, _open)


def _open(where: str, file: FileReader, budget: DecodeBudget) -> ForeignCheckpoint:
    if file.size >= len(NPY_MAGIC) and file.exact(0, 6, "the magic") == NPY_MAGIC:
        whole = _Stored(file, 0, file.size)
        return build(where, [_array(where, "arr_0", whole, budget)], "numpy", file=file)
    sources: list[Source] = []
    try:
        z = zipfile.ZipFile(file.stream)  # the reader's own descriptor, not a second open
    except zipfile.BadZipFile as e:
        raise FormatError(f"{where}: not a valid npz (zip) archive ({e}); {FIX}") from None
    deflated: list[_Deflated] = []
    # Never closed here: the deflated members inflate through it when asked for (a
    # ZipFile given a file object leaves it open; the checkpoint closes the file).
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
            raise FormatError(f"{where}: member {info.filename[:100]!r} is not a .npy array; {FIX}")
        name = info.filename[: -len(".npy")]
        if name in names:
            raise FormatError(f"{where}: array {name!r} appears twice; {FIX}")
        names.add(name)
        member = _member(z, info, file, where, name, budget)
        if isinstance(member, _Deflated):
            deflated.append(member)
        sources.append(_array(where, name, member, budget))
    ckpt = build(where, sources, "numpy", file=file)
    # The plan inflated those it compared with lookalikes; the rest are inflated here,
    # so that a corrupt stream is refused now, not halfway through a load.
    for member in deflated:
        member.check()
    return ckpt


class _Stored:
    """A member stored as it is (``np.savez``): ``size`` bytes at ``offset``."""

    def __init__(self, file: FileReader, offset: int, size: int) -> None:
        self.file, self.offset, self.size = file, offset, size

    def head(self, n: int, name: str) -> bytes:
        return self.file.exact(self.offset, min(n, self.size), f"the header of array {name!r}")

    def body(self, start: int, n: int, name: str) -> Lazy:
        return self.file.span(self.offset + start, n, name)


class _Deflated:
    """A deflated member (``np.savez_compressed``), inflated through :mod:`zipfile`
    whenever its bytes are asked for: never held whole by the reader."""

    def __init__(
        self, z: zipfile.ZipFile, info: zipfile.ZipInfo, where: str, name: str, end: int
    ) -> None:
        self.z, self.info, self.where, self.name, self.end = z, info, where, name, end
        self.size = info.file_size
        #: Whether the whole stream was inflated once and its CRC matched.
        self.checked = False

    def head(self, n: int, name: str) -> bytes:
        with _inflating(self.where, self.name), self.z.open(self.info) as f:
            data: bytes = f.read(min(n, self.size))
            return data

    def body(self, start: int, n: int, name: str) -> Lazy:
        return Lazy(n, lambda buffer: self._inflate(start, buffer), self.end)

    def check(self) -> None:
        """Inflate the whole member through a small window, checking its size and CRC."""
        if not self.checked:
            self._inflate(0, None)

    def _inflate(self, start: int, buffer: memoryview | None) -> None:
        """Inflate the member, writing its bytes from ``start`` on into ``buffer``
        (``None``: only check them), a window at a time."""
        out = buffer.cast("B") if buffer is not None else None
        with _inflating(self.where, self.name), self.z.open(self.info) as f:
            skip = start - len(f.read(start))  # the .npy header: at most 64 kB
            done, total = 0, self.size - start
            while done < total:
                chunk = f.read(min(CHECK_WINDOW, total - done))
                if not chunk:
                    break
                if out is not None:
                    out[done : done + len(chunk)] = chunk
                done += len(chunk)
            # Reading past the end checks the CRC and that the stream holds no more.
            if skip or done != total or f.read(1):
                raise FormatError(
                    f"{self.where}: array {self.name!r} is not the size its zip entry records"
                )
        self.checked = True  # read to its end: the size and the CRC matched


@contextlib.contextmanager
def _inflating(where: str, name: str) -> Iterator[None]:
    """Turn what :mod:`zipfile` and :mod:`zlib` raise on a damaged stream, or one cut
    short, into a :class:`FormatError` naming the file and the array."""
    try:
        yield
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as e:
        raise FormatError(f"{where}: array {name!r} cannot be inflated ({e}); {FIX}") from None


def _member(
    z: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    file: FileReader,
    where: str,
    name: str,
    budget: DecodeBudget,
) -> _Stored | _Deflated:
    if info.compress_type == zipfile.ZIP_STORED:
        start = zip_member_start(info, file, where, f"array {name!r}", FIX)
        return _Stored(file, start, info.file_size)
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
    start = zip_member_start(info, file, where, f"array {name!r}", FIX)
    return _Deflated(z, info, where, name, start + info.compress_size)


def parse_header(head: bytes, size: int, where: str, name: str) -> tuple[dict[str, Any], int]:
    """The ``.npy`` header dict and the offset of the data.

    Args:
        head: The member's first bytes: at least its whole header, or all of a member
            of ``size`` bytes that is shorter than :func:`header_end` says.
        size: The member's length.

    Raises:
        FormatError: The magic, version, length or dict is malformed.
    """
    start, length = _header_bounds(head, size, where, name)
    text = head[start : start + length].decode("utf-8" if head[6] == 3 else "latin-1")
    try:
        doc = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
        doc = None
    if not isinstance(doc, dict) or not {"descr", "fortran_order", "shape"} <= set(doc):
        raise FormatError(
            f"{where}: array {name!r} has a malformed .npy header {text[:80]!r}; {FIX}"
        )
    return doc, start + length


def header_end(head: bytes, size: int, where: str, name: str) -> int:
    """Where the header that ``head`` (a member's first bytes) opens ends, checked to be
    at most :data:`MAX_HEADER_BYTES` long and inside the member of ``size`` bytes."""
    start, length = _header_bounds(head, size, where, name)
    return start + length


def _header_bounds(head: bytes, size: int, where: str, name: str) -> tuple[int, int]:
    if head[:6] != NPY_MAGIC or len(head) < 10:
        raise FormatError(f"{where}: array {name!r} is not a .npy array (bad magic); {FIX}")
    major = head[6]
    if major == 1:
        (length,), start = struct.unpack("<H", head[8:10]), 10
    elif major in (2, 3) and len(head) >= 12:
        (length,), start = struct.unpack("<I", head[8:12]), 12
    else:
        raise FormatError(f"{where}: array {name!r} has unknown .npy version {major}; {FIX}")
    if length > MAX_HEADER_BYTES or start + length > size:
        raise FormatError(
            f"{where}: array {name!r} has a {length}-byte header in a {size}-byte member; {FIX}"
        )
    return start, length


def _array(where: str, name: str, member: _Stored | _Deflated, budget: DecodeBudget) -> Source:
    head = member.head(HEAD_READ, name)
    end = header_end(head, member.size, where, name)
    if end > len(head):
        head = member.head(end, name)
    doc, start = parse_header(head, member.size, where, name)
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
    if member.size - start != n:
        raise FormatError(
            f"{where}: array {name!r} is {dtype}{list(shape)}, {n} bytes, but the member "
            f"holds {member.size - start}; {FIX}"
        )
    data = member.body(start, n, name)
    swap = descr[0] == ">" and ITEMSIZE[dtype] > 1
    if swap or fortran is True:
        budget.charge(f"array {name!r} (byte-swapped or Fortran-order copy)", n)
        data = _normalised(data, dtype, shape, swap, fortran is True)
    return Source(name, dtype, shape, ("name", name), data)


def _normalised(raw: Lazy, dtype: str, shape: tuple[int, ...], swap: bool, fortran: bool) -> Lazy:
    """The array of ``raw`` as little-endian, C-order bytes, made when asked for."""

    def fill(buffer: memoryview) -> None:
        buffer.cast("B")[:] = _normalise(raw.read(), dtype, shape, swap, fortran)

    return Lazy(raw.nbytes, fill, raw.end)


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
