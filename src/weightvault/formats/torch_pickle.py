"""``torch.save`` files (``.pt``, ``.pth``, ``.bin``), read without running their pickle.

A pickle can call any importable function while it loads, so nothing here unpickles a
file before every global it names has been checked. :func:`scan` walks the opcodes with
:func:`pickletools.genops` (which only parses) and refuses the file, naming the global,
if it references anything but the tensor-rebuild functions, storage classes, dtypes and
``collections.OrderedDict``. Only then is the file read:

* with PyTorch installed, by ``torch.load(weights_only=True)`` (a second, independent
  allow-list), memory-mapped for zip files;
* without it, by a restricted unpickler of the zip format whose ``find_class`` returns
  local stand-ins for the same allowed globals; storages are slices of a file map.

Tensors that share a storage come through as aliases (same layout) or views (overlapping
parts), exactly as :func:`weightvault.torch.save` would record them; equal bytes under
different names become copies. Nested dicts (``{"model": state_dict, ...}``) are
flattened with ``.``; values that are not tensors (an epoch number) are left out.

What decoding allocates is charged to the file's
:class:`~weightvault._limits.DecodeBudget` first: every name the flattening makes (a dict
referenced from many places would otherwise multiply them), ``data.pkl`` itself, and
every tensor that is not contiguous in its storage (a stride-0 tensor of 2**28 elements
over 4 bytes would otherwise be expanded in full). The scan also refuses memo indices
beyond the pickle's own length, which would make the C unpickler size its memo table
by them.
"""

from __future__ import annotations

import _compat_pickle
import collections
import contextlib
import io
import os
import pickle
import pickletools
import re
import zipfile
from collections.abc import Hashable
from typing import Any

from .._base.dtypes import BY_FRAMEWORK_NAME, ITEMSIZE, contiguous, numel
from .._base.errors import FormatError, capped
from .._base.limits import DecodeBudget
from .._file.sharing import Source
from ._common import ForeignCheckpoint, build, decoding, map_file, stored_zip_member, strided

#: Typed storage classes -> the dtype of their elements.
STORAGES = {
    "DoubleStorage": "F64",
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "LongStorage": "I64",
    "IntStorage": "I32",
    "ShortStorage": "I16",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "BoolStorage": "BOOL",
    "ComplexFloatStorage": "C64",
}
#: ``torch.<dtype>`` globals that ``_rebuild_tensor_v3`` receives -> dtype names.
TORCH_DTYPES = BY_FRAMEWORK_NAME
REBUILDERS = frozenset(
    {
        "_rebuild_tensor",
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
    }
)
#: Every global a weights file may name, as ``module.name``.
ALLOWED = frozenset(
    {"collections.OrderedDict", "torch.storage.UntypedStorage", "torch.UntypedStorage"}
    | {f"torch._utils.{f}" for f in REBUILDERS}
    | {f"torch.{s}" for s in STORAGES}
    | {f"torch.{d}" for d in TORCH_DTYPES}
)
#: torch.save's first pickle in the legacy (pre-1.6) format is this number.
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
#: data.pkl holds structure, not tensor bytes; anything larger is not a weights file.
MAX_PICKLE_BYTES = 1 << 30

_STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING"}
    | {"SHORT_BINSTRING", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8"}
)
_NO_PUSH_OPS = frozenset({"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "PROTO", "FRAME", "STOP"})
FIX_DAMAGED = "the file is truncated or damaged; save it again with torch.save"
#: Dict keys that become part of a name; their text is bounded by the pickle's own bytes.
KEY_TYPES = (str, int, float, type(None))
FIX_UNSAFE = (
    "save only the weights (torch.save(model.state_dict(), path)) or, if you trust the "
    "file, load it yourself and save it with weightvault.torch.save"
)


class _MapReader:
    """A read-only file-like view of a buffer: ``read(n)`` never allocates more than exists.

    ``pickletools.genops`` calls ``read(n)`` with lengths taken from the file; a real file
    object would allocate ``n`` bytes first, this returns what is there.
    """

    def __init__(self, buf: memoryview, start: int = 0) -> None:
        self.buf, self.pos = buf, start

    def read(self, n: int = -1) -> bytes:
        end = self.buf.nbytes if n < 0 else min(self.buf.nbytes, self.pos + n)
        out = bytes(self.buf[self.pos : end])
        self.pos = end
        return out

    def readline(self) -> bytes:
        end = self.pos
        limit = min(self.buf.nbytes, self.pos + (1 << 20))
        while end < limit and self.buf[end] != 0x0A:
            end += 1
        return self.read(end + 1 - self.pos)

    def tell(self) -> int:
        return self.pos


def scan(stream: Any, where: str) -> list[str]:
    """Check every global one pickle references against :data:`ALLOWED`; nothing is run.

    Args:
        stream: A file-like object positioned at the pickle (or the pickle's bytes).
        where: The file, for messages.

    Returns:
        The globals referenced, as ``module.name``.

    Raises:
        FormatError: A global is not allowed (the message names it), a global cannot be
            resolved statically, or the pickle is malformed.

    Example:
        >>> scan(pickle.dumps(os.system), "evil.pkl")
        Traceback (most recent call last):
        FormatError: evil.pkl: refused: the pickle references 'posix.system', ...
    """
    found: list[str] = []
    memo: dict[int, object] = {}
    recent: list[object] = []  # values of the last pushes; strings where known
    ops = 0
    try:
        for op, arg, _ in pickletools.genops(stream):
            name = op.name
            ops += 1
            # Picklers number memo slots 0, 1, 2, ...; the C unpickler sizes its memo
            # table by the largest index, so a 5-byte LONG_BINPUT could cost gigabytes.
            if name in ("PUT", "BINPUT", "LONG_BINPUT") and (
                not isinstance(arg, int) or not 0 <= arg < ops
            ):
                raise FormatError(
                    f"{where}: refused: the pickle stores memo slot {str(arg)[:40]} after "
                    f"only {ops} opcodes, which no pickler writes; {FIX_DAMAGED}"
                )
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                found.append(_allow(f"{module}.{attr}", where))
                recent.append(None)
            elif name == "STACK_GLOBAL":
                if len(recent) < 2 or not all(isinstance(v, str) for v in recent[-2:]):
                    raise FormatError(
                        f"{where}: refused: the pickle builds a global from values that "
                        f"cannot be checked before loading; {FIX_UNSAFE}"
                    )
                found.append(_allow(f"{recent[-2]}.{recent[-1]}", where))
                recent.append(None)
            elif name in ("EXT1", "EXT2", "EXT4"):
                raise FormatError(
                    f"{where}: refused: the pickle references a global through the copyreg "
                    f"extension registry (code {arg}), which cannot be checked; {FIX_UNSAFE}"
                )
            elif name in _STRING_OPS:
                value = arg.decode("latin-1") if isinstance(arg, bytes) else arg
                recent.append(value)
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg if isinstance(arg, int) else -1] = recent[-1] if recent else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                recent.append(memo.get(arg if isinstance(arg, int) else -1))
            elif name not in _NO_PUSH_OPS:
                recent.append(None)
            del recent[:-2]
    except FormatError:
        raise
    except Exception as e:  # genops raises ValueError, EOFError, UnicodeError, ...
        raise FormatError(
            f"{where}: not a valid pickle ({type(e).__name__}: {str(e)[:120]}); the file is "
            "truncated or damaged"
        ) from None
    return found


def _allow(qualified: str, where: str) -> str:
    module, _, name = qualified.rpartition(".")
    # Protocol 2 names Python 3 modules by their Python 2 names (__builtin__ is builtins);
    # report what the unpickler would import.
    qualified = f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"
    if qualified not in ALLOWED:
        raise FormatError(
            f"{where}: refused: the pickle references {qualified[:200]!r}, which is not "
            f"tensor data and could run code when loaded (allowed: "
            f"{capped(sorted(ALLOWED), 4)}); {FIX_UNSAFE}"
        )
    return qualified


# --------------------------------------------------------------------------------------
# The file's pickles
# --------------------------------------------------------------------------------------


def _head(z: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """The first 16 bytes of a member; a compressed member is never inflated further."""
    with z.open(info) as f:
        return f.read(16)


def _zip_pickle(
    z: zipfile.ZipFile, where: str, budget: DecodeBudget | None = None
) -> tuple[str, bytes]:
    """The archive prefix and the bytes of ``<prefix>/data.pkl``."""
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
    order = _zip_member(z, f"{prefix}/byteorder")
    if order is not None and _head(z, order) not in (b"little", b""):
        raise FormatError(
            f"{where}: tensors were saved big-endian; load the file with torch on a "
            "big-endian machine and save it again"
        )
    return prefix, data


def _zip_member(z: zipfile.ZipFile, name: str) -> zipfile.ZipInfo | None:
    try:
        return z.getinfo(name)
    except KeyError:
        return None


def _legacy_pickles(buf: memoryview, where: str) -> int:
    """Scan the pickles of a legacy ``torch.save`` file (or a plain pickle); return count.

    The legacy layout is five pickles (magic number, protocol, system info, the object,
    the storage keys) followed by raw storages, so each pickle is scanned in turn.
    """
    reader = _MapReader(buf)
    start = reader.tell()
    scan(reader, where)
    # Compared as bytes: even an allowed pickle is not loaded before every one is scanned.
    if bytes(buf[start : reader.tell()]) != pickle.dumps(LEGACY_MAGIC, protocol=2):
        return 1
    for _ in range(4):
        scan(reader, where)
    return 5


# --------------------------------------------------------------------------------------
# Opening
# --------------------------------------------------------------------------------------


def open_torch(
    path: str | os.PathLike[str], *, max_decoded_bytes: int | None = None
) -> ForeignCheckpoint:
    """Open a ``torch.save`` file safely as a checkpoint.

    Args:
        path: The ``.pt``/``.pth``/``.bin`` file.
        max_decoded_bytes: The most bytes names, ``data.pkl`` and non-contiguous tensors
            may take in all; ``None`` means the default of :mod:`weightvault._limits`.

    Raises:
        FormatError: The pickle references a forbidden global (named in the message), the
            file is malformed or holds no dict of tensors, or decoding would pass the
            limit.

    Example:
        >>> ckpt = open_torch("pytorch_model.bin")
        >>> ckpt.entry("lm_head.weight").kind
        'alias'
    """
    where = os.fspath(path)
    size = os.stat(where).st_size  # a missing file is an OSError, not damage
    with decoding(where, FIX_DAMAGED):
        return _open(where, size, max_decoded_bytes)


def _open(where: str, size: int, limit: int | None) -> ForeignCheckpoint:
    budget = DecodeBudget(where, size, limit)
    try:
        with zipfile.ZipFile(where) as z:
            is_zip = True
            _, data = _zip_pickle(z, where, budget)
        scan(io.BytesIO(data), where)
    except zipfile.BadZipFile:
        is_zip = False
        mm, _ = map_file(where)
        if mm is None:
            raise FormatError(f"{where}: the file is empty") from None
        buf = memoryview(mm)
        try:
            count = _legacy_pickles(buf, where)
        finally:
            buf.release()  # a traceback may still hold the reader; the map must go now
            mm.close()
        if count == 1:
            raise FormatError(
                f"{where}: a plain pickle, not a torch.save file; save the tensors with "
                "torch.save or weightvault.torch.save"
            ) from None
    try:
        import torch  # noqa: F401
    except ImportError:
        if not is_zip:
            raise FormatError(
                f"{where}: the legacy (pre-1.6) torch.save format needs PyTorch to read; "
                "install torch, or re-save the file with a current torch"
            ) from None
        return _open_without_torch(where, budget)
    return _open_with_torch(where, is_zip, budget)


def _flatten(
    obj: Any,
    prefix: str,
    out: dict[str, Any],
    is_tensor: Any,
    budget: DecodeBudget,
    depth: int = 0,
) -> None:
    if depth > 32:
        raise FormatError("dicts nested more than 32 deep")
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, KEY_TYPES):
                # A tuple key could nest shared tuples whose text is exponentially long.
                raise FormatError(
                    f"a dict under {prefix[:80]!r} has a {type(k).__name__} key; state dict "
                    "keys are strings"
                )
            name = f"{prefix}.{k}" if prefix else str(k)
            # Charged per visit: one dict referenced from many places is walked each time.
            budget.charge_name(name)
            if is_tensor(v):
                out[name] = v
            else:
                _flatten(v, name, out, is_tensor, budget, depth + 1)


def _tensors(obj: Any, where: str, is_tensor: Any, budget: DecodeBudget) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise FormatError(
            f"{where}: holds a {type(obj).__name__}, not a dict of tensors; save a "
            "state_dict (torch.save(model.state_dict(), path))"
        )
    out: dict[str, Any] = {}
    try:
        _flatten(obj, "", out, is_tensor, budget)
    except FormatError as e:
        msg = str(e)
        raise FormatError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    return out


def _open_with_torch(where: str, is_zip: bool, budget: DecodeBudget) -> ForeignCheckpoint:
    import torch
    from torch import nn

    from .._torch.tensors import _layout_identity, _source

    if is_zip:
        _validate_zip(where, budget.requested)
    try:
        obj = torch.load(where, map_location="cpu", weights_only=True, mmap=is_zip)
    except Exception as e:
        raise FormatError(
            f"{where}: torch.load(weights_only=True) refused the file "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
            f"{FIX_UNSAFE}"
        ) from None
    tensors = _tensors(obj, where, lambda v: isinstance(v, torch.Tensor), budget)
    sources: list[Source] = []
    for name, t in tensors.items():
        if t.layout != torch.strided or t.is_quantized:
            raise FormatError(
                f"{where}: tensor {name!r} is {t.layout} / quantized, which safetensors cannot "
                "store; convert it to a dense tensor and save again"
            )
        if not t.is_contiguous():
            _charge_strided(budget, name, t.numel() * t.element_size())
        frozen = isinstance(t, nn.Parameter) and not t.requires_grad
        try:
            sources.append(_source(name, t, _layout_identity(t), frozen))
        except TypeError as e:
            raise FormatError(f"{where}: {e}") from None
    return build(where, sources, "pt")


# --------------------------------------------------------------------------------------
# Without torch: a restricted unpickler of the zip format
# --------------------------------------------------------------------------------------


class _DType:
    def __init__(self, name: str) -> None:
        self.name = name


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


class _Storage:
    def __init__(self, key: str, dtype: str, data: memoryview) -> None:
        self.key, self.dtype, self.data = key, dtype, data


class _Tensor:
    def __init__(
        self,
        storage: _Storage,
        offset: int,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: str,
    ) -> None:
        self.storage, self.offset, self.shape, self.stride, self.dtype = (
            storage,
            offset,
            shape,
            stride,
            dtype,
        )
        self.frozen = False


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > 64:
        raise FormatError(f"malformed tensor {what} {str(value)[:60]}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise FormatError(f"malformed tensor {what} {str(value)[:60]}")
    return tuple(value)


def _rebuild(
    storage: Any, offset: Any, size: Any, stride: Any, dtype: str | None = None
) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise FormatError("a tensor's storage is not a storage record")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise FormatError(f"malformed storage offset {str(offset)[:40]}")
    shape, strides = _ints(size, "shape"), _ints(stride, "stride")
    if len(shape) != len(strides):
        raise FormatError(f"shape {list(shape)} and stride {list(strides)} differ in length")
    t = _Tensor(storage, offset, shape, strides, dtype or storage.dtype)
    size_ = ITEMSIZE[t.dtype]
    if numel(shape):
        last = sum((s - 1) * st for s, st in zip(shape, strides, strict=True))
        end = (offset + last + 1) * size_
        if end > storage.data.nbytes:
            raise FormatError(
                f"tensor {t.dtype}{list(shape)} reads bytes up to {end} of storage "
                f"{storage.key!r}, which has {storage.data.nbytes}"
            )
    return t


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any) -> _Tensor:
    return _rebuild(storage, offset, size, stride)


def _rebuild_tensor_v2(
    storage: Any, offset: Any, size: Any, stride: Any, *_: Any, **__: Any
) -> _Tensor:
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
) -> _Tensor:
    if not isinstance(dtype, _DType):
        raise FormatError("a tensor's dtype is not a torch dtype")
    return _rebuild(storage, offset, size, stride, dtype.name)


