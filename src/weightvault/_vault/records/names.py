"""Checkpoint names: the one gate every name passes, and the key each becomes.

Checkpoint names become keys under ``checkpoints/``, so :func:`check_name` is the one
gate every entry point passes a name through; numbered names are handed out once.

Example:
    >>> check_name("step-100", "runs/ft")
    'step-100'
"""

from __future__ import annotations

import re

from ..._base.errors import CheckpointNameError
from ..store.backend import Store

__all__ = ["LABELS", "check_name", "next_name", "record_key", "record_names"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: The labels :meth:`Vault.mark` puts on a checkpoint. Reads take each in place of a name,
#: as they take ``latest``, so none may name a new checkpoint.
LABELS = ("best",)


def check_name(name: object, where: str, *, latest: bool = False, new: bool = False) -> str:
    """``name`` itself if it may name a checkpoint; the one check every entry point uses.

    A name becomes a key under ``checkpoints/`` (and ``deleted/``), so anything that could
    reach outside the vault (``..``, ``/``, a trailing newline) is refused here.

    Args:
        name: What the caller passed.
        where: The vault, for the message.
        latest: Also accept ``"latest"`` (reads resolve it to the newest checkpoint).
        new: ``name`` is for a new checkpoint: a label (:data:`LABELS`, ``best``) is
            refused too, since reads take it for the checkpoint it marks. A checkpoint
            named ``best`` before labels existed still reads, lists and deletes by name.

    Raises:
        CheckpointNameError: ``name`` is not 1 to 128 ASCII letters, digits, ``.``, ``_``
            and ``-`` starting with a letter or digit, or is ``latest`` where not allowed,
            or a label for a new checkpoint.
    """
    if isinstance(name, str) and new and name in LABELS:
        raise CheckpointNameError(
            f"{where}: checkpoint name {name!r} is a label, which reads take for the "
            f"checkpoint it marks; save under another name and mark it: "
            f"vault.mark(name, {name!r})"
        )
    if isinstance(name, str) and (
        (latest and name == "latest") or (name != "latest" and _NAME.fullmatch(name))
    ):
        return name
    shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
    raise CheckpointNameError(
        f"{where}: checkpoint name {shown} is not allowed; use 1 to 128 letters, digits, "
        "'.', '_' and '-', starting with a letter or digit"
        + ("" if latest else " (and not 'latest')")
    )


def record_key(name: str) -> str:
    """The key of checkpoint ``name``'s record."""
    return f"checkpoints/{name}.json"


def next_name(store: Store) -> str:
    """The next checkpoint number (``000001``, ...), never one handed out before."""
    # Deleted checkpoints leave a tombstone, so a number is never handed out twice.
    gone = [b.key.rsplit("/", 1)[-1].removesuffix(".json") for b in store.list("deleted")]
    # isascii: "²".isdigit() holds, but int("²") fails.
    numbers = [int(n) for n in [*record_names(store), *gone] if n.isascii() and n.isdigit()]
    return f"{max(numbers, default=0) + 1:06d}"


def record_names(store: Store) -> list[str]:
    """The name of every record that :func:`check_name` would accept."""
    out = []
    for key in store.children("checkpoints"):
        base = key.rpartition("/")[2]
        name = base.removesuffix(".json")
        # Files save() could not have made (nested, or a name check_name refuses) are
        # not checkpoints: they are neither listed nor opened.
        if base.endswith(".json") and _NAME.fullmatch(name):
            out.append(name)
    return out
