"""Save and load PyTorch models and tensor dicts, with ties, copies, views and freezing.

Example:
    >>> import torch.nn as nn, weightvault.torch as wv
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    >>> model[1].weight = model[0].weight          # tie
    >>> report = wv.save(model, "m.safetensors")   # the weight is stored once
    >>> wv.load(model, "m.safetensors").loaded
    ['0.weight', '0.bias', '1.weight', '1.bias']
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ._base.errors import BackendNotInstalled, UnsupportedValueError, capped

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise BackendNotInstalled(
        "weightvault.torch needs PyTorch: pip install 'weightvault[torch]'"
    ) from e

from ._base.background import SaveHandle, SnapshotPool
from ._base.errors import LoadOptionError
from ._base.reports import LoadReport, SaveReport
from ._base.types import PathLike
from ._file import writer as _writer
from ._file.checkpoint import Checkpoint, CheckpointSource
from ._file.sharing import Source
from ._load import rules as _rules, transforms as _transforms
from ._load.plan import Assignment, RulesArg, Target, plan_load
from ._torch.tensors import (
    DTYPES as DTYPES,
    NAMES,
    UnsupportedDtypeError as UnsupportedDtypeError,
    _base,
    _layout_identity,
    _read,
    _source,
    _value,
)
from .formats._registry import opened

__all__ = ["freeze", "load", "load_file", "save", "trainable", "unfreeze"]

#: Threads that copy bytes into parameters during a load (reads release the GIL).
_READERS = min(4, os.cpu_count() or 1)

#: The ``"format"`` written into ``__metadata__``, as transformers expects.
FRAMEWORK = "pt"


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


def _copy_storage(storage: torch.UntypedStorage, pool: SnapshotPool | None) -> Any:
    """A copy of ``storage``, into a buffer of the previous snapshot when there is one."""
    if pool is None:
        return storage.clone()  # type: ignore[no-untyped-call]
    return pool.copy(
        (str(storage.device), storage.nbytes()),
        storage.clone,
        lambda buffer: buffer.copy_(storage),
    )


def _snapshot(
    t: torch.Tensor, copies: dict[Any, torch.UntypedStorage], pool: SnapshotPool | None = None
) -> torch.Tensor:
    """A tensor with ``t``'s layout over a copy of its storage (one copy per storage)."""
    storage = t.untyped_storage()
    key = (str(t.device), storage.data_ptr())
    if key not in copies:
        copies[key] = _copy_storage(storage, pool)
    twin = torch.empty(0, dtype=t.dtype, device=t.device)
    return twin.set_(copies[key], t.storage_offset(), t.shape, t.stride())


def _sources(
    obj: nn.Module | Mapping[str, torch.Tensor], *, snapshot: bool | SnapshotPool = False
) -> tuple[list[Source], list[str]]:
    """The model's tensors as sources; with ``snapshot``, read from copies taken now.

    A snapshot copies every tensor that training can change: all but frozen parameters
    (``requires_grad=False``), which are read live when the background save writes them.
    """
    copies: dict[Any, torch.UntypedStorage] = {}
    skipped: list[str] = []
    sources: list[Source] = []
    if isinstance(obj, nn.Module):
        state = obj.state_dict(keep_vars=True)
    elif isinstance(obj, Mapping):
        state = dict(obj)
        for name, value in state.items():
            _check_value(name, value)
    else:
        raise TypeError(f"save() takes an nn.Module or a dict of tensors, not {type(obj).__name__}")
    resolved: dict[Any, torch.Tensor] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            # A module's extra state (get_extra_state) is no tensor; it is reported.
            skipped.append(name)
            continue
        _check_value(name, value)
        frozen = isinstance(value, nn.Parameter) and not value.requires_grad
        # Same memory with the same layout is one tensor, whether or not it is one object.
        identity = _layout_identity(value)
        twin = None
        if value.is_conj() or value.is_neg():
            # Its bytes are not its values: plan the resolved values, once per identity so
            # that two names of one lazy tensor stay one (an alias). The resolved tensor is
            # already a private copy, so a background save needs no snapshot of it.
            if identity not in resolved:
                resolved[identity] = value.detach().resolve_conj().resolve_neg()
            value = resolved[identity]
        elif snapshot and not frozen and value.numel() > 0 and value.device.type != "meta":
            pool = snapshot if isinstance(snapshot, SnapshotPool) else None
            twin = _snapshot(value.detach(), copies, pool)
        sources.append(_source(name, value, identity, frozen, twin))
    return sources, skipped


