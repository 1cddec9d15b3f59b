"""``weightvault vault ROOT log``'s figures: each checkpoint's raw bytes against what its
save wrote on disk, the footnotes that explain a derived figure, and the vault's total.

The figures come from :mod:`.._vault.records.usage`; this module only words them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from .._base.progress import human
from .._vault.records.usage import CheckpointUsage, VaultUsage

#: Marks an on-disk size derived from ``new_bytes`` (the record does not hold it).
DERIVED = "*"
#: Marks a checkpoint the compactor has not finished yet.
RAW = "~"


def notes(checkpoints: list[CheckpointUsage]) -> list[tuple[str, str]]:
    """The footnotes ``log`` owes its table: why a size is derived, why a ratio is ``-``."""
    out = []
    if any(not c.recorded for c in checkpoints):
        out.append(
            (DERIVED, "not in the record: these objects were written raw (before compression, "
             "or DCP chunks), so on disk = new")
        )  # fmt: skip
    if any(not c.compacted for c in checkpoints):
        out.append(
            (RAW, "not compacted yet: written raw (the compactor leaves the newest so until "
             "the next save, for a quick resume); 'weightvault vault ROOT compact' runs it")
        )  # fmt: skip
    if any(c.weights_only for c in checkpoints):
        out.append(
            ("-", "weights only: its training state was dropped after the save, so raw no "
             "longer counts what it wrote")
        )  # fmt: skip
    return out


def times(ratio: float) -> str:
    """A ratio as ``0.27x``."""
    return f"{ratio:.2f}x"


def summary(use: VaultUsage) -> str:
    """All checkpoints' raw bytes against what the vault takes on disk."""
    n = len(use.records)
    text = f"{n} checkpoint{'s' if n != 1 else ''}, {human(use.raw_bytes)} raw; the vault "
    text += f"takes {human(use.disk_bytes)} on disk"
    if use.ratio is not None:
        text += f" ({times(use.ratio)} of raw" + (
            f", {1 / use.ratio:.1f}x smaller)" if use.ratio < 1 else ")"
        )
    records = use.disk_bytes - use.object_bytes
    return text + f": {human(use.object_bytes)} of objects, {human(records)} of records"


def marked(marks: Mapping[str, str]) -> dict[str, list[str]]:
    """``{checkpoint: its labels}`` from ``{label: checkpoint}`` (``vault.marks()``)."""
    out: dict[str, list[str]] = {}
    for label, name in sorted(marks.items()):
        out.setdefault(name, []).append(label)
    return out


def log_doc(use: VaultUsage, marks: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``log --json``: each record with its bytes on disk and ratio, and the totals;
    ``labels`` lists the labels that name the checkpoint (``marks``, as
    ``vault.marks()`` gives them: a stale copy a crash left in another record is not)."""
    checkpoints = []
    held = marked(marks or {})
    for r, c in zip(use.records, use.checkpoints, strict=True):
        doc = asdict(r)
        doc.update(
            labels=held.get(r.name, []),
            raw_bytes=c.raw_bytes,
            written_bytes_recorded=c.recorded,
            disk_bytes=c.disk_bytes,
            compacted=c.compacted,
            ratio=c.ratio,
        )
        checkpoints.append(doc)
    total = {k: v for k, v in asdict(use).items() if k not in ("records", "checkpoints")}
    return {"checkpoints": checkpoints, "total": total}
