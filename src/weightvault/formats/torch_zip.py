"""The ``torch.save`` zip format read without running its pickle: ``data.pkl`` and storages.

A ``torch.save`` zip holds ``<name>/data.pkl`` (the object, its tensors as references
to storages) and one stored member ``<name>/data/<key>`` per storage. The restricted
unpickler here rebuilds tensors as :class:`StandIn` records that say where in a storage
their elements lie, every bound checked against the zip's directory: ``find_class``
returns local stand-ins for the globals :mod:`.pickle_scan` allows, and nothing else.
Unpickling reads no storage; :func:`read_storages` then reads each storage a named
tensor needs once, with ``preadv`` into memory of its own, so a file cut short meanwhile
is a :class:`FormatError` naming the file and the tensor, never the ``SIGBUS`` that
touching a mapping of it would raise.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import re
import zipfile
from collections.abc import Callable, Hashable
from typing import Any, cast

from .._base.dtypes import ITEMSIZE, contiguous, numel, span
from .._base.errors import FormatError
from .._base.limits import DecodeBudget
from .._file.checkpoint import new_buffer, read_fully
from .._file.sharing import Source
from ._common import Lazy, need, stored_zip_member, strided
from .pickle_scan import ALLOWED, STORAGES, TORCH_DTYPES

#: data.pkl holds structure, not tensor bytes; anything larger is not a weights file.
MAX_PICKLE_BYTES = 1 << 30


def zip_member(z: zipfile.ZipFile, name: str) -> zipfile.ZipInfo | None:
    """The member ``name``, or ``None`` when the archive has none."""
    try:
        return z.getinfo(name)
    except KeyError:
        return None


def zip_pickle(
    z: zipfile.ZipFile, where: str, budget: DecodeBudget | None = None
) -> tuple[str, bytes]:
    """The archive prefix and the bytes of ``<prefix>/data.pkl`` (charged to ``budget``).

    Raises:
        FormatError: The archive holds no single ``data.pkl`` of a sane size, or its
            tensors were saved big-endian.
    """
    pkls = [i for i in z.infolist() if re.fullmatch(r"[^/]+/data\.pkl", i.filename)]
    if len(pkls) != 1:
        raise FormatError(
            f"{where}: a torch zip file holds one <name>/data.pkl, this one {len(pkls)}; "
            "the file is damaged or was not written by torch.save"
        )
    info = pkls[0]
    if info.file_size > MAX_PICKLE_BYTES:
        raise FormatError(f"{where}: data.pkl claims {info.file_size} bytes; the file is damaged")
    prefix = info.filename.rsplit("/", 1)[0]
    if budget is not None:
        budget.charge("data.pkl", info.file_size)
    with z.open(info) as f:
        data = f.read(info.file_size + 1)
    if len(data) != info.file_size:
        raise FormatError(f"{where}: data.pkl is not the size its zip entry records")
    order = zip_member(z, f"{prefix}/byteorder")
    if order is not None and _head(z, order) not in (b"little", b""):
        raise FormatError(
            f"{where}: tensors were saved big-endian; load the file with torch on a "
            "big-endian machine and save it again"
        )
    return prefix, data


def _head(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """The first 16 bytes of a member; a compressed member is never inflated further."""
    with z.open(info) as f:
        return f.read(16)


# The stand-ins ``find_class`` returns for the allowed globals.


class _DType:
    def __init__(self, name: str) -> None:
        self.name = name


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _Storage:
    """A storage of the file: its zip entry, and once read, the bytes its tensors use."""

    def __init__(self, key: str, dtype: str, nbytes: int, info: zipfile.ZipInfo) -> None:
        self.key, self.dtype, self.nbytes, self.info = key, dtype, nbytes, info
        #: Bytes ``[lo, lo + data.nbytes)`` of the storage, set by :func:`read_storages`.
        self.data = memoryview(b"")
        self.lo = 0


class StandIn:
    """A tensor of the file, as the place of its elements in a storage."""

    def __init__(
        self,
        storage: _Storage,
        offset: int,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: str,
    ) -> None:
        self.storage, self.offset, self.shape = storage, offset, shape
        self.stride, self.dtype = stride, dtype
        self.frozen = False
        #: torch's lazy conjugate and negative bits (``metadata`` of the rebuild): the
        #: values are the stored ones conjugated or negated.
        self.conj = self.neg = False


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > 64:
        raise FormatError(f"malformed tensor {what} {str(value)[:60]}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise FormatError(f"malformed tensor {what} {str(value)[:60]}")
    return tuple(value)


#: Dtypes whose negation flips one sign bit (of each part, for complex), by part width.
SIGNED = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "C64": 4}


def _flags(t: StandIn, metadata: Any) -> StandIn:
    """Set ``t``'s conjugate and negative bits from a rebuild's ``metadata``."""
    if not metadata:
        return t
    if not isinstance(metadata, dict) or not set(metadata) <= {"conj", "neg"}:
        raise FormatError(f"unknown tensor metadata {str(metadata)[:80]}")
    t.conj, t.neg = metadata.get("conj") is True, metadata.get("neg") is True
    if (t.neg and t.dtype not in SIGNED) or (t.conj and t.dtype != "C64"):
        raise FormatError(f"a {t.dtype} tensor cannot be stored conjugated or negated")
    return t


def _rebuild(
    storage: Any, offset: Any, size: Any, stride: Any, dtype: str | None = None
) -> StandIn:
    if not isinstance(storage, _Storage):
        raise FormatError("a tensor's storage is not a storage record")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise FormatError(f"malformed storage offset {str(offset)[:40]}")
    shape, strides = _ints(size, "shape"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise FormatError(f"shape {list(shape)} and stride {list(strides)} differ in length")
    t = StandIn(storage, offset, shape, strides, dtype or storage.dtype)
    end = offset * ITEMSIZE[t.dtype] + span(t.dtype, shape, strides)
    if numel(shape) and end > storage.nbytes:
        raise FormatError(
            f"tensor {t.dtype}{list(shape)} reads bytes up to {end} of storage "
            f"{storage.key!r}, which has {storage.nbytes}"
        )
    return t


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any) -> StandIn:
    return _rebuild(storage, offset, size, stride)


def _rebuild_tensor_v2(
    storage: Any, offset: Any, size: Any, stride: Any, *rest: Any, **__: Any
) -> StandIn:
    # rest: requires_grad, backward_hooks and, since torch 1.13, metadata.
    metadata = rest[2] if len(rest) > 2 else None
    return _flags(_rebuild(storage, offset, size, stride), metadata)


def _rebuild_tensor_v3(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    *rest: Any,
) -> StandIn:
    if not isinstance(dtype, _DType):
        raise FormatError("a tensor's dtype is not a torch dtype")
    return _flags(_rebuild(storage, offset, size, stride, dtype.name), rest[0] if rest else None)


def _rebuild_parameter(data: Any, requires_grad: Any, *_: Any) -> StandIn:
    if not isinstance(data, StandIn):
        raise FormatError("a Parameter does not hold a tensor")
    data.frozen = requires_grad is False
    return data


REBUILD = {
    "_rebuild_tensor": _rebuild_tensor,
    "_rebuild_tensor_v2": _rebuild_tensor_v2,
    "_rebuild_tensor_v3": _rebuild_tensor_v3,
    "_rebuild_parameter": _rebuild_parameter,
    "_rebuild_parameter_with_state": _rebuild_parameter,
}


class _Unpickler(pickle.Unpickler):
    """Unpickles only the allowed globals, each as a local stand-in; storages as records."""

    def __init__(self, data: bytes, storages: Callable[[str, str, int], _Storage]) -> None:
        super().__init__(io.BytesIO(data))
        self._storages = storages

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified not in ALLOWED:  # scan() refused it already; this is a second lock
            raise FormatError(f"refused global {qualified!r}")
        if qualified == "collections.OrderedDict":
            return collections.OrderedDict
        if module == "torch._utils":
            return REBUILD[name]
        if name in STORAGES:
            return _StorageType(STORAGES[name])
        if name == "UntypedStorage":
            return _StorageType("U8")
        return _DType(TORCH_DTYPES[name])

    def persistent_load(self, pid: Any) -> Any:
        ok = isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")
        if not ok or not isinstance(pid[1], _StorageType):
            raise FormatError(f"unknown persistent id {str(pid)[:80]}")
        _, stype, key, _, count = pid
        if not isinstance(key, str) or not isinstance(count, int) or count < 0:
            raise FormatError(f"malformed storage record {str(pid)[:80]}")
        return self._storages(key, stype.dtype, count)


def unpickle_zip(z: zipfile.ZipFile, prefix: str, data: bytes, where: str) -> Any:
    """The object ``data`` (the zip's ``data.pkl``) pickles, its tensors as stand-ins.

    Call it only after :func:`~.pickle_scan.scan` has passed ``data``. Nothing but the
    zip's directory is consulted: every tensor is checked to lie inside its storage, and
    every storage inside its entry, before :func:`read_storages` reads a byte of one.

    Raises:
        FormatError: A storage is missing, compressed or too short, or the pickle is
            malformed.
    """
    cache: dict[str, _Storage] = {}

    def storage(key: str, dtype: str, count: int) -> _Storage:
        if key in cache:
            return cache[key]
        info = zip_member(z, f"{prefix}/data/{key}")
        if info is None:
            raise FormatError(f"storage {key!r} is missing from the archive")
        if info.compress_type != zipfile.ZIP_STORED:
            raise FormatError(
                f"storage {info.filename!r} is compressed, which torch.save never does; the "
                "file was repacked, so load it with torch and save it again"
            )
        if info.file_size < count * ITEMSIZE[dtype]:
            raise FormatError(
                f"storage {key!r} holds {info.file_size} bytes, not {count} x {dtype}"
            )
        cache[key] = _Storage(key, dtype, count * ITEMSIZE[dtype], info)
        return cache[key]

    try:
        return _Unpickler(data, storage).load()
    except FormatError as e:
        raise FormatError(f"{where}: {e}; the file is damaged") from None
    except Exception as e:
        raise FormatError(
            f"{where}: the pickle is malformed ({type(e).__name__}: {str(e)[:120]}); "
            "the file is damaged"
        ) from None


#: Storage bytes before a storage's first used byte that are read anyway, so every
#: tensor's place in the bytes read stays aligned to its element size.
ALIGN = 16


def read_storages(fd: int, where: str, tensors: dict[str, StandIn]) -> None:
    """Read, once, the bytes of every storage that a tensor of ``tensors`` reads.

    Each storage's used range (from its first tensor's first byte to its last tensor's
    last byte) is read with ``preadv`` into new memory, which the checkpoint's tensors
    then slice: one copy from the file, and nothing of a storage that no tensor reads.
    The entry's local header is read and checked first.

    Raises:
        FormatError: Naming the file and the first tensor of a storage whose entry has
            no local header, runs past the end of the file, or is cut short while read.
    """
    users: dict[int, tuple[str, _Storage, int, int]] = {}
    for name, t in tensors.items():
        if numel(t.shape) == 0:
            continue  # reads no byte of its storage
        s = t.storage
        start = t.offset * ITEMSIZE[t.dtype]
        end = start + span(t.dtype, t.shape, t.stride)
        first, _, lo, hi = users.get(id(s), (name, s, start, end))
        users[id(s)] = (first, s, min(lo, start), max(hi, end))
    file = FileSpan(fd, 0, os.fstat(fd).st_size)
    # In the file's order: the reads then move forwards through it.
    for name, s, lo, hi in sorted(users.values(), key=lambda u: u[1].info.header_offset):
        what = f"tensor {name!r} (zip entry {s.info.filename!r})"
        entry = stored_zip_member(s.info, cast(memoryview, file), where, what)
        lo -= lo % ALIGN
        buffer = new_buffer(hi - lo)
        read_fully(fd, buffer, cast(FileSpan, entry).start + lo, where, name)
        s.data, s.lo = buffer, lo


def _resolved(data: memoryview, dtype: str, conj: bool, neg: bool) -> memoryview:
    """The values of a tensor stored with torch's conjugate or negative bit, in new
    memory: the sign bit of every (imaginary, for ``conj``) part flipped."""
    np = need("numpy", "reading a conjugated or negated tensor")
    width = SIGNED[dtype]
    words = np.frombuffer(data, dtype=f"<u{width}").copy()
    sign = words.dtype.type(1 << (8 * width - 1))
    parts = words.reshape(-1, 2) if dtype == "C64" else words.reshape(-1, 1)
    if neg:
        parts ^= sign
    if conj:
        parts[:, 1] ^= sign
    out: memoryview = memoryview(words.view(np.uint8))
    return out


class InMemory(Lazy):
    """Bytes already read into the checkpoint's own memory: handed out as they are, and
    copied into a load's buffer (the model's memory) by :attr:`fill`, so a load copies
    each tensor once instead of allocating a buffer for it and copying twice."""

    def __init__(self, data: memoryview) -> None:
        view = data.cast("B")

        def fill(buffer: memoryview) -> None:
            buffer.cast("B")[:] = view

        super().__init__(view.nbytes, fill, 0)
        self.view = view

    def read(self) -> memoryview:
        return self.view

    def __call__(self) -> memoryview:
        return self.view


class FileSpan:
    """The part of a memoryview's interface a bounds check uses (``nbytes``, slicing,
    ``bytes()`` of a short slice), over an open file: a slice is read only when its
    bytes are asked for, so checking where an entry lies reads nothing of it."""

    def __init__(self, fd: int, start: int, stop: int) -> None:
        self.fd, self.start, self.nbytes = fd, start, max(0, stop - start)

    def __getitem__(self, key: slice) -> FileSpan:
        lo, hi, _ = key.indices(self.nbytes)
        return FileSpan(self.fd, self.start + lo, self.start + max(lo, hi))

    def __bytes__(self) -> bytes:
        return os.pread(self.fd, self.nbytes, self.start)


def stand_in_source(name: str, t: StandIn) -> Source:
    """The save plan's record of ``t``: its storage and place in it, its bytes lazily.

    Call it after :func:`read_storages` has read the bytes ``t`` reads.
    """
    size = ITEMSIZE[t.dtype]
    offset = t.offset * size
    base, lo = t.storage.data, t.storage.lo
    identity: tuple[Hashable, ...] = (t.storage.key, offset, t.shape, t.stride, t.dtype)
    data: Callable[[], memoryview]
    if contiguous(t.shape, t.stride):
        data = InMemory(base[offset - lo : offset - lo + numel(t.shape) * size])
    else:

        def data() -> memoryview:
            return strided(base, t.dtype, t.shape, t.stride, offset - lo)

    if numel(t.shape) == 0:
        return Source(name, t.dtype, t.shape, ("empty", name), lambda: memoryview(b""), t.frozen)
    if t.conj or t.neg:
        # Its values are not its storage's bytes, so it is no view of them: its own bytes.
        stored = data
        return Source(
            name,
            t.dtype,
            t.shape,
            (*identity, t.conj, t.neg),
            lambda: _resolved(stored(), t.dtype, t.conj, t.neg),
            t.frozen,
        )
    return Source(
        name,
        t.dtype,
        t.shape,
        identity,
        data,
        t.frozen,
        storage=("storage", t.storage.key),
        offset=offset,
        stride=t.stride,
        region=lambda s, e: base[s - lo : e - lo],
    )
