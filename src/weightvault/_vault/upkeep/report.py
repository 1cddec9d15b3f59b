"""What one compaction did: :class:`CompactReport`, filled in by every part of a pass.

Example:
    >>> report = CompactReport()
    >>> report.full, report.busy
    (0, False)
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompactReport"]


@dataclass
class CompactReport:
    """What one compaction did.

    Attributes:
        checkpoints: The checkpoints compacted, oldest first.
        full: Objects rewritten as full compressed objects.
        deltas: Objects rewritten as deltas on the next checkpoint's.
        bytes_before: Their files' bytes before.
        bytes_after: Their files' bytes after.
        damaged: One line per damaged object found (left as it is).
        unpacked: Objects taken out of pack files raw (:mod:`..store.pack`).
        packs_deleted: Pack files deleted once every object in them was loose.
        busy: Another process held the vault's compaction lock; nothing was done.
        seconds: Wall time.
    """

    checkpoints: list[str] = field(default_factory=list)
    full: int = 0
    deltas: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    damaged: list[str] = field(default_factory=list)
    unpacked: int = 0
    packs_deleted: int = 0
    busy: bool = False
    seconds: float = 0.0
