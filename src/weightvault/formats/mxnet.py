"""MXNet ``.params`` files (the NDArray list format), read without MXNet.

The format is described in ``seed-systems.md`` §2: a list magic (``0x112``), a reserved
word, the arrays, then the names. Each array is a V2 (storage type) or V3 (numpy shape
semantics) record, or a pre-V2 legacy one (V1 with 64-bit dims, or "v0" whose first word
is the number of dims). Dense data is plain C-order bytes, so an array's bytes are read
only when its tensor is asked for, with ``preadv`` straight into the model's memory; the
file is never mapped, so one cut short meanwhile is a :class:`~weightvault.FormatError`
naming the array (see :mod:`._common`). Sparse arrays (``row_sparse``, ``csr``) are
densified when the file is opened, after their indices are checked.

Every count and size is checked against the bytes left in the file before it is used, so
a crafted file raises :class:`~weightvault.FormatError` at once instead of allocating.
Densified arrays are charged to the file's :class:`~weightvault._base.limits.DecodeBudget`
before they are allocated, so many sparse arrays cannot add up to gigabytes either.
MXNet 2's ``.npz`` files are read by :mod:`weightvault.formats.npz`.
"""

from __future__ import annotations

import os
import struct

from .._base.dtypes import ITEMSIZE, MAX_DIMS, numel
from .._base.errors import FormatError
from .._base.limits import DecodeBudget
from .._base.types import PathLike
from .._file.sharing import Source
from ._common import MXNET_LIST_MAGIC, ForeignCheckpoint, build, parse_file, plain
from ._lazy import FileReader

#: Where an array's bytes lie in the file: offset and length.
Span = tuple[int, int]

V1, V2, V3 = 0xF993FAC8, 0xF993FAC9, 0xF993FACA
#: mshadow type flags -> safetensors dtype names (seed-systems.md §2.4).
DTYPES = {
    0: "F32",
    1: "F64",
    2: "F16",
    3: "U8",
    4: "I32",
    5: "I8",
    6: "I64",
    7: "BOOL",
    8: "I16",
    9: "U16",
    10: "U32",
    11: "U64",
    12: "BF16",
}
STYPES = {0: "default", 1: "row_sparse", 2: "csr"}
#: The smallest array record: a legacy array with no dims and no data (4 bytes).
MIN_ARRAY_BYTES = 4
#: The headers and names are parsed from reads of this many bytes at a time.
WINDOW = 64 << 10

#: Where a Gluon file comes from and how to make it loadable, for messages.
FIX_DAMAGED = "the file is truncated or damaged; re-save it from MXNet or restore a good copy"


class _Cursor:
    """Little-endian reads of a file that fail, naming it, when it runs out.

    Fields are served from a window read ahead (:data:`WINDOW`); arrays' bytes are
    skipped (:meth:`skip`), so parsing reads the headers and names, not the data.
    """

    def __init__(self, file: FileReader, where: str) -> None:
        self.file, self.pos, self.where = file, 0, where
        self.what = "the header"
        self._window, self._at = b"", 0

    @property
    def left(self) -> int:
        return self.file.size - self.pos

    def _check(self, n: int) -> None:
        if n < 0 or n > self.left:
            raise FormatError(
                f"{self.where}: {self.what} needs {n} bytes at offset {self.pos}, but only "
                f"{self.left} remain; {FIX_DAMAGED}"
            )

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.file.size:
            self._check(n)
        lo = self.pos - self._at
        if lo < 0 or lo + n > len(self._window):
            if n > WINDOW:  # a long name: read as it is
                out = self.file.exact(self.pos, n, self.what)
                self.pos += n
                return out
            self._at = self.pos
            self._window = self.file.exact(self.pos, min(WINDOW, self.left), self.what)
            lo = 0
        self.pos += n
        return self._window[lo : lo + n]

    def skip(self, n: int) -> int:
        """Pass over ``n`` bytes of array data; where they start."""
        self._check(n)
        at, self.pos = self.pos, self.pos + n
        return at

    def _unpack(self, fmt: str, n: int) -> int:
        value: int = struct.unpack(fmt, self.take(n))[0]
        return value

    def u32(self) -> int:
        return self._unpack("<I", 4)

    def i32(self) -> int:
        return self._unpack("<i", 4)

    def u64(self) -> int:
        return self._unpack("<Q", 8)

    def i64(self) -> int:
        return self._unpack("<q", 8)


