"""A module's or a tensor dict's tensors as sources to save, snapshotted if asked.

The save half of :mod:`weightvault.torch`. Names are ``state_dict`` names, every alias
included; two names of the same memory with the same layout are one tensor (an alias),
and partial views of one storage keep their storage key so the save plan stores them once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._base.errors import UnsupportedValueError
from .._base.snapshots import SnapshotPool
from .._file.sharing import Source
from .tensors import layout_identity, tensor_source
from .wrappers import unwrap

Model = nn.Module | Mapping[str, torch.Tensor]


def _check_value(name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise UnsupportedValueError(
            f"save: {name!r} is a {type(value).__name__}, not a tensor; a dict to save must "
            "hold only tensors (keep other state in metadata=, or save the nn.Module)"
        )
    if value.layout != torch.strided:
        raise UnsupportedValueError(
            f"save: tensor {name!r} has layout {value.layout}, which safetensors cannot "
            "store; convert it first, for example with .to_dense()"
        )


def _copy_storage(
    storage: torch.UntypedStorage, pool: SnapshotPool | None, later: bool = False
) -> Any:
    """A copy of ``storage``, into a buffer of the previous snapshot when there is one;
    made by the save's thread if ``later`` (see :mod:`.staging`)."""
    if pool is None:
        return storage.clone()  # type: ignore[no-untyped-call]
    key = (str(storage.device), storage.nbytes())
    if later:
        return pool.later(
            key,
            lambda: torch.UntypedStorage(storage.nbytes(), device=storage.device),  # type: ignore[no-untyped-call]
            lambda buffer: buffer.copy_(storage),
        )
    return pool.copy(key, storage.clone, lambda buffer: buffer.copy_(storage))


def _snapshot(
    t: torch.Tensor,
    copies: dict[Any, torch.UntypedStorage],
    pool: SnapshotPool | None = None,
    later: bool = False,
) -> torch.Tensor:
    """A tensor with ``t``'s layout over a copy of its storage (one copy per storage)."""
    storage = t.untyped_storage()
    key = (str(t.device), storage.data_ptr())
    if key not in copies:
        copies[key] = _copy_storage(storage, pool, later)
    twin = torch.empty(0, dtype=t.dtype, device=t.device)
    return twin.set_(copies[key], t.storage_offset(), t.shape, t.stride())


def _state(obj: Model) -> dict[str, Any]:
    if isinstance(obj, nn.Module):
        # The wrapped model's own names: torch.compile and DDP would prefix every one.
        return unwrap(obj).state_dict(keep_vars=True)
    if isinstance(obj, Mapping):
        for name, value in obj.items():
            _check_value(name, value)
        return dict(obj)
    raise TypeError(f"save() takes an nn.Module or a dict of tensors, not {type(obj).__name__}")


def model_sources(
    obj: Model, *, snapshot: bool | SnapshotPool = False
) -> tuple[list[Source], list[str]]:
    """The model's tensors as sources, and the names left out (a module's extra state).

    With ``snapshot``, read from copies taken now (into the buffers of a
    :class:`SnapshotPool`'s previous snapshot, if one is given). A snapshot copies every
    tensor that training can change: all but frozen parameters (``requires_grad=False``),
    which are read live when the background save writes them.

    Raises:
        UnsupportedValueError: A dict value is not a tensor, or a tensor is sparse.
        TypeError: ``obj`` is neither a module nor a dict.
    """
    pool = snapshot if isinstance(snapshot, SnapshotPool) else None
    copies: dict[Any, torch.UntypedStorage] = {}
    resolved: dict[Any, torch.Tensor] = {}
    skipped: list[str] = []
    sources: list[Source] = []
    for name, value in _state(obj).items():
        if not isinstance(value, torch.Tensor):
            skipped.append(name)  # a module's extra state (get_extra_state): reported
            continue
        _check_value(name, value)
        frozen = isinstance(value, nn.Parameter) and not value.requires_grad
        # Same memory with the same layout is one tensor, whether or not it is one object.
        identity = layout_identity(value)
        twin = None
        if value.is_conj() or value.is_neg():
            # Its bytes are not its values: plan the resolved values, once per identity so
            # that two names of one lazy tensor stay one (an alias). The resolved tensor is
            # already a private copy, so a background save needs no snapshot of it.
            if identity not in resolved:
                resolved[identity] = value.detach().resolve_conj().resolve_neg()
            value = resolved[identity]
        elif snapshot and not frozen and value.numel() > 0 and value.device.type != "meta":
            # Only an optimizer step changes a trainable parameter, and steps wait for
            # the save's copies (see staging.py); a buffer may change in a forward pass.
            # A GPU copy is queued on the device at once anyway, and fast.
            trained = isinstance(value, nn.Parameter) and value.requires_grad
            later = trained and value.device.type == "cpu"
            twin = _snapshot(value.detach(), copies, pool, later=later)
        sources.append(tensor_source(name, value, identity, frozen, twin))
    return sources, skipped