def checkpoint_sources(
    obj: nn.Module | Mapping[str, torch.Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    rng: bool = False,
    snapshot: SnapshotPool | None = None,
) -> tuple[list[Source], list[str], dict[str, Any] | None]:
    """Model, optimizer, scheduler and RNG as sources plus the manifest's training section.

    With ``snapshot``, what training can change is copied now; a :class:`SnapshotPool`
    (the vault's) lends the buffers of the previous background save for the copies.
    """
    from ._torch import state as _torch_state

    copy: bool | SnapshotPool = False if snapshot is None else snapshot
    sources, skipped = _sources(obj, snapshot=copy)
    extra, training = _torch_state.training_sources(
        obj, optimizer=optimizer, scheduler=scheduler, rng=rng, snapshot=copy
    )
    return sources + extra, skipped, training


def save(
    obj: nn.Module | Mapping[str, torch.Tensor],
    path: PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    checksum: bool = True,
    dedupe_copies: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    rng: bool = False,
    background: bool = False,
) -> Any:
    """Save a module or a dict of tensors, storing every tied tensor once.

    Names are ``state_dict`` names, every alias included; non-persistent buffers are left
    out. Tied names become aliases (listed as ``{alias: kept}`` metadata, which plain
    safetensors readers honour), and partial views of one storage are stored once and come
    back as views. Separate tensors with equal bytes (copies) are stored under every
    name by default, so plain readers (``safetensors.torch.load_model``,
    ``from_pretrained``) see the same model as weightvault. The file is a valid
    safetensors file and is written atomically.

    Args:
        obj: An ``nn.Module`` or a ``{name: tensor}`` dict.
        path: Where to write. An existing file is replaced only once the new one is complete.
        metadata: Your own ``str -> str`` metadata: in the manifest and in the header's
            ``__metadata__``, where ``safe_open(path, "pt").metadata()`` shows it.
        checksum: Record an xxh3-64 checksum of every stored tensor (costs ~5% of a save).
        dedupe_copies: Store equal but separate tensors once. Smaller, but plain
            safetensors readers then miss the copies' names; only weightvault restores them.
        optimizer: Also store this optimizer's state, by parameter name, and its groups'
            hyperparameters (see docs/resuming.md).
        scheduler: Also store this LR scheduler's ``state_dict()`` (as JSON).
        rng: Also store the torch (CPU and CUDA), numpy and Python ``random`` RNG states.
        background: Copy what training can change now and write in a thread; returns a
            :class:`~weightvault.SaveHandle` whose ``wait()`` gives the report. A second
            save waits for the first.

    Returns:
        What was stored, aliased and copied, and the bytes saved (a
        :class:`~weightvault.SaveHandle` of it with ``background=True``).

    Raises:
        UnsupportedValueError: A dict value is not a tensor, or a tensor is sparse.
        ReservedNameError: A name is ``__metadata__``, or a metadata key is reserved
            (``format``, ``weightvault``) or a tensor name.

    Example:
        >>> report = save(model, "model.safetensors", metadata={"step": "1000"})
        >>> report.aliases
        {'lm_head.weight': 'transformer.wte.weight'}
    """
    global _pending
    if _pending is not None:
        _pending.settle()  # one save at a time, in order
        _pending = None
    sources, skipped, training = checkpoint_sources(
        obj,
        optimizer=optimizer,
        scheduler=scheduler,
        rng=rng,
        snapshot=SnapshotPool() if background else None,  # fresh buffers: nothing to reuse
    )

    def write() -> SaveReport:
        return _writer.save_sources(
            path,
            sources,
            framework=FRAMEWORK,
            metadata=dict(metadata or {}),
            checksum=checksum,
            dedupe_copies=dedupe_copies,
            skipped=skipped,
            training=training,
        )

    if not background:
        return write()
    _pending = SaveHandle(write, f"save {os.fspath(path)}")
    return _pending


#: The last background file save; the next save waits for it.
_pending: SaveHandle[SaveReport] | None = None


def load_file(
    path: CheckpointSource,
    *,
    mmap: bool = False,
    verify: bool = False,
    max_bytes: int | None = None,
) -> dict[str, torch.Tensor]:
    """Read every name in ``path`` as a tensor.

    Aliases come back as one shared tensor, copies as separate tensors with equal values,
    and views as views of their base.

    Args:
        path: A weightvault or plain safetensors file.
        mmap: Return tensors backed by the file mapping (copy-on-write: writes never reach
            the file). Nothing is read until used; best for inference.
        verify: Check every checksum first.
        max_bytes: Most bytes the tensors may take (stored tensors unless ``mmap``, and
            every copy). By default the larger of 256 MiB and 16 times the file's size,
            so that a tiny hostile file whose copies describe gigabytes is refused before
            anything is allocated; raise it for a trusted file that expands that much.

    Raises:
        FormatError: The file is not a valid checkpoint, or would exceed ``max_bytes``.
        ChecksumError: ``verify`` and a tensor's bytes are damaged.

    Example:
        >>> tensors = load_file("model.safetensors")
        >>> tensors["lm_head.weight"] is tensors["transformer.wte.weight"]
        True
    """
    with opened(path) as ckpt:
        # Views are views of their base and aliases share one tensor; what allocates is
        # every base read without mmap and every copy.
        copies = {e.group: e.nbytes for e in ckpt.entries.values() if ckpt.owns_memory(e)}
        cost = sum(copies.values())
        if not mmap:
            cost += sum(t.nbytes for t in ckpt.stored.values())
        ckpt.materializing(cost, f"reading {len(ckpt.names)} tensors", max_bytes)
        if verify:
            ckpt.verify()
        bases = {s: _base(ckpt, s, mmap=mmap) for s in ckpt.stored}
        out: dict[str, torch.Tensor] = {}
        groups: dict[str, torch.Tensor] = {}
        for name in ckpt.names:
            e = ckpt.entry(name)
            if e.group not in groups:
                value = _value(ckpt, e, bases[e.stored])
                # A copy is a tensor of its own (shared only with its aliases).
                groups[e.group] = value.clone() if ckpt.owns_memory(e) else value
            out[name] = groups[e.group]
        return out


def _targets(model: nn.Module) -> tuple[list[Target], dict[str, torch.Tensor]]:
    state = model.state_dict(keep_vars=True)
    targets: list[Target] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        tensors[name] = t
        targets.append(
            Target(
                name,
                id(t),
                NAMES.get(t.dtype, str(t.dtype)),
                tuple(t.shape),
                is_param=isinstance(t, nn.Parameter),
            )
        )
    return targets, tensors


def load(
    model: nn.Module,
    path: CheckpointSource,
    *,
    strict: bool = True,
    rules: RulesArg = (),
    tie: bool = False,
    restore_frozen: bool = False,
    verify: bool = False,
    cast: bool = False,
    mmap: bool = False,
    transforms: _transforms.Transforms | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    rng: bool = False,
) -> LoadReport:
    """Fill ``model`` from ``path`` in place, all or nothing.

    Every check (names, shapes, dtypes, ties and, with ``verify``, checksums) runs before
    the first byte is copied, so a load that raises leaves the model exactly as it was.

    Args:
        model: The module to fill. Its own ties are kept.
        path: A weightvault file or any safetensors file (``{alias: kept}`` metadata is
            honoured).
        strict: Raise on missing, unexpected or mismatched names. With ``False`` they are
            only reported.
        rules: ``(pattern, replacement)`` pairs that rename names on disk (``*`` captures,
            ``None`` drops), or ``"auto"`` to pair leftovers by dtype and shape.
        tie: Where the file ties names the model holds apart, make the model share one
            Parameter instead of filling both.
        restore_frozen: Set ``requires_grad`` of loaded parameters from the file's frozen
            record.
        verify: Check the checksums of everything to be read first.
        cast: Allow dtypes to differ; values are converted.
        mmap: Point parameters at the file mapping instead of copying (zero-copy, for
            inference; copy-on-write so the file is never modified). CPU only.
        transforms: ``{pattern: transform}`` that rearrange values before they are
            copied, matched against the model's names: ``{"*.weight": "transpose"}``
            loads a Keras ``Dense.kernel`` ``(in, out)`` into ``Linear.weight``
            ``(out, in)``. See :mod:`weightvault._transforms`; kept apart from ``rules``.
        optimizer: Also restore this optimizer's state and hyperparameters, matched by
            parameter name (``rules`` apply), so the parameters' order and groups may
            differ from the saved optimizer's. ``strict`` applies; see ``report.optimizer``.
        scheduler: Also restore this LR scheduler's state.
        rng: Also restore the torch, numpy and Python ``random`` RNG states.

    Returns:
        A report of what was loaded, renamed, missing, unexpected, mismatched and untied.

    Raises:
        KeyMismatchError: ``strict`` and names disagree; the message proposes a rule.
        ShapeMismatchError: A shape or dtype differs.
        TieConflictError: The model ties names that the file holds with different values.
        ChecksumError: ``verify`` and a tensor's bytes are damaged.

    Example:
        >>> report = load(model, "ckpt.safetensors", rules=[("_orig_mod.*", "*")])
        >>> report.missing, report.unexpected
        ([], [])
    """
    targets, tensors = _targets(model)
    pairs = _transforms.check(transforms)
    with opened(path) as ckpt:

        def equal(a: str, b: str) -> bool:
            return bool(torch.equal(_read(ckpt, a), _read(ckpt, b)))

        lp = plan_load(
            ckpt,
            targets,
            rules=rules,
            strict=strict,
            cast=cast,
            tie=tie,
            equal=equal,
            label=type(model).__name__,
            shape_of=_transforms.shape_hook(transforms),
        )
        from ._torch import state as _torch_state

        # Training state is read and checked before the first weight is copied too.
        prepared = _torch_state.prepare(
            ckpt,
            model,
            optimizer=optimizer,
            scheduler=scheduler,
            rng=rng,
            rules=rules,
            renamed=lp.report.renamed,
            strict=strict,
            verify=verify,
        )
        needed = sorted({ckpt.entry(a.source).stored for a in lp.assignments})
        if verify:
            ckpt.verify(needed)
        for stored in needed:
            ckpt.raw(stored)  # every byte must be reachable before the first copy
        if mmap:
            _check_mmap(lp.assignments, tensors, ckpt.path)
        mapped: set[str] = set()
        with torch.no_grad(), ThreadPoolExecutor(_READERS) as readers:
            pending = []
            for a in lp.assignments:
                transform = _transforms.resolve(pairs, a.names)
                if not mmap and transform is None:
                    # Plain reads release the GIL; several run at once, like copy_ would.
                    pending.append(readers.submit(_assign_quietly, ckpt, a, tensors))
                    continue
                # A second model tensor read from the same bytes (untied, or a copy) must
                # not share the mapping with the first, or writing one would change both.
                stored = ckpt.entry(a.source).stored
                _assign(ckpt, a, tensors, mmap=mmap and stored not in mapped, transform=transform)
                mapped.add(stored)
            for future in pending:
                future.result()
        if tie:
            _tie(model, lp.tie)
    if restore_frozen:
        for name, frozen in lp.frozen.items():
            t = tensors[name]
            t.requires_grad_(not frozen)
            if frozen:
                t.grad = None
        lp.report.frozen = [n for n, f in lp.frozen.items() if f]
    prepared.apply(lp.report)
    return lp.report


def _check_mmap(assignments: list[Assignment], tensors: dict[str, torch.Tensor], path: str) -> None:
    bad = [a.names[0] for a in assignments if a.cast or tensors[a.names[0]].device.type != "cpu"]
    if bad:
        raise LoadOptionError(
            f"{path}: mmap=True needs CPU tensors of the stored dtype, but "
            f"{capped(bad)} differ; load with mmap=False"
        )


def _assign(
    ckpt: Checkpoint,
    a: Assignment,
    tensors: dict[str, torch.Tensor],
    *,
    mmap: bool,
    transform: _transforms.Permute | None = None,
) -> None:
    target = tensors[a.names[0]]
    if not mmap and transform is None and _read_direct(ckpt, a.source, target):
        return
    source = _read(ckpt, a.source, mmap=mmap)
    if transform is not None:
        source = source.permute(transform.axes_for(source.dim()))
    if mmap:
        target.data = source
    else:
        target.copy_(source)


def _assign_quietly(ckpt: Checkpoint, a: Assignment, tensors: dict[str, torch.Tensor]) -> None:
    # Grad mode is per thread: a worker does not inherit the caller's no_grad().
    with torch.no_grad():
        _assign(ckpt, a, tensors, mmap=False)


def _read_direct(ckpt: Checkpoint, name: str, target: torch.Tensor) -> bool:
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
    buffer = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    if not ckpt.read_into(e.stored, buffer):
        return False
    # Writing through numpy bypasses autograd's version counter; bump it as copy_ would,
    # so a graph that saved this tensor refuses to backpropagate through stale values.
    torch.autograd.graph.increment_version(target)
    return True


def _tie(model: nn.Module, groups: list[tuple[str, ...]]) -> None:
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


def _params_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def _select(model: nn.Module, patterns: Iterable[str], verb: str) -> dict[str, nn.Parameter]:
    params = _params_by_name(model)
    pats = list(patterns) or ["*"]
    chosen: dict[int, nn.Parameter] = {}
    names = list(params)
    for pat in pats:
        hits = _rules.select(pat, names, ".")
        if not hits:
            what = f"parameter of {type(model).__name__}"
            raise _rules.unmatched(verb, pat, names, what, ".")
        for n in hits:
            chosen[id(params[n])] = params[n]
    # Every name of a chosen tensor, so a tie is frozen through all of its names.
    return {n: p for n, p in params.items() if id(p) in chosen}


def freeze(
    model: nn.Module, *patterns: str, optimizer: torch.optim.Optimizer | None = None
) -> list[str]:
    """Freeze the parameters whose names match ``patterns`` (all if none are given).

    A pattern matches any name of a parameter, aliases included, so freezing one name of
    a tied tensor freezes all of them. Each frozen parameter gets ``requires_grad=False``
    and loses its ``.grad``, so it costs no gradient memory. With ``optimizer``, it is also
    removed from the optimizer's groups with its state, so momentum and weight decay
    never move it again.

    Args:
        model: The module.
        *patterns: Names or ``*`` patterns (``"encoder.*"``); a bare module name such as
            ``"encoder"`` means everything under it.
        optimizer: An optimizer that already holds the parameters.

    Returns:
        Every name frozen, aliases included.

    Example:
        >>> freeze(model, "transformer.h.*", "transformer.wte")
        ['transformer.wte.weight', ..., 'lm_head.weight']
    """
    chosen = _select(model, patterns, "freeze")
    for p in chosen.values():
        p.requires_grad_(False)
        p.grad = None
    if optimizer is not None:
        ids = {id(p) for p in chosen.values()}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        for p in chosen.values():
            optimizer.state.pop(p, None)
    return list(chosen)


def unfreeze(model: nn.Module, *patterns: str) -> list[str]:
    """Make the parameters matching ``patterns`` trainable again; return every name.

    Remember to give them to an optimizer: ``opt.add_param_group({"params": [...]})``.
    """
    chosen = _select(model, patterns, "unfreeze")
    for p in chosen.values():
        p.requires_grad_(True)
    return list(chosen)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """Each trainable parameter once, in model order: what an optimizer should get.

    Example:
        >>> opt = torch.optim.AdamW(trainable(model), lr=1e-4, weight_decay=0.1)
    """
    return [p for p in model.parameters() if p.requires_grad]


# -- the adapter contract (weightvault._adapters.Adapter), used by the vault --------------


def owns(obj: Any) -> bool:
    """Whether ``obj`` is an ``nn.Module`` or a dict holding torch tensors."""
    if isinstance(obj, Mapping):
        return any(isinstance(v, torch.Tensor) for v in obj.values())
    return isinstance(obj, nn.Module)


def sources(obj: Any) -> tuple[list[Source], list[str]]:
    """``(sources, skipped)`` of a module or tensor dict, as :func:`save` would store them."""
    return _sources(obj)
