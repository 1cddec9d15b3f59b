"""What a save is asked: its progress hook and the names it may store, settled first.

A save checks what it can before any work, in the caller's thread: a name or metadata a
single file cannot hold is refused at once (:func:`check_save_names`), not in a
background thread nor only when the checkpoint is exported. :func:`save_bar` turns
``progress=True`` into a bar sized to the bytes the save hashes.

Example:
    >>> check_save_names(sources, None, {"step": "100"}, "runs/ft")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..._base.progress import Progress as Bar
from ..._file.layout import is_training
from ..._file.sharing import Source
from ..._file.writer import check_names
from .save import Progress

__all__ = ["check_save_names", "save_bar"]


def save_bar(
    progress: Progress | bool | None, sources: Sequence[Source], name: str | None
) -> Progress | None:
    """The save's progress hook: the caller's, or for ``True`` a bar sized to the bytes
    the save hashes (each tensor once, however many names share it)."""
    if progress is not True:
        return progress or None
    sizes = {s.identity: s.nbytes for s in sources}
    label = f"saving {name}" if name else "saving"
    # The save reports bytes as it hashes; the pause before the writing phase (bases,
    # intent, existence checks) shows as "compressing and writing" with its seconds.
    return Bar(sum(sizes.values()), label, then="compressing and writing")


def check_save_names(
    sources: Sequence[Source],
    training: dict[str, Any] | None,
    metadata: Mapping[str, str] | None,
    where: str,
) -> None:
    """Refuse names and metadata a single file cannot hold, now: not in a background
    thread, nor only when the checkpoint is exported."""
    names = [s.name for s in sources if training is None or not is_training(s.name)]
    check_names(names, metadata, where)