def _rebuild_parameter(data: Any, requires_grad: Any, *_: Any) -> _Tensor:
    if not isinstance(data, _Tensor):
        raise FormatError("a Parameter does not hold a tensor")
    data.frozen = requires_grad is False
    return data


class _Unpickler(pickle.Unpickler):
    """Unpickles only the allowed globals, each as a local stand-in; storages from a map."""

    def __init__(self, data: bytes, storages: Any) -> None:
        super().__init__(io.BytesIO(data))
        self._storages = storages

    def find_class(self, module: str, name: str) -> Any:
        qualified = f"{module}.{name}"
        if qualified not in ALLOWED:  # scan() refused it already; this is a second lock
            raise FormatError(f"refused global {qualified!r}")
        if qualified == "collections.OrderedDict":
            return collections.OrderedDict
        if module == "torch._utils":
            return {
                "_rebuild_tensor": _rebuild_tensor,
                "_rebuild_tensor_v2": _rebuild_tensor_v2,
                "_rebuild_tensor_v3": _rebuild_tensor_v3,
                "_rebuild_parameter": _rebuild_parameter,
                "_rebuild_parameter_with_state": _rebuild_parameter,
            }[name]
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


def _unpickle_zip(where: str, buf: memoryview, budget: DecodeBudget) -> Any:
    """The zip file's object, its tensors as stand-ins over ``buf``, every bound checked."""
    with zipfile.ZipFile(where) as z:
        prefix, data = _zip_pickle(z, where, budget)
        cache: dict[str, _Storage] = {}

        def storage(key: str, dtype: str, count: int) -> _Storage:
            if key in cache:
                return cache[key]
            info = _zip_member(z, f"{prefix}/data/{key}")
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


