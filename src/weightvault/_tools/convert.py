"""Convert any supported checkpoint to a weightvault file, each distinct tensor once.

The source is opened by bytes (MXNet ``.params``, torch ``.pt``/``.bin``, Keras
``.weights.h5``, ``.npz``, safetensors); its names, optionally renamed, become
:class:`~weightvault._file.sharing.Source` records and go through the same
:func:`~weightvault._file.sharing.plan` and :func:`~weightvault._file.writer.save_sources`
as a save. Ties
and views the source records are kept. Copies are found by content: stored under every
name by default, so plain safetensors readers see them all, or stored once with
``dedupe_copies=True``, so a Gluon file saved with four copies of one layer is written
with one.

A Keras ``.weights.h5`` or ``.keras`` converted to a name ending in ``.h5`` or ``.keras``
stays a Keras file, which Keras still loads: each variable Keras wrote once per layer is
stored once, the other paths hard links to it (:mod:`weightvault.formats.keras_write`
says how equal datasets are told apart); equal constant datasets stay separate unless
``dedupe_copies``. ``rules`` and ``checksum`` do not apply there.
"""

from __future__ import annotations

import os
from collections.abc import Hashable

from .._base.errors import RuleError
from .._base.reports import SaveReport
from .._base.types import PathLike
from .._file import writer as _writer
from .._file.checkpoint import Checkpoint, Entry
from .._file.layout import is_training
from .._file.sharing import Source
from .._load import rules as _rules
from .._training.state import stored_name
from ..formats._registry import detect, opened

#: Keras' own formats, which convert rewrites as Keras files when the target is one too.
KERAS_KINDS = ("hdf5", "keras")
KERAS_TARGETS = (".h5", ".keras")


def _sources(ckpt: Checkpoint, rules: _rules.Rules) -> tuple[list[Source], list[str]]:
    """One source per kept name, renamed by ``rules``; also the names rules dropped."""
    sources: list[Source] = []
    dropped: list[str] = []
    taken: dict[str, str] = {}
    frozen = set(ckpt.manifest.frozen)
    for name in ckpt.names:
        new = _rules.rename(rules, name)
        if new is None:
            dropped.append(name)
            continue
        if new in taken:
            raise RuleError(
                f"{ckpt.path}: rules map both {taken[new]!r} and {name!r} to {new!r}; "
                "make the rules more specific so every name stays distinct"
            )
        taken[new] = name
        sources.append(_source(ckpt, ckpt.entry(name), new, name in frozen))
    return sources, dropped


def _source(ckpt: Checkpoint, e: Entry, name: str, frozen: bool) -> Source:
    stored = e.stored

    def whole() -> memoryview:
        return ckpt.raw(stored)

    def region(start: int, end: int) -> memoryview:
        return ckpt.raw(stored)[start:end]

    identity: Hashable = ("group", e.group)
    if ckpt.owns_memory(e):
        # A copy is its own tensor (with its aliases); plan() finds it again by content.
        identity = ("copy", e.group)
        if e.view is None:
            return Source(name, e.dtype, e.shape, identity, whole, frozen)
    if e.view is None:
        n = len(e.shape)
        stride = tuple(_c_strides(e.shape)) if n else ()
        return Source(
            name,
            e.dtype,
            e.shape,
            identity,
            whole,
            frozen,
            storage=("stored", stored) if ckpt.stored[stored].nbytes else None,
            stride=stride,
            region=region,
        )
    v = e.view

    def gathered() -> memoryview:
        from ..formats._common import strided

        return strided(ckpt.raw(stored), v.dtype, v.shape, v.stride, v.offset)

    if ckpt.owns_memory(e):
        return Source(name, v.dtype, v.shape, identity, gathered, frozen)
    return Source(
        name,
        v.dtype,
        v.shape,
        ("view", e.group),
        gathered,
        frozen,
        storage=("stored", stored),
        offset=v.offset,
        stride=v.stride,
        region=region,
    )


