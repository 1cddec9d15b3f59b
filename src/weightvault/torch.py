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

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from ._base.errors import BackendNotInstalled

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise BackendNotInstalled(
        "weightvault.torch needs PyTorch: pip install 'weightvault[torch]'"
    ) from e

from ._base.reports import LoadReport, SaveReport
from ._base.snapshots import SaveHandle, SnapshotPool
from ._base.types import PathLike
from ._file.checkpoint import CheckpointSource
from ._file.sharing import Source
from ._load import rules as _rules
from ._load.plan import LoadOptions, RulesArg, Target, plan_load
from ._load.steps import save_file, values_by_group
from ._load.transforms import Transforms
from ._torch import assign as _assign, staging as _staging, state as _torch_state
from ._torch.sources import model_sources
from ._torch.tensors import (
    DTYPES as DTYPES,
    UnsupportedDtypeError as UnsupportedDtypeError,
    entry_tensor,
    stored_tensor,
)
from ._torch.wrappers import prefix_rules, unwrap, without_prefixes
from .formats._registry import opened

__all__ = ["freeze", "load", "load_file", "save", "trainable", "unfreeze"]

#: The ``"format"`` written into ``__metadata__``, as transformers expects.
FRAMEWORK = "pt"


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
    (the vault's) lends the buffers of the previous background save for the copies. A
    pool that defers copies trainable parameters and optimizer state only when the save
    stages it, and every optimizer step waits for that (:mod:`._torch.staging`).
    """
    copy: bool | SnapshotPool = False if snapshot is None else snapshot
    try:
        sources, skipped = model_sources(obj, snapshot=copy)
        extra, training = _torch_state.training_sources(
            obj, optimizer=optimizer, scheduler=scheduler, rng=rng, snapshot=copy
        )
    except BaseException:
        if snapshot is not None:
            snapshot.cancel()  # no save will stage what was queued
        raise
    if snapshot is not None:
        _staging.guard(snapshot)
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

    Names are ``state_dict`` names, aliases included; non-persistent buffers are left out.
    A model wrapped in ``torch.compile``, DDP or ``nn.DataParallel`` is saved under the
    names the model inside has, without ``_orig_mod.`` or ``module.``.
    Tied names become aliases (``{alias: kept}`` metadata, which plain safetensors readers
    honour); partial views of one storage are stored once and come back as views. Copies
    (separate tensors with equal bytes) are stored under every name by default, so plain
    readers (``load_model``, ``from_pretrained``) see the model weightvault sees. The file
    is a valid safetensors file, written atomically.

    Args:
        obj: An ``nn.Module`` or a ``{name: tensor}`` dict.
        path: Where to write. An existing file is replaced only once the new one is complete.
        metadata: Your own ``str -> str`` metadata, also in the header's ``__metadata__``.
        checksum: Record an xxh3-64 checksum of every stored tensor (costs ~5% of a save).
        dedupe_copies: Store copies once: smaller, but only weightvault sees their names.
        optimizer: Also store this optimizer's state and hyperparameters by parameter
            name (see docs/resuming.md).
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
        ReservedNameError: A name or metadata key is reserved (``__metadata__``, ``format``,
            ``weightvault``), or a metadata key is a tensor name.

    Example:
        >>> save(model, "model.safetensors", metadata={"step": "1000"}).aliases
        {'lm_head.weight': 'transformer.wte.weight'}
    """
    _settle()
    snapshot = SnapshotPool() if background else None  # fresh buffers: nothing to reuse
    found = checkpoint_sources(
        obj, optimizer=optimizer, scheduler=scheduler, rng=rng, snapshot=snapshot
    )
    write = partial(save_file, path, found, FRAMEWORK, metadata, checksum, dedupe_copies)
    return _in_background(write, path) if background else write()


def _settle() -> None:
    """Wait for the last background save: one save at a time, in order."""
    global _pending
    if _pending is not None:
        _pending.settle()
        _pending = None


def _in_background(write: Callable[[], SaveReport], path: PathLike) -> SaveHandle[SaveReport]:
    global _pending
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
        return values_by_group(
            ckpt,
            mmap,
            "tensors",
            max_bytes,
            verify,
            stored=lambda s: stored_tensor(ckpt, s, mmap=mmap),
            value=entry_tensor,
            own=torch.clone,
        )


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
    transforms: Transforms | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    rng: bool = False,
) -> LoadReport:
    """Fill ``model`` from ``path`` in place, all or nothing.

    Every check (names, shapes, dtypes, ties and, with ``verify``, checksums) runs before
    the first byte is copied, so a load that raises leaves the model exactly as it was.

    Args:
        model: The module to fill. Its own ties are kept. A ``torch.compile``, DDP or
            ``nn.DataParallel`` wrapper is seen through; a wrapper's prefix (``_orig_mod.``,
            ``module.``) that the model's names lack is stripped from the names on disk,
            and ``report.renamed`` says so.
        path: A weightvault file, any safetensors file (``{alias: kept}`` metadata is
            honoured), a foreign format weightvault reads, or an open checkpoint.
        strict: Raise on missing, unexpected or mismatched names (else only report them).
        rules: ``(pattern, replacement)`` renames of names on disk (``*`` captures,
            ``None`` drops), or ``"auto"`` to pair leftovers by dtype and shape.
        tie: Where the file ties names the model holds apart, make them share one tensor.
        restore_frozen: Set ``requires_grad`` of loaded parameters from the file.
        verify: Check the checksums of what is read first.
        cast: Allow dtypes to differ; values are converted.
        mmap: Point CPU parameters at the file mapping instead of copying (zero-copy,
            copy-on-write: the file is never modified).
        transforms: ``{pattern: transform}`` over the model's names, apart from ``rules``:
            ``{"*.weight": "transpose"}`` loads a Keras ``Dense.kernel``.
        optimizer: Also restore this optimizer's state and hyperparameters, matched by
            parameter name (``rules`` apply; order and groups may differ). See
            ``report.optimizer``.
        scheduler: Also restore this LR scheduler's state.
        rng: Also restore the torch, numpy and Python ``random`` RNG states.

    Returns:
        What was loaded, renamed, missing, unexpected, mismatched and untied.

    Raises:
        KeyMismatchError: ``strict`` and names disagree; the message proposes a rule.
        ShapeMismatchError: A shape or dtype differs.
        TieConflictError: The model ties names that the file holds with different values.
        ChecksumError: ``verify`` and a tensor's bytes are damaged.

    Example:
        >>> load(torch.compile(model), "ckpt.safetensors", rules=[("h.*", "blocks.*")]).missing
        []
    """
    options = LoadOptions(
        rules=rules, strict=strict, cast=cast, tie=tie, verify=verify, transforms=transforms
    )
    return _load(model, path, options, restore_frozen, mmap, optimizer, scheduler, rng)


