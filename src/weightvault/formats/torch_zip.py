"""The ``torch.save`` zip format read without PyTorch: ``data.pkl`` and its storages.

A ``torch.save`` zip holds ``<name>/data.pkl`` (the object, its tensors as references
to storages) and one stored member ``<name>/data/<key>`` per storage. The restricted
unpickler here rebuilds tensors as :class:`StandIn` records whose storages are slices
of a read-only file map, every bound checked: ``find_class`` returns local stand-ins
for the globals :mod:`.pickle_scan` allows, and nothing else.

It also checks a zip before ``torch.load(mmap=True)`` maps it, since torch trusts the
sizes the pickle states.
"""

from __future__ import annotations

import collections
import io
import pickle
import re
import zipfile
from collections.abc import Callable, Hashable
from typing import Any

from .._base.dtypes import ITEMSIZE, contiguous, numel, span
from .._base.errors import FormatError
from .._base.limits import DecodeBudget
from .._file.sharing import Source
from ._common import stored_zip_member, strided
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
    def __init__(self, key: str, dtype: str, data: memoryview) -> None:
        self.key, self.dtype, self.data = key, dtype, data


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


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > 64:
        raise FormatError(f"malformed tensor {what} {str(value)[:60]}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise FormatError(f"malformed tensor {what} {str(value)[:60]}")
    return tuple(value)


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
    if numel(shape) and end > storage.data.nbytes:
        raise FormatError(
            f"tensor {t.dtype}{list(shape)} reads bytes up to {end} of storage "
            f"{storage.key!r}, which has {storage.data.nbytes}"
        )
    return t


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any) -> StandIn:
    return _rebuild(storage, offset, size, stride)


def _rebuild_tensor_v2(
    storage: Any, offset: Any, size: Any, stride: Any, *_: Any, **__: Any
) -> StandIn:
    return _rebuild(storage, offset, size, stride)


def _rebuild_tensor_v3(
    storage: Any,
    offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any,
    hooks: Any,
    dtype: Any,
    *_: Any,
) -> StandIn:
    if not isinstance(dtype, _DType):
        raise FormatError("a tensor's dtype is not a torch dtype")
    return _rebuild(storage, offset, size, stride, dtype.name)


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
    """Unpickles only the allowed globals, each as a local stand-in; storages from a map."""

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


def _stored_data(
    z: zipfile.ZipFile, info: zipfile.ZipInfo, buf: memoryview, where: str
) -> memoryview:
    """The bytes of a stored (uncompressed) zip member, as a slice of the file map."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise FormatError(
            f"{where}: storage {info.filename!r} is compressed, which torch.save never "
            "does; the file was repacked, so load it with torch and save it again"
        )
    return stored_zip_member(info, buf, where, f"zip entry {info.filename!r}")


def unpickle_zip(where: str, buf: memoryview, budget: DecodeBudget) -> Any:
    """The zip file's object, its tensors as stand-ins over ``buf``, every bound checked.

    Call it only after :func:`~.pickle_scan.scan` has passed ``data.pkl``.

    Raises:
        FormatError: A storage is missing, compressed or too short, or the pickle is
            malformed.
    """
    with zipfile.ZipFile(where) as z:
        prefix, data = zip_pickle(z, where, budget)
        cache: dict[str, _Storage] = {}

        def storage(key: str, dtype: str, count: int) -> _Storage:
            if key in cache:
                return cache[key]
            info = zip_member(z, f"{prefix}/data/{key}")
            if info is None:
                raise FormatError(f"storage {key!r} is missing from the archive")
            raw = _stored_data(z, info, buf, where)
            if raw.nbytes < count * ITEMSIZE[dtype]:
                raise FormatError(
                    f"storage {key!r} holds {raw.nbytes} bytes, not {count} x {dtype}"
                )
            cache[key] = _Storage(key, dtype, raw[: count * ITEMSIZE[dtype]])
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


def stand_in_source(name: str, t: StandIn) -> Source:
    """The save plan's record of ``t``: its storage and place in it, its bytes lazily."""
    size = ITEMSIZE[t.dtype]
    offset = t.offset * size
    base = t.storage.data
    identity: Hashable = (t.storage.key, offset, t.shape, t.stride, t.dtype)
    dense = contiguous(t.shape, t.stride)

    def data() -> memoryview:
        if dense:
            return base[offset : offset + numel(t.shape) * size]
        return strided(base, t.dtype, t.shape, t.stride, offset)

    if numel(t.shape) == 0:
        return Source(name, t.dtype, t.shape, ("empty", name), lambda: memoryview(b""), t.frozen)
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
        region=lambda s, e: base[s:e],
    )
