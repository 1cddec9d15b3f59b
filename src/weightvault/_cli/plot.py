"""``weightvault vault ROOT plot``: bytes on disk, vault versus separate files.

The top panel draws cumulative bytes after each checkpoint: the checkpoints as separate
files (their raw bytes), the vault's new objects uncompressed (what deduplication alone
saves), and what the vault wrote on disk (compressed objects and deltas). The bottom
panel draws each checkpoint's raw bytes beside what its save wrote. The figures are
those of the records (:mod:`.._vault.records.usage`): what each save wrote, including objects a
gc freed since.

The x axis is the training step when every checkpoint records one in its metadata
(``step``, ``global_step`` from the Hugging Face callback, ``keras.step`` from the Keras
callback), and the checkpoint's position otherwise.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .._base.errors import BackendNotInstalled
from .._base.progress import human
from .._vault.records.record import CheckpointRecord
from .._vault.records.usage import vault_usage
from .._vault.vault import Vault

#: Metadata keys that hold a checkpoint's training step, tried in this order.
STEP_KEYS = ("step", "global_step", "keras.step")
#: Tick labels longer than this, or more ticks than :data:`MAX_FLAT`, are drawn slanted.
MAX_FLAT_CHARS, MAX_FLAT = 8, 12
#: The colours of raw bytes and of bytes on disk, the same in both panels.
RAW, DISK = "C0", "C2"


@dataclass
class Point:
    """One checkpoint on the plot: its own bytes, and cumulative bytes after it was saved.

    Attributes:
        name: The checkpoint.
        step: Its training step, or ``None``.
        raw_bytes: Its raw bytes (distinct tensors, uncompressed).
        written_bytes: What its new objects take on disk now (compressed, or deltas on
            their anchors, once compacted).
        vault_bytes: New objects' raw bytes so far (deduplication alone).
        disk_bytes: What the saves so far wrote on disk.
        files_bytes: Raw bytes so far, as separate files.
    """

    name: str
    step: int | None
    raw_bytes: int
    written_bytes: int
    vault_bytes: int
    disk_bytes: int
    files_bytes: int


@dataclass
class BytesPlot:
    """What ``plot`` drew (``--json`` prints it).

    Attributes:
        file: The PNG written.
        x: ``"step"`` when the x axis is the training step, else ``"checkpoint"``.
        points: One per checkpoint, oldest first.
        vault_bytes: The raw bytes of the objects the checkpoints added (deduplicated,
            uncompressed).
        disk_bytes: What the checkpoints' saves wrote on disk (compressed).
        files_bytes: What the same checkpoints take as separate safetensors files.
        ratio: ``files_bytes / disk_bytes`` (0 for an empty vault).
    """

    file: str
    x: str
    points: list[Point] = field(default_factory=list)
    vault_bytes: int = 0
    disk_bytes: int = 0
    files_bytes: int = 0
    ratio: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def steps(records: list[CheckpointRecord]) -> list[int] | None:
    """Each record's training step from the first key in :data:`STEP_KEYS` that every
    record holds as an integer; ``None`` if no key does."""
    for key in STEP_KEYS:
        try:
            return [int(r.metadata[key]) for r in records]
        except (KeyError, ValueError):
            continue
    return None


def measure(records: list[CheckpointRecord], path: str, disk: list[int] | None = None) -> BytesPlot:
    """The points and totals of the plot, without drawing it; ``disk`` is what each
    checkpoint's new objects take on disk now (by default what its save wrote)."""
    found = steps(records) if records else None
    out = BytesPlot(os.fspath(path), "step" if found is not None else "checkpoint")
    for i, r in enumerate(records):
        out.vault_bytes += r.new_bytes
        # A record without written_bytes reads as new_bytes: its objects were raw.
        on_disk = r.written_bytes if disk is None else disk[i]
        out.disk_bytes += on_disk
        out.files_bytes += r.stored_bytes
        step = found[i] if found is not None else None
        out.points.append(
            Point(r.name, step, r.stored_bytes, on_disk, out.vault_bytes,
                  out.disk_bytes, out.files_bytes)
        )  # fmt: skip
    out.ratio = round(out.files_bytes / out.disk_bytes, 2) if out.disk_bytes else 0.0
    return out


