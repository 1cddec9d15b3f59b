"""Resuming from a DCP checkpoint whose frozen flags and optimizer state the live model
and optimizer do not match yet.

DCP builds the load template from the live objects: ``get_state_dict`` gives a fresh
optimizer state (a zero-gradient step) for every parameter that requires grad *now*, and
``set_state_dict`` drops the loaded state of every parameter that does not (PyTorch
#192202). So a fresh model whose frozen flags differ from the checkpoint's asks for
optimizer state the checkpoint never had (a "Missing key" error, or with ``strict=False``
invented AdamW moments), and a parameter trained, then frozen, loses the state the
checkpoint holds. The fix is to set the checkpoint's flags before the template is built,
add template entries for held state the template lacks, and put those into the optimizer
after ``set_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

__all__ = ["Flags", "apply_flags", "fqn", "install_state", "optimizer_template"]


def fqn(name: str) -> str:
    """A parameter's name as ``get_state_dict`` writes it: no wrapper prefixes (DDP,
    ``torch.compile``, activation checkpointing, FSDP1)."""
    for part in ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(part, "")
    return name


def _params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(fqn, parameter)`` for every name of every parameter, tied names included."""
    for name, p in model.named_parameters(remove_duplicate=False):
        yield fqn(name), p


@dataclass
class Flags:
    """The ``requires_grad`` flags a load changed, to put back when it should not keep them.

    Attributes:
        before: Each changed parameter and its flag before the load.
    """

    before: list[tuple[nn.Parameter, bool]] = field(default_factory=list)

    def restore(self) -> None:
        """Put every changed flag back."""
        for p, flag in self.before:
            p.requires_grad_(flag)


def apply_flags(model: nn.Module, metadata: Metadata, frozen: set[str], prefix: str) -> Flags:
    """Give each parameter the checkpoint holds the checkpoint's frozen flag.

    A parameter the checkpoint does not hold keeps its flag (a frozen new head stays
    frozen when a backbone is loaded with ``strict=False``).

    Args:
        model: The live model.
        metadata: The checkpoint's DCP metadata (its names say what it holds).
        frozen: Flattened names the checkpoint records as frozen.
        prefix: What the model's names start with in the flattened state (``"model."``).

    Returns:
        The flags changed, to :meth:`Flags.restore` when ``restore_frozen=False``.
    """
    held = metadata.state_dict_metadata
    flags = Flags()
    seen: set[int] = set()
    for name, p in _params(model):
        if f"{prefix}{name}" not in held or id(p) in seen:
            continue
        seen.add(id(p))
        want = f"{prefix}{name}" not in frozen
        if p.requires_grad != want:
            flags.before.append((p, p.requires_grad))
            p.requires_grad_(want)
    return flags


def _template(md: TensorStorageMetadata, param: torch.Tensor) -> torch.Tensor | None:
    """An empty tensor to load one optimizer state entry into, placed like ``param``."""
    dtype = md.properties.dtype
    if tuple(md.size) == tuple(param.shape):
        return torch.empty_like(param.detach(), dtype=dtype)  # a DTensor keeps its placement
    if len(md.size) == 0:
        return torch.zeros((), dtype=dtype)  # AdamW's ``step``, kept on the CPU
    return None


def _add_held(
    model: nn.Module, osd: dict[str, Any], metadata: Metadata, prefix: str
) -> dict[str, dict[str, torch.Tensor]]:
    """Add to ``osd`` the tensors of held optimizer state its template lacks.

    ``get_state_dict`` asks only for the state of parameters that require grad and for
    which the optimizer has (or just made) state; a frozen parameter trained before has
    state in the checkpoint that would otherwise not be read.

    Args:
        model: The live model.
        osd: The optimizer's load template from ``get_state_dict`` (``state`` by FQN).
        metadata: The checkpoint's DCP metadata.
        prefix: The optimizer's prefix in the flattened state (``"optim."``).

    Returns:
        The entries added, by parameter FQN, to install after ``set_state_dict``.
    """
    held: dict[str, dict[str, TensorStorageMetadata]] = {}
    head = f"{prefix}state."
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(head) and isinstance(md, TensorStorageMetadata):
            name, _, entry = key[len(head) :].rpartition(".")
            held.setdefault(name, {})[entry] = md
    state = osd.setdefault("state", {})
    added: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in _params(model):
        for entry, md in held.get(name, {}).items():
            if entry not in state.get(name, {}) and (t := _template(md, p)) is not None:
                added.setdefault(name, {})[entry] = t
    for name, entries in added.items():
        state.setdefault(name, {}).update(entries)
    return added


def install_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, added: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Give the optimizer the loaded entries ``set_state_dict`` did not keep (frozen ones)."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in _params(model):
        entries = added.get(name)
        if entries is None or id(p) not in mine:
            continue
        held = optimizer.state[p]
        for key, value in entries.items():
            held.setdefault(key, value)


def _drop_unheld(osd: dict[str, Any], metadata: Metadata, prefix: str) -> None:
    """Remove from a fresh optimizer's template the state the checkpoint does not hold.

    ``get_state_dict`` makes a fresh optimizer's state up (a zero-gradient step: ``step``
    1, zero moments). Entries the checkpoint holds are overwritten by the load; the rest
    are dropped, so those parameters start as a new optimizer would start them.
    """
    held = metadata.state_dict_metadata
    state = osd.get("state", {})
    for name in list(state):
        entries = state[name]
        for entry in [e for e in entries if f"{prefix}state.{name}.{e}" not in held]:
            del entries[entry]
        if not entries:
            del state[name]


def optimizer_template(
    model: nn.Module, osd: dict[str, Any], metadata: Metadata, prefix: str, *, fresh: bool
) -> dict[str, dict[str, torch.Tensor]]:
    """Make ``get_state_dict``'s optimizer template ask for what the checkpoint holds.

    Args:
        model: The live model, with the checkpoint's frozen flags applied.
        osd: The optimizer's template from ``get_state_dict``; changed in place.
        metadata: The checkpoint's DCP metadata.
        prefix: The optimizer's prefix in the flattened state (``"optim."``).
        fresh: The optimizer had no state before ``get_state_dict`` made some up.

    Returns:
        The entries added for held state the template lacked, for :func:`install_state`.
    """
    if fresh:
        _drop_unheld(osd, metadata, prefix)
    return _add_held(model, osd, metadata, prefix)