class _Array:
    """One array record: where its bytes are (file offsets), before its name is known."""

    def __init__(
        self,
        index: int,
        stype: int,
        dtype: str,
        shape: tuple[int, ...] | None,
        data: Span,
        aux: list[tuple[str, tuple[int, ...], Span]],
    ) -> None:
        self.index, self.stype, self.dtype, self.shape = index, stype, dtype, shape
        self.data, self.aux = data, aux


def open_mxnet(path: PathLike, *, max_decoded_bytes: int | None = None) -> ForeignCheckpoint:
    """Open an MXNet ``.params`` file as a checkpoint, its arrays named as in the file.

    A dict file keeps its keys (``arg:``/``aux:`` prefixes included; strip them with
    :data:`weightvault.rules.MXNET_PREFIXES`); a list file names its arrays ``arr_0``,
    ``arr_1``, ... as ``numpy.savez`` would. Arrays with equal dtype, shape and bytes
    (Gluon's ``deduplicate=False`` copies of a shared parameter) are recorded as copies.

    Args:
        path: The ``.params`` file.
        max_decoded_bytes: The most bytes sparse arrays may densify to in all; ``None``
            means the default of :mod:`weightvault._base.limits` (or its environment variable).

    Raises:
        FormatError: The file is malformed, or densifying would pass the decode limit;
            the message names the array and the offset.

    Example:
        >>> ckpt = open_mxnet("shared_dense_default.params")
        >>> ckpt.entry("l2.weight").kind
        'copy'
    """
    where = os.fspath(path)
    return parse_file(where, max_decoded_bytes, FIX_DAMAGED, _open)


def _open(where: str, file: FileReader, budget: DecodeBudget) -> ForeignCheckpoint:
    r, size = _Cursor(file, where), file.size
    if size < 24:
        raise FormatError(f"{where}: {size} bytes is too small for an MXNet .params file")
    magic, reserved = r.u64(), r.u64()
    if magic != MXNET_LIST_MAGIC or reserved != 0:
        raise FormatError(
            f"{where}: not an MXNet NDArray file (list magic 0x{magic:x}, expected 0x112); "
            "MXNet 2 .npz files are read as npz"
        )
    count = r.u64()
    if count > r.left // MIN_ARRAY_BYTES:
        raise FormatError(
            f"{where}: the header claims {count} arrays but only {r.left} bytes follow; "
            f"{FIX_DAMAGED}"
        )
    arrays = []
    for i in range(count):
        r.what = f"array #{i}"
        arrays.append(_read_array(r, i))
    names = _names(r, count)
    sources = [_source(file, name, a, budget) for name, a in zip(names, arrays, strict=True)]
    return build(where, sources, "mxnet", file=file)


def _names(r: _Cursor, count: int) -> list[str]:
    """The names after the arrays (``arr_0``, ``arr_1``, ... for a list file), checked."""
    r.what = "the name count"
    n_names = r.u64()
    if n_names not in (0, count):
        raise FormatError(
            f"{r.where}: {count} arrays but {n_names} names (a dict file names every "
            f"array); {FIX_DAMAGED}"
        )
    names: list[str] = []
    for i in range(n_names):
        r.what = f"the name of array #{i}"
        raw = r.take(r.u64())
        try:
            names.append(bytes(raw).decode("utf-8"))
        except UnicodeDecodeError:
            raise FormatError(
                f"{r.where}: the name of array #{i} is not UTF-8 ({bytes(raw[:40])!r}); "
                f"{FIX_DAMAGED}"
            ) from None
    if r.left:
        raise FormatError(
            f"{r.where}: {r.left} unexpected bytes after the last name at offset {r.pos}; "
            f"{FIX_DAMAGED}"
        )
    seen: set[str] = set()
    dupes = [n for n in names if n in seen or seen.add(n)]  # type: ignore[func-returns-value]
    if dupes:
        raise FormatError(f"{r.where}: names appear twice: {dupes[:8]}; {FIX_DAMAGED}")
    return names or [f"arr_{i}" for i in range(count)]


