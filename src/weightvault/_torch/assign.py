"""Copying a load plan's values into a module's tensors: the load half of the adapter.

:func:`weightvault.torch.load` plans with :func:`weightvault._load.plan.plan_load`, then
calls :func:`assign_all`. Every byte must be reachable before the first copy; plain
copies run on a few threads (file reads release the GIL) and go straight from the file
into the parameter's memory where the layouts allow it.
"""

from __future__ import annotations

import os
from concurrent.futures import wait

import torch
from torch import nn

from .._base.errors import LoadOptionError, capped
from .._base.pools import LazyPool
from .._file.checkpoint import Checkpoint
from .._load.plan import Assignment, LoadPlan, Target
from .tensors import NAMES, read_tensor

#: Threads that copy bytes into parameters during a load (reads release the GIL).
READERS = min(4, os.cpu_count() or 1)
#: Smaller tensors are copied on the calling thread: handing them to a reader cost more
#: than the copy (measured on a 13 MB GPT-2, docs/benchmarks-log.md section 11).
_THREADED = 1 << 20


def targets(model: nn.Module) -> tuple[list[Target], dict[str, torch.Tensor]]:
    """Every tensor name of ``model`` as a load target, and the tensors by name."""
    found: list[Target] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue
        tensors[name] = t
        dtype = NAMES.get(t.dtype, str(t.dtype))
        found.append(Target(name, id(t), dtype, tuple(t.shape), isinstance(t, nn.Parameter)))
    return found, tensors


def assign_all(
    ckpt: Checkpoint,
    plan: LoadPlan,
    tensors: dict[str, torch.Tensor],
    *,
    mmap: bool,
    verify: bool = False,
) -> None:
    """Copy (or, with ``mmap``, map) every planned value into the model's tensors.

    Every stored tensor is staged first (:meth:`~weightvault.Checkpoint.stage`: reached,
    and with ``verify`` checksummed), so a load that fails changes nothing.

    Raises:
        LoadOptionError: ``mmap`` and a tensor is not on the CPU or needs a cast.
        FormatError: A stored tensor's bytes cannot be reached (checked before any copy).
        ChecksumError: ``verify`` and a tensor's bytes are damaged.
    """
    if mmap:
        _check_mmap(plan.assignments, tensors, ckpt.path)
    ckpt.stage(plan.reads(), verify)
    mapped: set[str] = set()
    with torch.no_grad():
        pending = []
        for a in plan.assignments:
            if ckpt.unchanged(a.stored):
                continue  # a walk's previous checkpoint put these very bytes there
            if not mmap and a.transform is None and ckpt.stored[a.stored].nbytes >= _THREADED:
                # Plain reads release the GIL; several run at once, like copy_ would.
                pending.append(_readers().submit(_assign_quietly, ckpt, a, tensors))
                continue
            # A second model tensor read from the same bytes (untied, or a copy) must
            # not share the mapping with the first, or writing one would change both.
            _assign(ckpt, a, tensors, mmap=mmap and a.stored not in mapped)
            mapped.add(a.stored)
        wait(pending)
        for future in pending:
            future.result()


#: The threads that copy into parameters, kept between loads: starting them anew cost
#: more than a small model's whole load.
_readers = LazyPool(READERS, "weightvault-load")


def _check_mmap(assignments: list[Assignment], tensors: dict[str, torch.Tensor], path: str) -> None:
    bad = [a.names[0] for a in assignments if a.cast or tensors[a.names[0]].device.type != "cpu"]
    if bad:
        raise LoadOptionError(
            f"{path}: mmap=True needs CPU tensors of the stored dtype, but "
            f"{capped(bad)} differ; load with mmap=False"
        )


def _assign(
    ckpt: Checkpoint, a: Assignment, tensors: dict[str, torch.Tensor], *, mmap: bool
) -> None:
    target = tensors[a.names[0]]
    if not mmap and a.transform is None and read_direct(ckpt, a.source, target):
        return
    source = read_tensor(ckpt, a.source, mmap=mmap)
    if a.transform is not None:
        source = source.permute(a.transform.axes_for(source.dim()))
    if mmap:
        target.data = source
    else:
        target.copy_(source)


def _assign_quietly(ckpt: Checkpoint, a: Assignment, tensors: dict[str, torch.Tensor]) -> None:
    # Grad mode is per thread: a worker does not inherit the caller's no_grad().
    with torch.no_grad():
        _assign(ckpt, a, tensors, mmap=False)


def read_direct(ckpt: Checkpoint, name: str, target: torch.Tensor) -> bool:
    """Read the bytes of ``name`` straight into ``target`` if the layouts allow it.

    One ``preadv`` from the page cache into the parameter's memory is several times
    faster than faulting in an mmap and copying from it (see docs/benchmarks.md).
    """
    e = ckpt.entry(name)
    if (
        e.view is not None
        or target.device.type != "cpu"
        or not target.is_contiguous()
        or target.numel() == 0
        or NAMES.get(target.dtype) != e.dtype
    ):
        return False
    # A contiguous tensor may still carry a stride other than 1 on a size-1 dimension
    # (``x[::2][:1]``), which ``view(torch.uint8)`` refuses: address its elements densely.
    flat = target.detach().as_strided((target.numel(),), (1,))
    buffer = memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]
    if not ckpt.read_into(e.stored, buffer):
        return False
    # Writing through numpy bypasses autograd's version counter; bump it as copy_ would,
    # so a graph that saved this tensor refuses to backpropagate through stale values.
    torch.autograd.graph.increment_version(target)
    return True


def tie(model: nn.Module, groups: list[tuple[str, ...]]) -> None:
    """Make the names of each group share the first name's Parameter (or buffer)."""
    for keep, *others in groups:
        shared = model.get_parameter(keep) if _is_param(model, keep) else model.get_buffer(keep)
        for name in others:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if isinstance(shared, nn.Parameter):
                setattr(owner, attr, shared)
            else:
                owner.register_buffer(attr, shared)


def _is_param(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def restore_requires_grad(tensors: dict[str, torch.Tensor], frozen: dict[str, bool]) -> None:
    """Set ``requires_grad`` from the file's frozen flags; a frozen tensor loses its grad."""
    for name, is_frozen in frozen.items():
        t = tensors[name]
        t.requires_grad_(not is_frozen)
        if is_frozen:
            t.grad = None