def _charge_strided(budget: DecodeBudget, name: str, nbytes: int) -> None:
    budget.charge(f"tensor {name!r} (not contiguous, so copied)", nbytes)


def _open_without_torch(where: str, budget: DecodeBudget) -> ForeignCheckpoint:
    mm, _ = map_file(where)
    if mm is None:
        raise FormatError(f"{where}: the file is empty")
    obj = _unpickle_zip(where, memoryview(mm), budget)
    tensors = _tensors(obj, where, lambda v: isinstance(v, _Tensor), budget)
    for name, t in tensors.items():
        if not contiguous(t.shape, t.stride):
            _charge_strided(budget, name, numel(t.shape) * ITEMSIZE[t.dtype])
    return build(where, [_source(n, t) for n, t in tensors.items()], "pt", keep=mm)


def _validate_zip(where: str, limit: int | None) -> None:
    """Check every tensor lies inside its storage entry before torch maps the file.

    ``torch.load(mmap=True)`` trusts the sizes in the pickle, so a crafted file could
    make a tensor read past its entry into the rest of the file.
    """
    mm, size = map_file(where)
    if mm is None:
        raise FormatError(f"{where}: the file is empty")
    # Its own budget: this pass only checks, and the real open charges the same names.
    budget = DecodeBudget(where, size, limit)
    buf = memoryview(mm)
    try:
        _tensors(_unpickle_zip(where, buf, budget), where, lambda v: isinstance(v, _Tensor), budget)
    finally:
        buf.release()
        with contextlib.suppress(BufferError):
            mm.close()


def _source(name: str, t: _Tensor) -> Source:
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
