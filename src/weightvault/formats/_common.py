"""What every foreign-format reader shares: file reads, lazy imports and the checkpoint.

Readers decode a foreign file into :class:`~weightvault._file.sharing.Source` records and hand
them to :func:`build`, which runs the same :func:`~weightvault._file.sharing.plan` as a save. So a
foreign file gets the manifest a save would have written: real sharing (tied storages,
hard links) becomes aliases and views, and equal bytes under different names become
copies, found by content with the one dedup the library has.

The npz, MXNet and Keras h5 readers never map their file: they read it through
:mod:`._lazy`, and :class:`ForeignCheckpoint` reads each array when it is asked for.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from .._base.dtypes import ITEMSIZE, MAX_DIMS, fits_int64, numel
from .._base.errors import BackendNotInstalled, FormatError, WeightvaultError, capped
from .._base.limits import DecodeBudget
from .._file.checkpoint import Checkpoint
from .._file.header import TensorInfo
from .._file.manifest import Manifest
from .._file.sharing import Source

# Lazy and FileReader are re-exported: other readers take them from here.
from ._lazy import FileReader as FileReader, Held, Lazy as Lazy, held, plan_lazily

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


T = TypeVar("T")


def parse_file(
    where: str,
    max_decoded_bytes: int | None,
    fix: str,
    parse: Callable[[str, FileReader, DecodeBudget], T],
) -> T:
    """Open ``where`` for positional reads and ``parse`` it under :func:`decoding`.

    The checkpoint ``parse`` returns owns the file; if parsing fails, it is closed here.
    """
    file = FileReader(where)
    try:
        budget = DecodeBudget(where, file.size, max_decoded_bytes)
        with decoding(where, fix):
            return parse(where, file, budget)
    except BaseException:
        file.close()
        raise


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
    """A read-only map of ``path`` and its size (no map for an empty file).

    Only the ``.keras`` archive's lookup of its weights member still maps (its local
    header); the npz, MXNet and Keras h5 readers read with :class:`FileReader`.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return None, 0
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), size


class ForeignCheckpoint(Checkpoint):
    """A checkpoint decoded from a foreign format.

    Each stored tensor's bytes are in memory (what had to be decoded: densified sparse
    arrays, chunked datasets, byte-swapped arrays), or :class:`Lazy`, read from the file
    when :meth:`raw` or :meth:`read_into` asks for them and never kept.

    Attributes:
        format: The detected format, such as ``"mxnet"`` or ``"torch"``.
    """

    def __init__(
        self,
        path: str,
        arrays: dict[str, tuple[str, tuple[int, ...], Held]],
        manifest: Manifest,
        fmt: str,
        keep: mmap.mmap | None = None,
        file: FileReader | None = None,
    ) -> None:
        self._data: dict[str, memoryview | Lazy] = {}
        stored: dict[str, TensorInfo] = {}
        position = 0
        for name, (dtype, shape, data) in arrays.items():
            held = data if isinstance(data, Lazy) else memoryview(data).cast("B")
            if held.nbytes != nbytes(dtype, shape):
                raise FormatError(
                    f"{path}: tensor {name!r}: {dtype}{list(shape)} needs "
                    f"{nbytes(dtype, shape)} bytes, got {held.nbytes}"
                )
            if name in manifest.aliases or name in manifest.copies or name in manifest.views:
                continue
            self._data[name] = held
            stored[name] = TensorInfo(name, dtype, tuple(shape), position, position + held.nbytes)
            position += held.nbytes
        super().__init__(path, stored, manifest)
        self.format = fmt
        self._map = keep
        self._file = file

    @property
    def framework(self) -> str | None:
        return self.format

    @property
    def container(self) -> str:
        return self.format

    def raw(self, stored: str) -> memoryview:
        held = self._data[stored]
        return held.read() if isinstance(held, Lazy) else held

    def read_into(self, stored: str, buffer: memoryview) -> bool:
        held = self._data[stored]
        if not isinstance(held, Lazy) or buffer.nbytes != held.nbytes or not held.nbytes:
            return False
        held.fill(buffer)
        return True

    def stage(self, stored: list[str], verify: bool) -> None:
        # Every byte reachable without reading it: the file still reaches as far as the
        # arrays read on demand lie (those in memory are there already).
        if verify:
            self.verify(stored)
        lazy = [n for n in stored if isinstance(self._data.get(n), Lazy)]
        if not lazy or self._file is None:
            return
        if self._file.stream.closed:
            raise FormatError(f"{self.path}: the file is closed")
        size = os.fstat(self._file.stream.fileno()).st_size
        short = [n for n in lazy if self._lazy(n).end > size]
        if short:
            raise FormatError(
                f"{self.path}: tensor {short[0]!r}: the file was cut to {size} bytes after "
                f"it was opened ({self._file.size} expected; {capped(short)} lie past its "
                "end); save or copy it again"
            )

    def _lazy(self, stored: str) -> Lazy:
        held = self._data[stored]
        assert isinstance(held, Lazy)
        return held

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        # Views handed out keep the map alive; it then goes when the last of them does.
        for view in self._data.values():
            if isinstance(view, memoryview):
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
    file: FileReader | None = None,
    metadata: dict[str, str] | None = None,
) -> ForeignCheckpoint:
    """Plan ``sources`` as a save would and wrap the result as a checkpoint.

    Args:
        path: The file, for messages.
        sources: Every array in the file's order; equal ``identity`` means one tensor.
            A source whose ``data`` is a :class:`Lazy` is read only when asked for (and
            by the plan, one at a time, to compare it with lookalikes).
        fmt: The format name the checkpoint reports.
        keep: A file map the sources' bytes point into, released by ``close``.
        file: The file the :class:`Lazy` sources read, closed by ``close``.
        metadata: Kept in the manifest.

    Raises:
        FormatError: A name is not valid Unicode, or a shape overflows (see
            :func:`check_tensor`).
    """
    for s in sources:
        check_tensor(path, s.name, s.dtype, s.shape)
    p = plan_lazily(sources)
    manifest = p.manifest(metadata, ours=False)
    arrays = {s.name: (s.dtype, s.shape, held(s.data)) for s in p.stored}
    return ForeignCheckpoint(path, arrays, manifest, fmt, keep, file)


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
    at = info.header_offset
    start = _member_start(info, bytes(buf[at : at + 30]), buf.nbytes, where, what, fix)
    return buf[start : start + info.file_size]


def zip_member_start(
    info: zipfile.ZipInfo, file: FileReader, where: str, what: str, fix: str = ""
) -> int:
    """Where the bytes of zip member ``info`` begin in ``file`` (read, never mapped),
    checked as :func:`stored_zip_member` checks them: its ``compress_size`` bytes (its
    ``file_size`` when it is stored) lie inside the file."""
    at = info.header_offset
    header = file.exact(at, 30, f"the zip local header of {what}") if at + 30 <= file.size else b""
    return _member_start(info, header, file.size, where, what, fix)


def _member_start(
    info: zipfile.ZipInfo, header: bytes, size: int, where: str, what: str, fix: str
) -> int:
    tail = f"; {fix}" if fix else ""
    if len(header) != 30 or header[:4] != ZIP_LOCAL_MAGIC:
        raise FormatError(f"{where}: {what} has no zip local header{tail}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start: int = info.header_offset + 30 + name_len + extra_len
    stored = info.compress_type == zipfile.ZIP_STORED
    if start + (info.file_size if stored else info.compress_size) > size:
        raise FormatError(f"{where}: {what} runs past the end of the file{tail}")
    return start
