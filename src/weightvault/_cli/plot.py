"""``weightvault vault ROOT plot``: cumulative bytes on disk, vault versus separate files.

The x axis is the training step when every checkpoint records one in its metadata
(``step``, ``global_step`` from the Hugging Face callback, ``keras.step`` from the Keras
callback), and the checkpoint's position otherwise.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from .._base.errors import BackendNotInstalled
from .._base.progress import human
from .._vault.records import CheckpointRecord
from .._vault.vault import Vault

#: Metadata keys that hold a checkpoint's training step, tried in this order.
STEP_KEYS = ("step", "global_step", "keras.step")
#: Tick labels longer than this, or more ticks than :data:`MAX_FLAT`, are drawn slanted.
MAX_FLAT_CHARS, MAX_FLAT = 8, 12


@dataclass
class Point:
    """One checkpoint on the plot: cumulative bytes after it was saved."""

    name: str
    step: int | None
    vault_bytes: int
    files_bytes: int


@dataclass
class BytesPlot:
    """What ``plot`` drew (``--json`` prints it).

    Attributes:
        file: The PNG written.
        x: ``"step"`` when the x axis is the training step, else ``"checkpoint"``.
        points: One per checkpoint, oldest first.
        vault_bytes: What the vault's checkpoints added up to (their new bytes).
        files_bytes: What the same checkpoints take as separate safetensors files.
        ratio: ``files_bytes / vault_bytes`` (0 for an empty vault).
    """

    file: str
    x: str
    points: list[Point] = field(default_factory=list)
    vault_bytes: int = 0
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


def measure(records: list[CheckpointRecord], path: str) -> BytesPlot:
    """The points and totals of the plot, without drawing it."""
    found = steps(records) if records else None
    out = BytesPlot(os.fspath(path), "step" if found is not None else "checkpoint")
    for i, r in enumerate(records):
        out.vault_bytes += r.new_bytes
        out.files_bytes += r.stored_bytes
        step = found[i] if found is not None else None
        out.points.append(Point(r.name, step, out.vault_bytes, out.files_bytes))
    out.ratio = round(out.files_bytes / out.vault_bytes, 2) if out.vault_bytes else 0.0
    return out


def axis_unit(most: int) -> tuple[str, int]:
    """The largest of KiB, MiB and GiB that ``most`` bytes fill at least once."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if most >= scale:
            return unit, scale
    return "KiB", 2**10


def plot(vault: Vault, path: str | os.PathLike[str]) -> BytesPlot:
    """Draw cumulative bytes on disk per checkpoint, vault versus separate files, as PNG.

    Example:
        >>> plot(Vault("runs/ft"), "bytes.png").ratio
        2.79
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

    data = measure(vault.list(), os.fspath(path))
    by_step = data.x == "step"
    xs = [i + 1 if p.step is None else p.step for i, p in enumerate(data.points)]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    unit, scale = axis_unit(data.files_bytes)
    ax.plot(xs, [p.files_bytes / scale for p in data.points], marker="o", label="separate files")
    ax.plot(xs, [p.vault_bytes / scale for p in data.points], marker="o", label="weightvault vault")
    ax.set_xlabel("training step" if by_step else "checkpoint")
    ax.set_ylabel(f"cumulative {unit} on disk")
    title = f"{os.path.basename(vault.url.rstrip('/')) or vault.url}: bytes on disk"
    if data.vault_bytes:
        # The saving, on the picture itself: what someone shown only the PNG asks first.
        title += (
            f"\n{len(data.points)} checkpoints: {human(data.vault_bytes)} in the vault, "
            f"{human(data.files_bytes)} as separate files ({data.ratio:.1f}x smaller)"
        )
    ax.set_title(title, fontsize=10)
    if by_step:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        names = [p.name for p in data.points]
        slanted = len(names) > MAX_FLAT or max(map(len, names), default=0) > MAX_FLAT_CHARS
        ax.set_xticks(xs, names, rotation=30 if slanted else 0, ha="right" if slanted else "center")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return data