def _load(
    model: nn.Module,
    path: CheckpointSource,
    options: LoadOptions,
    restore_frozen: bool,
    mmap: bool,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    rng: bool,
) -> LoadReport:
    model = unwrap(model)
    targets, tensors = _assign.targets(model)
    with opened(path) as ckpt:
        options = _accept_wrapped(ckpt.names, targets, options)
        lp = plan_load(ckpt, targets, options, type(model).__name__)
        # Training state is read and checked before the first weight is copied too.
        prepared = _torch_state.prepare(
            ckpt, model, lp, options, optimizer=optimizer, scheduler=scheduler, rng=rng
        )
        _staging.wait_staged()  # a background vault save may still be copying them
        _assign.assign_all(ckpt, lp, tensors, mmap=mmap, verify=options.verify)
        if options.tie:
            _assign.tie(model, lp.tie)
    if restore_frozen:
        _assign.restore_requires_grad(tensors, lp.frozen)
        lp.report_frozen()
    prepared.apply(lp.report)
    return lp.report


def _accept_wrapped(disk: list[str], targets: list[Target], options: LoadOptions) -> LoadOptions:
    """``options`` whose rules also strip the wrapper prefixes of a file saved before
    weightvault unwrapped models (``_orig_mod.``, ``module.``), if the model lacks them.

    ``rules="auto"`` needs none: such names differ from the model's only by a prefix they
    all share, which is what it pairs by.
    """
    if options.rules == "auto":
        return options
    rules = prefix_rules(disk, (t.name for t in targets), _rules.check(options.rules))
    return dataclasses.replace(options, rules=rules)


def _params_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def _select(model: nn.Module, patterns: Iterable[str], verb: str) -> dict[str, nn.Parameter]:
    # The names a checkpoint stores: those of the model inside torch.compile, DDP and
    # DataParallel. A pattern written with a wrapper's prefix still means the same names.
    model = unwrap(model)
    params = _params_by_name(model)
    pats = [without_prefixes(p) for p in patterns] or ["*"]
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
        model: The module, or a ``torch.compile``, DDP or ``DataParallel`` wrapper of it.
        *patterns: Names or ``*`` patterns (``"encoder.*"``); a bare module name such as
            ``"encoder"`` means everything under it. Names are the model's own, as a
            checkpoint stores them (a wrapper's ``module.``/``_orig_mod.`` prefix in a
            pattern is ignored).
        optimizer: An optimizer that already holds the parameters.

    Returns:
        Every name frozen, aliases included, under the model's own names.

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


# -- the adapter contract (weightvault._vault.adapters.Adapter), used by the vault --------------


def owns(obj: Any) -> bool:
    """Whether ``obj`` is an ``nn.Module`` or a dict holding torch tensors."""
    if isinstance(obj, Mapping):
        return any(isinstance(v, torch.Tensor) for v in obj.values())
    return isinstance(obj, nn.Module)


def sources(obj: Any) -> tuple[list[Source], list[str]]:
    """``(sources, skipped)`` of a module or tensor dict, as :func:`save` would store them."""
    return model_sources(obj)
