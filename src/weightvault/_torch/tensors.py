"""PyTorch tensors as weightvault records: dtype names, bytes, layout keys, reads.

Shared by the torch adapter, its training state (:mod:`.state`), the ``torch.save``
reader (:mod:`weightvault.formats.torch_pickle`) and the integrations, so none of them
imports another. Reads build torch tensors straight over the stored bytes (the file
mapping, or a private copy), views included; the numpy-backed adapters decode the same
bytes with :mod:`weightvault._file.arrays`, which cannot hand bfloat16 or float8 to
torch without a copy. Importing this module needs PyTorch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .._base.dtypes import FRAMEWORK_NAMES, unsupported
from .._base.errors import UnsupportedDtypeError as UnsupportedDtypeError, UnsupportedValueError
from .._file.checkpoint import Checkpoint, Entry
from .._file.sharing import Source

#: safetensors dtype name -> torch dtype, from the one table in :mod:`._dtypes`.
#: A PyTorch older than a dtype (float8_e8m0fnu is recent) simply lacks its entry.
DTYPES: dict[str, torch.dtype] = {
    k: getattr(torch, v) for k, v in FRAMEWORK_NAMES.items() if hasattr(torch, v)
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def _dtype_name(name: str, t: torch.Tensor) -> str:
    try:
        return NAMES[t.dtype]
    except KeyError:
        raise unsupported(f"tensor {name!r}", t.dtype, ".to(torch.float32)") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1)
    if flat.stride() != (1,):
        # contiguous() keeps an odd stride on size-1 dimensions, which view() refuses.
        flat = flat.clone(memory_format=torch.contiguous_format)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def bytes_reader(t: torch.Tensor) -> Callable[[], memoryview]:
    """``tensor_bytes(t)`` on demand, made once for a CPU tensor: a save reads each
    source twice (the plan's fingerprint, then the hash), and making the view costs
    about 10 microseconds, a few milliseconds for a model's tensors. Made at the first
    read, not now: a background save's snapshot is filled only then. A GPU tensor's bytes
    are a host copy, made at each read, so that a save never holds them all at once."""
    if t.device.type != "cpu":
        return lambda: tensor_bytes(t)
    made: list[memoryview] = []

    def read() -> memoryview:
        if not made:
            made.append(tensor_bytes(t))
        return made[0]

    return read


def _region(t: torch.Tensor) -> Any:
    def region(start: int, end: int) -> memoryview:
        storage = t.untyped_storage()
        if storage.device.type != "cpu":
            storage = storage.cpu()  # type: ignore[no-untyped-call]
        u8 = torch.empty(0, dtype=torch.uint8).set_(storage, start, (end - start,), (1,))
        return memoryview(u8.numpy())  # type: ignore[arg-type]

    return region


def tensor_source(
    name: str, t: torch.Tensor, identity: Any, frozen: bool, twin: torch.Tensor | None = None
) -> Source:
    """A source for ``t``; with ``twin`` (a snapshot of ``t``), bytes are read from it.

    The source names ``t``'s storage, offset and strides, so that the save plan stores
    partial views of one storage once (:mod:`weightvault._file.sharing`).
    """
    dtype = _dtype_name(name, t)
    live, t = t, t if twin is None else twin
    if t.numel() == 0 or t.device.type == "meta":
        if t.device.type == "meta":
            raise UnsupportedValueError(
                f"tensor {name!r} is on the meta device and has no data; materialize the "
                "model (for example with model.to_empty(device='cpu')) before saving"
            )
        return Source(name, dtype, tuple(t.shape), identity, lambda: tensor_bytes(t), frozen)
    size = t.element_size()
    # Keys come from the live tensor, so a snapshot plans the same ties and views.
    storage = (str(live.device), live.untyped_storage().data_ptr())
    return Source(
        name,
        dtype,
        tuple(t.shape),
        identity,
        bytes_reader(t),
        frozen,
        storage=storage,
        offset=int(t.storage_offset()) * size,
        stride=tuple(t.stride()),
        region=_region(t),
    )


def layout_identity(t: torch.Tensor) -> Any:
    """What makes two names one tensor: the same memory read with the same layout."""
    if t.numel() == 0:
        return ("object", id(t))
    # A lazily conjugated or negated tensor shares memory and layout with its source but
    # reads different values, so the flags are part of what makes two names one tensor.
    return (
        str(t.device),
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        t.is_conj(),
        t.is_neg(),
    )


def stored_tensor(ckpt: Checkpoint, stored: str, *, mmap: bool) -> torch.Tensor:
    """The stored tensor ``stored``: over the file mapping (copy-on-write) with ``mmap``,
    else a private copy read with ``preadv``."""
    info = ckpt.stored[stored]
    dtype = DTYPES[info.dtype]
    if info.nbytes == 0:
        return torch.empty(info.shape, dtype=dtype)
    if not mmap:
        # A private copy read with preadv: a file truncated meanwhile is a FormatError,
        # where copying out of the map would die of SIGBUS. Into memory torch.empty does
        # not zero first: the read fills every byte.
        flat = torch.empty(info.nbytes, dtype=torch.uint8)
        if not ckpt.read_into(stored, memoryview(flat.numpy())):  # type: ignore[arg-type]
            flat = torch.frombuffer(ckpt.read(stored), dtype=torch.uint8)
        return flat.view(dtype).reshape(info.shape)
    data = ckpt.mapped(stored)
    if data.readonly:
        # Read-only memory (decoded foreign formats) can back no tensor safely: copy it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=torch.uint8).clone()
    else:
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype).reshape(info.shape)


def entry_tensor(e: Entry, base: torch.Tensor) -> torch.Tensor:
    """The tensor of name ``e`` over ``base`` (its stored tensor): ``base`` or a view of it."""
    if e.view is None:
        return base
    v = e.view
    flat = base.reshape(-1).view(torch.uint8)
    sub = flat[v.offset : v.offset + max(v.span(), 0)].view(DTYPES[v.dtype])
    if sub.numel() == 0:
        return torch.empty(v.shape, dtype=DTYPES[v.dtype])
    return sub.as_strided(v.shape, v.stride)


def read_tensor(ckpt: Checkpoint, name: str, *, mmap: bool = True) -> torch.Tensor:
    """A tensor for any name (stored, alias, copy, view): over the file mapping, or with
    ``mmap=False`` over a private copy of its stored tensor read with ``preadv``."""
    e = ckpt.entry(name)
    return entry_tensor(e, stored_tensor(ckpt, e.stored, mmap=mmap))