def axis_unit(most: int) -> tuple[str, int]:
    """The largest of KiB, MiB and GiB that ``most`` bytes fill at least once."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if most >= scale:
            return unit, scale
    return "KiB", 2**10


def plot(vault: Vault, path: str | os.PathLike[str]) -> BytesPlot:
    """Draw bytes on disk, the vault against separate files, as PNG: cumulative after
    each checkpoint on top, each checkpoint's raw and written bytes below.

    Example:
        >>> plot(Vault("runs/ft"), "bytes.png").ratio      # docs/cli.md's vault
        3.19
    """
    try:
        import matplotlib
    except ImportError:
        raise BackendNotInstalled(
            "plotting a vault needs matplotlib: pip install 'weightvault[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    use = vault_usage(vault.store)
    data = measure(use.records, os.fspath(path), [c.disk_bytes for c in use.checkpoints])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), dpi=110, sharex=True)
    xs = _cumulative(top, data)
    _per_checkpoint(bottom, data, xs)
    by_step = data.x == "step"
    bottom.set_xlabel("training step" if by_step else "checkpoint")
    title = f"{os.path.basename(vault.url.rstrip('/')) or vault.url}: bytes on disk"
    if data.disk_bytes:
        # The saving, on the picture itself: what someone shown only the PNG asks first.
        title += (
            f"\n{len(data.points)} checkpoints: {human(data.disk_bytes)} on disk in the vault, "
            f"{human(data.files_bytes)} as separate files ({data.ratio:.1f}x smaller)"
        )
    top.set_title(title, fontsize=10)
    if by_step and len(xs) <= MAX_FLAT:
        bottom.set_xticks(xs)
    elif by_step:
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        names = [p.name for p in data.points]
        slanted = len(names) > MAX_FLAT or max(map(len, names), default=0) > MAX_FLAT_CHARS
        bottom.set_xticks(
            xs, names, rotation=30 if slanted else 0, ha="right" if slanted else "center"
        )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return data


def _xs(data: BytesPlot) -> list[int]:
    return [i + 1 if p.step is None else p.step for i, p in enumerate(data.points)]


def _cumulative(ax: Any, data: BytesPlot) -> list[int]:
    """The top panel: cumulative bytes, separate files against the vault; the x values."""
    xs = _xs(data)
    unit, scale = axis_unit(data.files_bytes)
    ax.plot(
        xs, [p.files_bytes / scale for p in data.points], marker="o", color=RAW,
        label="separate files",
    )  # fmt: skip
    ax.plot(
        xs, [p.vault_bytes / scale for p in data.points], marker="o", linestyle="--",
        color="C1", label="vault, uncompressed",
    )  # fmt: skip
    ax.plot(
        xs, [p.disk_bytes / scale for p in data.points], marker="o", color=DISK,
        label="vault on disk (compressed)",
    )  # fmt: skip
    ax.set_ylabel(f"cumulative {unit}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return xs


def _per_checkpoint(ax: Any, data: BytesPlot, xs: list[int]) -> None:
    """The bottom panel: each checkpoint's raw bytes beside what its save wrote."""
    unit, scale = axis_unit(max((p.raw_bytes for p in data.points), default=0))
    # Steps may repeat or go back (a resumed run): the narrowest forward gap sets the width.
    gaps = [b - a for a, b in itertools.pairwise(xs) if b > a]
    width = 0.3 * min(gaps, default=1)
    raw = [p.raw_bytes / scale for p in data.points]
    disk = [p.written_bytes / scale for p in data.points]
    ax.bar([x - width / 2 for x in xs], raw, width, color=RAW, label="raw (as one file)")
    ax.bar([x + width / 2 for x in xs], disk, width, color=DISK, label="its save wrote on disk")
    ax.set_ylabel(f"{unit} per checkpoint")
    ax.set_ylim(0, 1.3 * max([*raw, *disk, 1 / scale]))  # room for the legend above the bars
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper right", fontsize=8, ncol=2)
