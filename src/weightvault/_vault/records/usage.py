"""What each checkpoint of a vault cost on disk, and what the whole vault takes.

Four byte counts describe a checkpoint:

- **raw**: its distinct tensor bytes, uncompressed (``stored_bytes``: what one
  deduplicated safetensors file of it holds);
- **new**: the raw bytes of the objects its save added (the rest were in the vault);
- **written**: what its save wrote for them (``written_bytes``: raw bytes for a save that
  leaves compression to the compactor, as every save now does);
- **on disk**: what the files of those objects (the ones no earlier checkpoint names)
  take now: compressed, or deltas on the next checkpoint's, once compacted.

Records written before objects were compressed, and DCP records, hold no
``written_bytes``. Their objects were written raw (DCP chunks stay raw so that loads read
ranges straight into tensors), so what they wrote is their raw size, ``new_bytes``:
:attr:`CheckpointUsage.recorded` says when the figure was derived that way. DCP records
name chunks, not objects, so their size on disk is what they wrote.

A checkpoint whose training state was dropped later (``weights_only``) has a raw size of
its weights only, while its save wrote the training state too: its ratio is ``None``
rather than a comparison of two different things.

Example:
    >>> u = vault_usage(vault.store)           # docs/cli.md's vault
    >>> [c.ratio for c in u.checkpoints]       # on disk / raw, per checkpoint
    [0.8385, 0.051, 0.0509]
    >>> [c.compacted for c in u.checkpoints]
    [True, True, True]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..store.backend import Store
from ..store.pack import PACKS, pack_table
from .reading import list_docs
from .record import CheckpointRecord, object_digests
from .todo import pending

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
        written_bytes: What its save wrote for those objects.
        recorded: Whether the record holds ``written_bytes``; ``False`` when it was
            derived as ``new_bytes`` (objects written raw: before compression, or DCP).
        weights_only: Its training state was dropped after it was saved.
        disk_bytes: What the objects it was the first to name take on disk now.
        compacted: Whether the compactor is done with it (else its objects are raw).
        ratio: ``disk_bytes / raw_bytes``; ``None`` when ``raw_bytes`` is 0 or the
            checkpoint is weights-only (its raw size no longer counts what it holds).
    """

    name: str
    raw_bytes: int
    new_bytes: int
    written_bytes: int
    recorded: bool
    weights_only: bool
    ratio: float | None
    disk_bytes: int = 0
    compacted: bool = True


def checkpoint_usage(
    record: CheckpointRecord, recorded: bool, disk_bytes: int | None = None, compacted: bool = True
) -> CheckpointUsage:
    """``record``'s bytes; ``recorded`` says whether its document held ``written_bytes``,
    ``disk_bytes`` what its first objects take now (by default what it wrote)."""
    disk = record.written_bytes if disk_bytes is None else disk_bytes
    return CheckpointUsage(
        name=record.name,
        raw_bytes=record.stored_bytes,
        new_bytes=record.new_bytes,
        # parse_record already fills a missing written_bytes with new_bytes.
        written_bytes=record.written_bytes,
        recorded=recorded,
        weights_only=record.weights_only,
        ratio=None if record.weights_only else _ratio(disk, record.stored_bytes),
        disk_bytes=disk,
        compacted=compacted,
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
        object_bytes: What the vault's objects take on disk now: the files under
            ``objects/`` and the packs of saves not compacted yet.
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
    """Every checkpoint's bytes and the vault's, from one listing of its records and one
    of its objects."""
    pairs = list_docs(store)
    table = pack_table(store)
    table.refresh(store)
    listed = store.list("")
    # An object in a save's pack (until the compactor takes it out) takes its raw size.
    sizes = {d: p.size for index in table.packs().values() for d, p in index.items()}
    loose = {b.key.rsplit("/", 1)[-1]: b.size for b in listed if b.key.startswith("objects/")}
    sizes.update(loose)
    packs = sum(b.size for b in listed if b.key.startswith(f"{PACKS}/"))
    todo = set(pending(store))
    seen: set[str] = set()
    checkpoints = []
    for r, doc in pairs:
        checkpoints.append(
            checkpoint_usage(
                r, "written_bytes" in doc, _first(doc, seen, sizes), r.name not in todo
            )
        )
    raw = sum(c.raw_bytes for c in checkpoints)
    disk = sum(b.size for b in listed)
    return VaultUsage(
        records=[r for r, _ in pairs],
        checkpoints=checkpoints,
        raw_bytes=raw,
        written_bytes=sum(c.written_bytes for c in checkpoints),
        object_bytes=sum(loose.values()) + packs,
        disk_bytes=disk,
        ratio=_ratio(disk, raw),
    )


def _first(doc: dict[str, Any], seen: set[str], sizes: dict[str, int]) -> int | None:
    """Bytes on disk of the objects of record ``doc`` that no earlier one named (adding
    them to ``seen``); ``None`` for a record that names chunks, not objects (DCP)."""
    named = object_digests(doc)
    if named is None:
        return None
    new = named - seen
    seen |= new
    return sum(sizes.get(d, 0) for d in new)
