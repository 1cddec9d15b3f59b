"""What each checkpoint of a vault cost on disk, and what the whole vault takes.

Three byte counts describe a checkpoint (all from its record):

- **raw**: its distinct tensor bytes, uncompressed (``stored_bytes``: what one
  deduplicated safetensors file of it holds);
- **new**: the raw bytes of the objects its save added (the rest were in the vault);
- **on disk**: what those new objects' files took when it was saved, compressed or as
  deltas (``written_bytes``).

Records written before objects were compressed, and DCP records, hold no
``written_bytes``. Their objects were written raw (DCP chunks stay raw so that loads read
ranges straight into tensors), so their size on disk is their raw size, ``new_bytes``:
:attr:`CheckpointUsage.recorded` says when the figure was derived that way.

A checkpoint whose training state was dropped later (``weights_only``) has a raw size of
its weights only, while its save wrote the training state too: its ratio is ``None``
rather than a comparison of two different things.

Example:
    >>> u = vault_usage(vault.store)           # docs/cli.md's vault
    >>> [c.ratio for c in u.checkpoints]       # on disk / raw, per checkpoint
    [0.8385, 0.051, 0.0509]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .records import CheckpointRecord, list_docs
from .store import Store

__all__ = ["CheckpointUsage", "VaultUsage", "checkpoint_usage", "vault_usage"]

#: Decimal places kept in a ratio.
DIGITS = 4


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, DIGITS) if whole else None


@dataclass(frozen=True)
class CheckpointUsage:
    """One checkpoint's bytes.

    Attributes:
        name: The checkpoint.
        raw_bytes: Its distinct tensor bytes, uncompressed.
        new_bytes: Raw bytes of the objects its save added to the vault.
        written_bytes: What those objects took on disk when it was saved.
        recorded: Whether the record holds ``written_bytes``; ``False`` when it was
            derived as ``new_bytes`` (objects written raw: before compression, or DCP).
        weights_only: Its training state was dropped after it was saved.
        ratio: ``written_bytes / raw_bytes``; ``None`` when ``raw_bytes`` is 0 or the
            checkpoint is weights-only (its raw size no longer counts what was written).
    """

    name: str
    raw_bytes: int
    new_bytes: int
    written_bytes: int
    recorded: bool
    weights_only: bool
    ratio: float | None


def checkpoint_usage(record: CheckpointRecord, recorded: bool) -> CheckpointUsage:
    """``record``'s bytes; ``recorded`` says whether its document held ``written_bytes``."""
    return CheckpointUsage(
        name=record.name,
        raw_bytes=record.stored_bytes,
        new_bytes=record.new_bytes,
        # parse_record already fills a missing written_bytes with new_bytes.
        written_bytes=record.written_bytes,
        recorded=recorded,
        weights_only=record.weights_only,
        ratio=None if record.weights_only else _ratio(record.written_bytes, record.stored_bytes),
    )


@dataclass(frozen=True)
class VaultUsage:
    """A whole vault's bytes.

    Attributes:
        records: Every checkpoint's record, oldest first.
        checkpoints: Every checkpoint's bytes, in the same order.
        raw_bytes: The raw bytes of all checkpoints (as separate uncompressed files of
            distinct tensors would hold them).
        written_bytes: What the checkpoints' saves wrote (objects gc freed since count).
        object_bytes: What the vault's objects take on disk now.
        disk_bytes: What the whole vault takes on disk now, records included.
        ratio: ``disk_bytes / raw_bytes``; ``None`` for a vault without tensor bytes.
    """

    records: list[CheckpointRecord] = field(default_factory=list)
    checkpoints: list[CheckpointUsage] = field(default_factory=list)
    raw_bytes: int = 0
    written_bytes: int = 0
    object_bytes: int = 0
    disk_bytes: int = 0
    ratio: float | None = None


def vault_usage(store: Store) -> VaultUsage:
    """Every checkpoint's bytes and the vault's, from one listing of its records."""
    pairs = list_docs(store)
    checkpoints = [checkpoint_usage(r, "written_bytes" in doc) for r, doc in pairs]
    raw = sum(c.raw_bytes for c in checkpoints)
    disk = sum(b.size for b in store.list(""))
    return VaultUsage(
        records=[r for r, _ in pairs],
        checkpoints=checkpoints,
        raw_bytes=raw,
        written_bytes=sum(c.written_bytes for c in checkpoints),
        object_bytes=sum(b.size for b in store.list("objects")),
        disk_bytes=disk,
        ratio=_ratio(disk, raw),
    )
