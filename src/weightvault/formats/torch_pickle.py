"""``torch.save`` files (``.pt``, ``.pth``, ``.bin``), read without running their pickle.

A pickle can call any importable function while it loads, so nothing here unpickles a
file before :func:`~.pickle_scan.scan` has checked every global it names (and refused
the file, naming the global, if it references anything but the tensor-rebuild
functions, storage classes, dtypes and ``collections.OrderedDict``). Only then is the
file read:

* a zip file (what ``torch.save`` writes since PyTorch 1.6), with or without PyTorch,
  by the restricted unpickler of :mod:`.torch_zip` (a second lock: it knows only
  stand-ins for the allowed globals), which checks every tensor against its storage's
  entry and then reads each storage once with ``preadv`` into memory of its own. No
  mapping: a file cut short while it is read is a :class:`FormatError` naming the file
  and the tensor, never a ``SIGBUS``. What it costs against ``torch.load`` and
  safetensors: docs/_bench_pt_open.md (``bench/bench_pt_open.py``);
* a legacy (pre-1.6) file, whose storages follow its pickles unframed, by
  ``torch.load(weights_only=True)`` (a second, independent allow-list), which needs
  PyTorch.

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
import mmap
import os
import zipfile
from collections.abc import Callable
from typing import IO, Any

from .._base.dtypes import ITEMSIZE, contiguous, numel
from .._base.errors import FormatError
from .._base.limits import DecodeBudget
from .._base.types import PathLike
from .._file.sharing import Source
from ._common import ForeignCheckpoint, build, decoding
from .pickle_scan import FIX_DAMAGED, FIX_UNSAFE, scan, scan_legacy
from .torch_zip import StandIn, read_storages, stand_in_source, unpickle_zip, zip_pickle

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
    # One descriptor for the scan and every read: the pickle unpickled is the one scanned.
    with open(where, "rb") as f:
        found = _scan_file(where, f, budget)
        if found is not None:
            return _open_zip(where, f, *found, budget)
        try:
            import torch  # noqa: F401
        except ImportError:
            raise FormatError(
                f"{where}: the legacy (pre-1.6) torch.save format needs PyTorch to read; "
                "install torch, or re-save the file with a current torch"
            ) from None
        return _open_legacy(where, f, budget)


def _scan_file(
    where: str, f: IO[bytes], budget: DecodeBudget
) -> tuple[zipfile.ZipFile, str, bytes] | None:
    """Scan every pickle in the file before anything loads one.

    Returns:
        For a zip, the archive, its prefix and the ``data.pkl`` that passed (charged to
        ``budget``); ``None`` for a legacy file.
    """
    try:
        z = zipfile.ZipFile(f)
    except zipfile.BadZipFile:
        z = None
    if z is not None:
        try:
            prefix, data = zip_pickle(z, where, budget)
            scan(io.BytesIO(data), where)
        except BaseException:
            z.close()
            raise
        return z, prefix, data
    if os.fstat(f.fileno()).st_size == 0:
        raise FormatError(f"{where}: the file is empty")
    # Still a map: a pickle's length is known only once it is parsed. Legacy files only.
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
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
    return None


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


def _open_zip(
    where: str, f: IO[bytes], z: zipfile.ZipFile, prefix: str, data: bytes, budget: DecodeBudget
) -> ForeignCheckpoint:
    """A zip file through the stand-ins, whether or not PyTorch is installed."""
    with z:
        obj = unpickle_zip(z, prefix, data, where)
    tensors = _tensors(obj, where, lambda v: isinstance(v, StandIn), budget)
    for name, t in tensors.items():
        if not contiguous(t.shape, t.stride):
            _charge_strided(budget, name, numel(t.shape) * ITEMSIZE[t.dtype])
    read_storages(f.fileno(), where, tensors)
    return build(where, [stand_in_source(n, t) for n, t in tensors.items()], "pt")


def _open_legacy(where: str, f: IO[bytes], budget: DecodeBudget) -> ForeignCheckpoint:
    """A legacy file through ``torch.load``: its storages follow its pickles unframed,
    which only torch's reader knows how to walk."""
    import torch
    from torch import nn

    from .._torch.tensors import layout_identity, tensor_source as source

    f.seek(0)
    try:
        obj = torch.load(f, map_location="cpu", weights_only=True)
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