def _source(file: FileReader, name: str, a: _Array, budget: DecodeBudget) -> Source:
    """The save plan's record of one array: its bytes in the file, read when asked for,
    or its densified bytes."""
    where = file.path
    if a.shape is None:
        raise FormatError(
            f"{where}: array {name!r} is an uninitialised ('none') NDArray with no "
            "values; initialise the parameter in MXNet and save again"
        )
    if a.stype == 0:
        return Source(name, a.dtype, a.shape, ("name", name), file.span(*a.data, name))
    # Checked before the dense buffer exists; densifying in MXNet avoids the limit.
    budget.charge(f"sparse ({STYPES[a.stype]}) array {name!r}", numel(a.shape) * ITEMSIZE[a.dtype])
    return plain(name, a.dtype, a.shape, _densify(file, name, a))


def _shape(r: _Cursor) -> tuple[int, ...] | None:
    """A TShape: i32 ndim, then i64 dims; ``None`` for an unknown ("none") shape."""
    ndim = r.i32()
    if ndim < 0:
        return None
    if ndim > MAX_DIMS:
        raise FormatError(
            f"{r.where}: {r.what} claims {ndim} dimensions (at most {MAX_DIMS} are read); "
            f"{FIX_DAMAGED}"
        )
    dims = struct.unpack(f"<{ndim}q", r.take(8 * ndim))
    if any(d < 0 for d in dims):
        return None
    return tuple(dims)


def _payload(r: _Cursor, dtype: str, shape: tuple[int, ...]) -> Span:
    """Pass over an array's bytes; where in the file they lie."""
    # Python ints cannot overflow, so an absurd shape fails this comparison, not malloc.
    n = numel(shape) * ITEMSIZE[dtype]
    if n > r.left:
        raise FormatError(
            f"{r.where}: {r.what} is {dtype}{list(shape)}, {n} bytes, but only {r.left} "
            f"bytes remain; {FIX_DAMAGED}"
        )
    return r.skip(n), n


def _dtype(r: _Cursor) -> str:
    flag = r.i32()
    if flag not in DTYPES:
        raise FormatError(
            f"{r.where}: {r.what} has unknown dtype code {flag} (known: 0-12); {FIX_DAMAGED}"
        )
    return DTYPES[flag]


def _read_array(r: _Cursor, index: int) -> _Array:
    empty = (r.pos, 0)  # a "none" array has no bytes
    magic = r.u32()
    if magic in (V2, V3):
        stype = r.i32()
        if stype not in STYPES:
            raise FormatError(
                f"{r.where}: {r.what} has unknown storage type {stype}; {FIX_DAMAGED}"
            )
        if stype and magic == V3:
            raise FormatError(
                f"{r.where}: {r.what} is sparse in a numpy-semantics (V3) record, "
                f"which MXNet never writes; {FIX_DAMAGED}"
            )
        storage = _shape(r) if stype else None
        shape = _shape(r)
        # A "none" array ends here: V2 marks it with ndim 0, V3 with an unknown dim.
        if shape is None or (magic == V2 and shape == ()):
            return _Array(index, stype, "F32", None, empty, [])
        if stype and storage is None:
            raise FormatError(f"{r.where}: {r.what} has no storage shape; {FIX_DAMAGED}")
        r.i32(), r.i32()  # device type and id: where it lived, irrelevant on disk
        dtype = _dtype(r)
        aux_meta = []
        for _ in range(stype):  # row_sparse has 1 aux array (indices), csr 2
            aux_dtype = _dtype(r)
            aux_shape = _shape(r)
            if aux_shape is None:
                raise FormatError(f"{r.where}: {r.what} has an unknown aux shape; {FIX_DAMAGED}")
            aux_meta.append((aux_dtype, aux_shape))
        data = _payload(r, dtype, storage if stype and storage is not None else shape)
        aux = [(d, s, _payload(r, d, s)) for d, s in aux_meta]
        return _Array(index, stype, dtype, shape, data, aux)
    if magic == V1:
        shape = _shape(r)
    elif magic <= MAX_DIMS:  # pre-V1 ("v0"): the word is ndim, then u32 dims
        shape = struct.unpack(f"<{magic}I", r.take(4 * magic))
    else:
        raise FormatError(
            f"{r.where}: {r.what} starts with unknown magic 0x{magic:08x} (expected "
            f"0xf993fac9 or another NDArray magic); {FIX_DAMAGED}"
        )
    if shape is None or shape == ():
        return _Array(index, 0, "F32", None, empty, [])
    r.i32(), r.i32()
    dtype = _dtype(r)
    return _Array(index, 0, dtype, tuple(shape), _payload(r, dtype, tuple(shape)), [])


