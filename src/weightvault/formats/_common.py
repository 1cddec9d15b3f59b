"""What every foreign-format reader shares: file maps, lazy imports and the checkpoint.

Readers decode a foreign file into :class:`~weightvault._file.sharing.Source` records and hand
them to :func:`build`, which runs the same :func:`~weightvault._file.sharing.plan` as a save. So a
foreign file gets the manifest a save would have written: real sharing (tied storages,
hard links) becomes aliases and views, and equal bytes under different names become
copies, found by content with the one dedup the library has.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from .._base.dtypes import ITEMSIZE, MAX_DIMS, fits_int64, numel
from .._base.errors import BackendNotInstalled, FormatError, WeightvaultError
from .._file.checkpoint import MemoryCheckpoint
from .._file.manifest import Manifest
from .._file.sharing import Source, plan

#: First bytes of the containers the readers share with the sniffing in :mod:`._registry`.
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
NPY_MAGIC = b"\x93NUMPY"
ZIP_LOCAL_MAGIC = b"PK\x03\x04"
#: An empty zip archive opens with its end-of-directory record instead.
ZIP_MAGICS = (ZIP_LOCAL_MAGIC, b"PK\x05\x06")
#: An MXNet NDArray list opens with this u64, then a reserved u64 ``0``.
MXNET_LIST_MAGIC = 0x112

#: The pip command that installs what the readers need.
PIP_FORMATS = "pip install 'weightvault[formats]'"
#: What the libraries a reader calls (zipfile, zlib, struct, pickle, h5py, torch) raise on
#: a damaged file; :func:`decoding` turns each into a FormatError naming the file.
DAMAGE = (
    ValueError,
    TypeError,
    LookupError,
    struct.error,
    zlib.error,
    zipfile.BadZipFile,
    EOFError,
    NotImplementedError,
    OverflowError,
    RecursionError,
    MemoryError,
    RuntimeError,
    OSError,
)


@contextlib.contextmanager
def decoding(where: str, fix: str) -> Iterator[None]:
    """Turn what a damaged file makes a library raise into a :class:`FormatError`.

    Wraps the decoding of a file that is already open, so a missing or unreadable path
    still raises its own ``OSError`` before this is entered. Our own errors pass through.
    """
    try:
        yield
    except WeightvaultError:
        raise
    except DAMAGE as e:
        detail = str(e).splitlines()[0][:120] if str(e) else ""
        raise FormatError(
            f"{where}: cannot be decoded ({type(e).__name__}: {detail}); {fix}"
        ) from None


def need(module: str, what: str) -> Any:
    """Import ``module`` or raise :class:`BackendNotInstalled` naming the extra.

    Example:
        >>> h5py = need("h5py", "reading Keras .weights.h5 files")
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendNotInstalled(f"{what} needs {module}: {PIP_FORMATS}") from e


