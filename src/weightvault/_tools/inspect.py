"""Framework-free questions about files: what is in it, is it intact, how do two differ."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from .._base.dtypes import describe, numel
from .._base.errors import FormatError
from .._base.types import PathLike
from .._file.checkpoint import Checkpoint, CheckpointSource, SafetensorsFile, materialize_limit
from .._file.layout import is_training
from .._file.sharing import same_bytes
from ..formats._registry import open_checkpoint, opened


@dataclass(frozen=True)
class TensorRecord:
    """One name in a file: how it is held and what it looks like."""

    name: str
    kind: str  # "stored", "alias", "copy" or "view"
    stored: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class Inspection:
    """What a file holds, read from its header alone.

    Attributes:
        names: Every name, aliases, copies and views included, in the model's order.
        stored: Names physically stored.
        aliases: ``{alias: kept_name}``.
        copies: ``{copy: stored_name}``.
        views: Names stored as views into another tensor.
        frozen: Names saved as frozen.
        logical_bytes: Bytes if every name were written out.
        stored_bytes: Tensor bytes in the file.
        metadata: Your metadata (for a plain safetensors file: its ``__metadata__``).
        tensors: A :class:`TensorRecord` per name.
        shared_storage: Bytes of each stored region that only views read (no model name).
        container: ``"safetensors"``, ``"vault"``, or the foreign format read
            (``"mxnet"``, ``"torch"``, ``"numpy"``, ...).
        training_bytes: Stored bytes of optimizer, scheduler and RNG state (no model name).
        duplicates: ``{stored_name: equal_name}`` for copies stored under their own name
            (saved with ``dedupe_copies=False``, the default), so plain readers see them.
            Recorded when the file was written; files from other writers list none.
    """

    path: str
    names: list[str]
    stored: list[str]
    aliases: dict[str, str]
    copies: dict[str, str]
    views: list[str]
    frozen: list[str]
    logical_bytes: int
    stored_bytes: int
    file_bytes: int
    metadata: dict[str, str]
    tensors: dict[str, TensorRecord]
    format_version: int | None
    checksum: str | None
    framework: str | None
    shared_storage: dict[str, int] = field(default_factory=dict)
    container: str = "safetensors"
    duplicates: dict[str, str] = field(default_factory=dict)
    training_bytes: int = 0

    @property
    def bytes_saved(self) -> int:
        """Model bytes that sharing left out; training state is no model name, so its
        bytes count on neither side."""
        return self.logical_bytes - (self.stored_bytes - self.training_bytes)

    @property
    def dedupe_savings(self) -> int:
        """Tensor bytes that saving with ``dedupe_copies=True`` would leave out."""
        # Training state (optimizer slots such as AdamW's equal "step" scalars) can be
        # duplicates too; it is no model name, so it has no record here.
        return sum(self.tensors[n].nbytes for n in self.duplicates if n in self.tensors)


def _inspection(ckpt: Checkpoint) -> Inspection:
    records = {
        n: TensorRecord(n, e.kind, e.stored, e.dtype, e.shape, e.nbytes)
        for n, e in ckpt.entries.items()
    }
    m = ckpt.manifest
    return Inspection(
        path=ckpt.path,
        names=ckpt.names,
        stored=list(ckpt.stored),
        aliases=dict(m.aliases),
        copies=dict(m.copies),
        views=list(m.views),
        frozen=list(m.frozen),
        logical_bytes=sum(r.nbytes for r in records.values()),
        stored_bytes=sum(t.nbytes for t in ckpt.stored.values()),
        file_bytes=ckpt.size,
        metadata=dict(m.metadata),
        tensors=records,
        format_version=m.version if m.ours else None,
        checksum=m.checksum,
        framework=ckpt.framework,
        shared_storage={
            n: t.nbytes
            for n, t in ckpt.stored.items()
            if ckpt.is_internal(n) and not is_training(n)
        },
        container=ckpt.container,
        duplicates=dict(m.duplicates),
        training_bytes=sum(t.nbytes for n, t in ckpt.stored.items() if is_training(n)),
    )


def inspect(path: CheckpointSource) -> Inspection:
    """Describe a checkpoint from its header, without reading tensor bytes.

    An open :class:`Checkpoint` (a vault's, for example) is described as it is, and
    stays open.

    Example:
        >>> info = inspect("model.safetensors")
        >>> info.aliases
        {'lm_head.weight': 'transformer.wte.weight'}
        >>> info.logical_bytes - info.stored_bytes   # saved by deduplication
        154389504
    """
    with opened(path) as ckpt:
        return _inspection(ckpt)


@dataclass
class VerifyReport:
    """The result of :func:`verify`: ``ok`` and one line per problem, naming the tensor.

    Attributes:
        has_checksums: Whether the tensors' bytes carry checksums.
        has_header_sum: Whether the header carries its checksum (every file weightvault
            writes; not files written before header checksums, nor other writers' files)
            and it matched. A file without one is still ``ok``: its header is unchecked.
    """

    path: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    checked: int = 0
    has_checksums: bool = True
    has_header_sum: bool = False


def verify(path: PathLike, *, progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check a file's structure, its header's checksum and every stored tensor's checksum.

    The header's checksum is checked as the file is opened, as every load does: a
    damaged header is a problem naming the header, and nothing past it is read.

    A structurally broken file is reported, not raised, so a caller can treat every kind
    of damage alike.

    Example:
        >>> report = verify("model.safetensors")
        >>> report.ok, report.problems
        (False, ["checksum mismatch in 'transformer.h.3.mlp.c_fc.weight'"])
    """
    where = os.fspath(path)
    try:
        ckpt = open_checkpoint(path)
    except (FormatError, OSError) as e:
        return VerifyReport(where, False, [str(e)])
    except Exception as e:
        # Every reader should raise FormatError for damage; should one not, the file is
        # still reported as unreadable rather than crashing a caller that asked to check.
        detail = " ".join(str(e)[:300].split())
        return VerifyReport(where, False, [f"{where}: unreadable ({type(e).__name__}: {detail})"])
    with ckpt:
        problems = []
        for name, info in ckpt.stored.items():
            try:
                good = ckpt.check(name)
            except (FormatError, OSError) as e:
                # The file shrank or failed to read after its header was validated.
                problems.append(str(e))
                break
            except Exception as e:
                detail = " ".join(str(e)[:300].split())
                problems.append(
                    f"{where}: tensor {name!r}: unreadable ({type(e).__name__}: {detail})"
                )
                break
            if not good:
                problems.append(
                    f"checksum mismatch in {name!r} ({describe(info.dtype, info.shape)})"
                )
            if progress is not None:
                progress(info.nbytes)
        return VerifyReport(
            where,
            not problems,
            problems,
            checked=len(ckpt.stored) if ckpt.manifest.checksum else 0,
            has_checksums=ckpt.manifest.checksum is not None,
            has_header_sum=isinstance(ckpt, SafetensorsFile) and ckpt.header.sealed,
        )


@dataclass
class DiffReport:
    """How file ``b`` differs from file ``a``.

    Attributes:
        added: Names only in ``b``.
        removed: Names only in ``a``.
        changed: ``(name, max_abs_diff)``; the difference is ``None`` without numpy.
        reshaped: ``(name, in_a, in_b)`` for names whose dtype or shape differ.
        same: How many names are identical.
    """

    a: str
    b: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[tuple[str, float | None]] = field(default_factory=list)
    reshaped: list[tuple[str, str, str]] = field(default_factory=list)
    same: int = 0

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed or self.reshaped)


def diff(a: CheckpointSource, b: CheckpointSource) -> DiffReport:
    """Compare two checkpoints name by name.

    Example:
        >>> d = diff("step100.safetensors", "step200.safetensors")
        >>> d.changed[:1]
        [('lm_head.weight', 0.0123)]
    """
    with opened(a) as ca, opened(b) as cb:
        out = DiffReport(ca.path, cb.path)
        # Differences are computed in float64; a stride-0 view of a few bytes may stand
        # for gigabytes of values, so what the comparison would allocate is capped.
        cap, spent = materialize_limit(ca.size + cb.size), 0
        names_b = set(cb.names)
        out.removed = [n for n in ca.names if n not in names_b]
        names_a = set(ca.names)
        out.added = [n for n in cb.names if n not in names_a]
        for name in ca.names:
            if name not in names_b:
                continue
            ea, eb = ca.entry(name), cb.entry(name)
            if (ea.dtype, ea.shape) != (eb.dtype, eb.shape):
                out.reshaped.append(
                    (name, describe(ea.dtype, ea.shape), describe(eb.dtype, eb.shape))
                )
                continue
            if ea.view is None and eb.view is None:
                if same_bytes(ca.raw(ea.stored), cb.raw(eb.stored)):
                    out.same += 1
                    continue
                spent += 32 * numel(ea.shape)
                ca.materializing(spent, f"comparing {name!r} with {cb.path}", cap)
                out.changed.append((name, _max_abs(ca, cb, name)))
            else:
                spent += 32 * numel(ea.shape)
                ca.materializing(spent, f"comparing {name!r} with {cb.path}", cap)
                delta = _max_abs(ca, cb, name)
                if delta == 0.0:
                    out.same += 1
                else:
                    out.changed.append((name, delta))
        return out


def _max_abs(ca: Checkpoint, cb: Checkpoint, name: str) -> float | None:
    try:
        import numpy as np
    except ImportError:
        return None
    from .._file.arrays import as_numpy

    x, y = as_numpy(ca, name), as_numpy(cb, name)
    if x.size == 0:
        return 0.0
    if x.dtype == bool:
        return float(np.count_nonzero(x != y) > 0)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(x.astype(np.complex128 if x.dtype.kind == "c" else np.float64) - y)
    return float(np.nanmax(d)) if not np.all(np.isnan(d)) else float("nan")