def _ints(where: str, name: str, dtype: str, data: memoryview) -> list[int]:
    codes = {"I64": "q", "I32": "i", "U64": "Q", "U32": "I", "I16": "h", "U16": "H"}
    if dtype not in codes:
        raise FormatError(f"{where}: sparse array {name!r} has {dtype} indices; expected ints")
    n = data.nbytes // ITEMSIZE[dtype]
    return list(struct.unpack(f"<{n}{codes[dtype]}", data))


def _densify(file: FileReader, name: str, a: _Array) -> bytearray:
    """The dense C-order bytes of a ``row_sparse`` or ``csr`` array, indices checked.

    Its stored values and indices (charged to the budget through the dense size, which
    they cannot pass) are read here; the dense bytes stay in memory.
    """
    assert a.shape is not None
    where, size = file.path, ITEMSIZE[a.dtype]

    def read(span: Span) -> memoryview:
        return memoryview(file.exact(span[0], span[1], f"sparse array {name!r}"))

    values = read(a.data)
    aux = [(d, s, read(span)) for d, s, span in a.aux]
    out = bytearray(numel(a.shape) * size)
    kind = STYPES[a.stype]

    def bad(why: str) -> FormatError:
        return FormatError(f"{where}: sparse ({kind}) array {name!r}: {why}; {FIX_DAMAGED}")

    if a.stype == 1:
        (idx_dtype, _, idx_data) = aux[0]
        rows = _ints(where, name, idx_dtype, idx_data)
        row = numel(a.shape[1:]) * size
        if not a.shape or len(rows) * row != values.nbytes:
            raise bad(f"{len(rows)} row indices do not match {values.nbytes} bytes of values")
        for k, i in enumerate(rows):
            if not 0 <= i < a.shape[0]:
                raise bad(f"row index {i} is outside [0, {a.shape[0]})")
            out[i * row : (i + 1) * row] = values[k * row : (k + 1) * row]
        return out
    if len(a.shape) != 2:
        raise bad(f"csr needs 2 dimensions, not {list(a.shape)}")
    n_rows, n_cols = a.shape
    indptr = _ints(where, name, aux[0][0], aux[0][2])
    cols = _ints(where, name, aux[1][0], aux[1][2])
    if len(indptr) != n_rows + 1 or len(cols) * size != values.nbytes:
        raise bad(f"{len(indptr)} row pointers and {len(cols)} columns do not fit {n_rows} rows")
    if indptr[0] != 0 or indptr[-1] != len(cols):
        raise bad(f"row pointers run from {indptr[0]} to {indptr[-1]}, not 0 to {len(cols)}")
    # All pointers are checked before any is used, so none can index past the columns.
    for r in range(n_rows):
        if indptr[r] > indptr[r + 1]:
            raise bad(f"row pointers decrease at row {r}")
    for r in range(n_rows):
        for k in range(indptr[r], indptr[r + 1]):
            c = cols[k]
            if not 0 <= c < n_cols:
                raise bad(f"column index {c} is outside [0, {n_cols})")
            at = (r * n_cols + c) * size
            out[at : at + size] = values[k * size : (k + 1) * size]
    return out
