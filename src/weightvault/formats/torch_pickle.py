"""``torch.save`` files (``.pt``, ``.pth``, ``.bin``), read without running their pickle.

A pickle can call any importable function while it loads, so nothing here unpickles a
file before :func:`~.pickle_scan.scan` has checked every global it names (and refused
the file, naming the global, if it references anything but the tensor-rebuild
functions, storage classes, dtypes and ``collections.OrderedDict``). Only then is the
file read:

* with PyTorch installed, by ``torch.load(weights_only=True)`` (a second, independent
  allow-list), memory-mapped for zip files;
* without it, by the restricted unpickler of the zip format in :mod:`.torch_zip`, whose
  storages are slices of a file map.

Tensors that share a storage come through as aliases (same layout) or views (overlapping
parts), exactly as :func:`weightvault.torch.save` would record them; equal bytes under
different names become copies. Nested dicts (``{"model": state_dict, ...}``) are
flattened with ``.``; values that are not tensors (an epoch number) are left out.

What decoding allocates is charged to the file's
:class:`~weightvault._base.limits.DecodeBudget` first: every name the flattening makes
(a dict referenced from many places would otherwise multiply them), ``data.pkl`` itself,
and every tensor that is not contiguous in its storage (a stride-0 tensor of 2**28
elements over 4 bytes would otherwise be expanded in full).
"""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Callable
from typing import Any, cast

from .._base.dtypes import ITEMSIZE, contiguous, numel
from .._base.errors import FormatError
from .._base.limits import DecodeBudget
from .._base.types import PathLike
from .._file.sharing import Source
from ._common import ForeignCheckpoint, build, decoding, map_file
from .pickle_scan import FIX_DAMAGED, FIX_UNSAFE, scan, scan_legacy
from .torch_zip import StandIn, stand_in_source, unpickle_zip, zip_pickle

#: Dict keys that become part of a name; their text is bounded by the pickle's own bytes.
KEY_TYPES = (str, int, float, type(None))
#: Which values of the unpickled object are tensors (torch's, or the stand-ins).
IsTensor = Callable[[Any], bool]


def open_torch(path: PathLike, *, max_decoded_bytes: int | None = None) -> ForeignCheckpoint:
    """Open a ``torch.save`` file safely as a checkpoint.

    Args:
        path: The ``.pt``/``.pth``/``.bin`` file.
        max_decoded_bytes: The most bytes names, ``data.pkl`` and non-contiguous tensors
            may take in all; ``None`` means the default of :mod:`weightvault._base.limits`.

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
    is_zip = _scan_file(where, budget)
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


def _scan_file(where: str, budget: DecodeBudget) -> bool:
    """Scan every pickle in the file before anything loads one; whether it is a zip."""
    try:
        with zipfile.ZipFile(where) as z:
            _, data = zip_pickle(z, where, budget)
        scan(io.BytesIO(data), where)
        return True
    except zipfile.BadZipFile:
        pass
    mm, _ = map_file(where)
    if mm is None:
        raise FormatError(f"{where}: the file is empty")
    buf = memoryview(mm)
    try:
        count = scan_legacy(buf, where)
    finally:
        buf.release()  # a traceback may still hold the reader; the map must go now
        mm.close()
    if count == 1:
        raise FormatError(
            f"{where}: a plain pickle, not a torch.save file; save the tensors with "
            "torch.save or weightvault.torch.save"
        )
    return False


def _flatten(
    obj: Any,
    prefix: str,
    out: dict[str, Any],
    is_tensor: IsTensor,
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


def _tensors(obj: Any, where: str, is_tensor: IsTensor, budget: DecodeBudget) -> dict[str, Any]:
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

    from .._torch.tensors import layout_identity, tensor_source as source

    if is_zip:
        _validate_zip(where, budget.requested)
    try:
        # Read, not mapped (mmap=True): touching a mapping of a file cut short meanwhile
        # kills the process with SIGBUS, where torch's reads raise.
        obj = torch.load(where, map_location="cpu", weights_only=True, mmap=False)
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
            sources.append(source(name, t, layout_identity(t), frozen))
        except TypeError as e:
            raise FormatError(f"{where}: {e}") from None
    return build(where, sources, "pt")


def _charge_strided(budget: DecodeBudget, name: str, nbytes: int) -> None:
    budget.charge(f"tensor {name!r} (not contiguous, so copied)", nbytes)


def _open_without_torch(where: str, budget: DecodeBudget) -> ForeignCheckpoint:
    mm, _ = map_file(where)
    if mm is None:
        raise FormatError(f"{where}: the file is empty")
    obj = unpickle_zip(where, memoryview(mm), budget)
    tensors = _tensors(obj, where, lambda v: isinstance(v, StandIn), budget)
    for name, t in tensors.items():
        if not contiguous(t.shape, t.stride):
            _charge_strided(budget, name, numel(t.shape) * ITEMSIZE[t.dtype])
    return build(where, [stand_in_source(n, t) for n, t in tensors.items()], "pt", keep=mm)


def _validate_zip(where: str, limit: int | None) -> None:
    """Check every tensor lies inside its storage entry before torch reads the file.

    ``torch.load`` trusts the sizes in the pickle, so a crafted file could make a tensor
    read past its entry. Only the zip's directory, its local headers and the pickle are
    read here (:class:`_Sparse`): reading the whole file as well as torch's own read
    made opening a GPT-2 ``.pt`` 3.2x slower.
    """
    with open(where, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise FormatError(f"{where}: the file is empty")
        # Its own budget: this pass only checks, and the real open charges the same names.
        budget = DecodeBudget(where, size, limit)
        buf = cast(memoryview, _Sparse(f.fileno(), 0, size))
        _tensors(unpickle_zip(where, buf, budget), where, lambda v: isinstance(v, StandIn), budget)


class _Sparse:
    """The part of a memoryview's interface a bounds check uses (``nbytes``, slicing,
    ``bytes()`` of a short slice), over a file: a slice is read only when its bytes
    are asked for, so checking a storage's bounds reads nothing of it."""

    def __init__(self, fd: int, start: int, stop: int) -> None:
        self.fd, self.start, self.nbytes = fd, start, max(0, stop - start)

    def __getitem__(self, key: slice) -> _Sparse:
        lo, hi, _ = key.indices(self.nbytes)
        return _Sparse(self.fd, self.start + lo, self.start + max(lo, hi))

    def __bytes__(self) -> bytes:
        return os.pread(self.fd, self.nbytes, self.start)