def _c_strides(shape: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return out[::-1]


def convert(
    src: PathLike | Checkpoint,
    dst: PathLike,
    *,
    rules: _rules.Rules = (),
    dry_run: bool = False,
    checksum: bool = True,
    dedupe_copies: bool = False,
    max_bytes: int | None = None,
) -> SaveReport:
    """Write ``src``, in any supported format, as a weightvault file at ``dst``.

    Every name is kept (renamed by ``rules``, or dropped by a ``None`` rule). Tensors the
    source shares stay shared. Tensors with equal dtype, shape and bytes (copies) are
    written under every name, so plain safetensors readers see each one; with
    ``dedupe_copies`` they are stored once and recorded as copies, and weightvault gives
    every name its own tensor again on load. A Keras file stays one (see the module).

    Args:
        src: The file to convert: MXNet ``.params``, torch ``.pt``/``.bin``, Keras
            ``.weights.h5``/``.keras``, ``.npz`` or safetensors, recognised by its bytes.
        dst: Where to write; replaced atomically.
        rules: ``(pattern, replacement)`` renames, such as
            :data:`weightvault.rules.MXNET_PREFIXES`.
        dry_run: Plan only; nothing is written and ``file_bytes`` is 0.
        checksum: Record an xxh3-64 checksum of every stored tensor.
        dedupe_copies: Store copies once. Plain safetensors readers (and
            ``from_pretrained``) then miss the copies' names; weightvault restores them.
        max_bytes: Most bytes that gathering views may allocate in all (a view is made
            contiguous to be compared or stored on its own). By default the larger of
            256 MiB and 16 times the source's size, so a tiny file of stride-0 views
            cannot cost gigabytes; raise it for a trusted file.

    Returns:
        What was stored, aliased and copied, and the bytes before and after.

    Raises:
        FormatError: ``src`` is malformed or in no supported format, or its views
            would exceed ``max_bytes``.
        RuleError: The rules are malformed or map two names to one.

    Example:
        >>> report = convert("shared_dense_default.params", "dense.safetensors",
        ...                  dedupe_copies=True)
        >>> len(report.copies), report.logical_bytes, report.stored_bytes
        (6, 66560, 16640)
    """
    checked = _rules.check(rules)
    if (kept := _keras_file(src, dst, checked, dedupe_copies, dry_run)) is not None:
        return kept
    with opened(src) as ckpt:
        _budget_views(ckpt, max_bytes)
        return rewrite(
            ckpt,
            dst,
            rules=checked,
            metadata=_provenance(ckpt),
            dry_run=dry_run,
            checksum=checksum,
            dedupe_copies=dedupe_copies,
        )


def _keras_file(
    src: PathLike | Checkpoint, dst: PathLike, rules: _rules.Rules, dedupe: bool, dry_run: bool
) -> SaveReport | None:
    """A Keras file rewritten as a Keras file, if both names say Keras (else ``None``)."""
    if not os.fspath(dst).lower().endswith(KERAS_TARGETS):
        return None
    # The CLI hands over the checkpoint it opened; a Keras file is rewritten from its path.
    path = src.path if isinstance(src, Checkpoint) else src
    if not os.path.isfile(path):
        return None
    kind = detect(path)
    if kind not in KERAS_KINDS:
        return None
    if rules:
        raise RuleError(
            f"{os.fspath(path)}: rules cannot rename the datasets of a Keras file, whose "
            "names are its layout; convert to a .safetensors name to rename"
        )
    from ..formats.keras_archive import rewrite_keras

    return rewrite_keras(path, dst, kind, dedupe_copies=dedupe, dry_run=dry_run)


def _budget_views(ckpt: Checkpoint, max_bytes: int | None) -> None:
    """Refuse a source whose views would gather more than ``max_bytes``.

    Stored tensors are passed on as they are; only views are gathered, at most a few
    times each (fingerprint, comparison, write).
    """
    gathered = sum(e.nbytes for e in ckpt.entries.values() if e.view is not None)
    ckpt.materializing(gathered, f"gathering {len(ckpt.manifest.views)} views", max_bytes)


def _provenance(ckpt: Checkpoint) -> dict[str, str]:
    """The converted file's metadata: the source's file name and format."""
    return {
        "converted_from": os.path.basename(ckpt.path),
        "source_format": str(getattr(ckpt, "format", None) or "safetensors"),
    }


def rewrite(
    ckpt: Checkpoint,
    dst: PathLike,
    *,
    metadata: dict[str, str],
    rules: _rules.Rules = (),
    dry_run: bool = False,
    checksum: bool = True,
    dedupe_copies: bool = False,
) -> SaveReport:
    """Write every name of an open checkpoint to ``dst``, re-planned like a save.

    Shared by :func:`convert` and ``Vault.export``: ties, views and frozen names are kept,
    and copies are stored again (or, with ``dedupe_copies``, once).
    """
    sources, dropped = _sources(ckpt, rules)
    training = ckpt.manifest.training
    if training is not None and not rules:
        # Optimizer, scheduler and RNG state travel with an unrenamed copy (an export).
        sources += _training_sources(ckpt)
    else:
        training = None
    return _writer.save_sources(
        dst,
        sources,
        framework=ckpt.framework,
        metadata=metadata,
        checksum=checksum,
        dedupe_copies=dedupe_copies,
        skipped=dropped,
        dry_run=dry_run,
        training=training,
    )


def _training_sources(ckpt: Checkpoint) -> list[Source]:
    """Optimizer, scheduler and RNG tensors, which are no model's names, as sources.

    An alias keeps its target's identity, so it stays an alias; a copy is read from the
    tensor it copies and is its own tensor again.
    """
    m = ckpt.manifest
    names = [n for n in [*ckpt.stored, *m.copies, *m.aliases] if is_training(n)]
    out: list[Source] = []
    for name in dict.fromkeys(names):
        stored = stored_name(ckpt, name)
        if stored is None:
            continue  # views are never training state; the loader reports what is missing
        info = ckpt.stored[stored]

        def data(stored: str = stored) -> memoryview:
            return ckpt.raw(stored)

        target = m.aliases.get(name, name)
        out.append(Source(name, info.dtype, info.shape, ("training", target), data))
    return out