def map_file(path: str) -> tuple[mmap.mmap | None, int]:
    """A read-only map of ``path`` and its size (no map for an empty file)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return None, 0
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), size


class ForeignCheckpoint(MemoryCheckpoint):
    """A checkpoint decoded from a foreign format, its bytes in memory or in a file map.

    Attributes:
        format: The detected format, such as ``"mxnet"`` or ``"torch"``.
    """

    def __init__(
        self,
        path: str,
        arrays: dict[str, tuple[str, tuple[int, ...], memoryview | bytes]],
        manifest: Manifest,
        fmt: str,
        keep: mmap.mmap | None = None,
    ) -> None:
        super().__init__(path, arrays, manifest)
        self.format = fmt
        self._map = keep

    @property
    def framework(self) -> str | None:
        return self.format

    @property
    def container(self) -> str:
        return self.format

    def close(self) -> None:
        # Views handed out keep the map alive; it then goes when the last of them does.
        for view in self._data.values():
            with contextlib.suppress(BufferError, ValueError):
                view.release()
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()


def build(
    path: str,
    sources: Sequence[Source],
    fmt: str,
    *,
    keep: mmap.mmap | None = None,
    metadata: dict[str, str] | None = None,
) -> ForeignCheckpoint:
    """Plan ``sources`` as a save would and wrap the result as a checkpoint.

    Args:
        path: The file, for messages.
        sources: Every array in the file's order; equal ``identity`` means one tensor.
        fmt: The format name the checkpoint reports.
        keep: A file map the sources' bytes point into, released by ``close``.
        metadata: Kept in the manifest.

    Raises:
        FormatError: A name is not valid Unicode, or a shape overflows (see
            :func:`check_tensor`).
    """
    for s in sources:
        check_tensor(path, s.name, s.dtype, s.shape)
    p = plan(sources)
    manifest = p.manifest(metadata, ours=False)
    arrays: dict[str, tuple[str, tuple[int, ...], memoryview | bytes]] = {
        s.name: (s.dtype, s.shape, s.data()) for s in p.stored
    }
    return ForeignCheckpoint(path, arrays, manifest, fmt, keep)


def plain(
    name: str, dtype: str, shape: tuple[int, ...], data: memoryview | bytes | bytearray
) -> Source:
    """A source that shares nothing with any other; only equal bytes can make it a copy."""
    view = memoryview(data)
    return Source(name, dtype, shape, ("name", name), lambda: view)


def check_shape(where: str, name: str, shape: Any) -> tuple[int, ...]:
    """Validate a shape from a file: a short sequence of non-negative ints.

    Raises:
        FormatError: Naming the file and the array.
    """
    if not isinstance(shape, tuple | list) or len(shape) > MAX_DIMS:
        raise FormatError(
            f"{where}: array {name!r} has a malformed shape {str(shape)[:80]}; "
            "the file is damaged or was not written by a supported framework"
        )
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise FormatError(
                f"{where}: array {name!r} has an invalid dimension {str(d)[:40]} in "
                f"shape {str(list(shape))[:80]}; the file is damaged"
            )
    return tuple(shape)


def check_tensor(where: str, name: str, dtype: str, shape: tuple[int, ...]) -> None:
    """Refuse a name that cannot be written as UTF-8 and a shape that overflows int64.

    A lone surrogate (which pickle, HDF5 and zip names can carry) would fail only when
    the name is written; a zero-size shape such as ``(0, 2**62, 2**62)`` holds no bytes
    but makes numpy and torch overflow computing its strides.

    Raises:
        FormatError: Naming the file and the array.
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise FormatError(
            f"{where}: array {name[:80]!r} has a name that is not valid Unicode (a lone "
            "surrogate); the file is damaged, or rename the array and save it again"
        ) from None
    if not fits_int64(shape, ITEMSIZE[dtype]):
        raise FormatError(
            f"{where}: array {name[:80]!r} has shape {str(list(shape))[:80]}, whose extent "
            f"overflows 64 bits even though it may hold no elements; the file is damaged"
        )


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return numel(shape) * ITEMSIZE[dtype]


def strided(
    buf: memoryview, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...], offset: int
) -> memoryview:
    """C-contiguous bytes of the strided tensor at byte ``offset`` of ``buf`` (needs numpy).

    Callers validate that every element lies inside ``buf`` first.
    """
    np = need("numpy", "reading a strided tensor")
    size = ITEMSIZE[dtype]
    if numel(shape) == 0:
        return memoryview(b"")
    # Any dtype of the right width moves the bytes; numpy need not know bfloat16.
    raw = buf.cast("B")
    flat = np.frombuffer(raw[: raw.nbytes - raw.nbytes % size], dtype=f"u{size}")
    base = flat[offset // size :] if offset % size == 0 else None
    if base is None:
        raise FormatError(f"tensor at byte offset {offset} is not aligned to {size} bytes")
    arr = np.lib.stride_tricks.as_strided(
        base, shape=shape, strides=tuple(s * size for s in stride), writeable=False
    )
    out: memoryview = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    return out


def stored_zip_member(
    info: zipfile.ZipInfo, buf: memoryview, where: str, what: str, fix: str = ""
) -> memoryview:
    """The bytes of an uncompressed zip member, as a slice of the mapped file ``buf``.

    The local header is read from ``buf`` itself and every offset checked, so a crafted
    archive can point nowhere outside the file. ``what`` names the member in messages,
    which end with ``fix`` when one is given.
    """
    tail = f"; {fix}" if fix else ""
    at = info.header_offset
    header = bytes(buf[at : at + 30])
    if len(header) != 30 or header[:4] != ZIP_LOCAL_MAGIC:
        raise FormatError(f"{where}: {what} has no zip local header{tail}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = at + 30 + name_len + extra_len
    if start + info.file_size > buf.nbytes:
        raise FormatError(f"{where}: {what} runs past the end of the file{tail}")
    return buf[start : start + info.file_size]
