"""Which checkpoints a transfer sends: those asked for, less those the receiver holds.

:func:`check_receiver` refuses a receiver that holds other data; :func:`wanted_names` resolves
the names asked for; :func:`open_checkpoint` reads each one's record and the objects it
names; :func:`already` tells whether the receiver holds it (the same record, or one a
retention made weights-only on either side, see :func:`same`) and refuses a different
checkpoint of that name.

Example:
    >>> [c.name for c in map(lambda n: open_checkpoint(store, n), wanted_names(store, ["latest"]))]
    ['000003']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._base.errors import CheckpointExistsError, CheckpointNotFoundError, FormatError
from ..records.checkpoint import open_record
from ..records.names import check_name, record_key, record_names
from ..records.order import resolve
from ..records.reading import read_doc
from ..store.backend import Store
from ..store.identity import holds_vault

__all__ = ["Checkpoint", "already", "check_receiver", "open_checkpoint", "same", "wanted_names"]


@dataclass
class Checkpoint:
    """One source checkpoint to send: its record and the objects it names."""

    name: str
    doc: dict[str, Any]
    created: float
    objects: dict[str, str]  # label -> digest
    sizes: dict[str, int]  # label -> raw bytes


def check_receiver(store: Store) -> None:
    """Refuse a receiver that holds something other than a vault.

    Raises:
        FormatError: It is a file, another ``vault.json``, or a folder of other files.
    """
    if holds_vault(store):
        return
    others = [b.key for b in store.list("")][:4]
    if others:
        raise FormatError(
            f"{store.url}: holds other data ({', '.join(others)}), not a vault; push into "
            "an empty folder, a new prefix, or an existing vault"
        )


def wanted_names(store: Store, names: Sequence[str] | None) -> list[str]:
    """The checkpoint names asked for (``latest`` resolved), each checked to exist."""
    if names is None:
        return record_names(store)
    out: list[str] = []
    for name in names:
        resolved = resolve(store, check_name(name, store.url, latest=True))
        if not store.exists(record_key(resolved)):
            read_doc(store, resolved)  # raises CheckpointNotFoundError, naming what exists
        if resolved not in out:
            out.append(resolved)
    return out


def open_checkpoint(store: Store, name: str) -> Checkpoint:
    """Checkpoint ``name`` of ``store`` with the objects it names.

    Raises:
        FormatError: Its record is damaged or of an unknown version.
        CheckpointNotFoundError: It was deleted meanwhile.
    """
    doc = read_doc(store, name)
    with open_record(store, name, doc) as ckpt:
        objects = dict(ckpt.objects)
        sizes = {label: ckpt.object_nbytes(label) for label in objects}
        return Checkpoint(name, doc, ckpt.record.created, objects, sizes)


def already(dest: Store, ckpt: Checkpoint) -> bool:
    """Whether ``dest`` holds checkpoint ``ckpt`` already.

    Raises:
        CheckpointExistsError: It holds another checkpoint of that name.
    """
    if not dest.exists(record_key(ckpt.name)):
        return False
    try:
        theirs = open_checkpoint(dest, ckpt.name)
    except CheckpointNotFoundError:
        return False  # deleted meanwhile
    except FormatError as e:
        raise CheckpointExistsError(
            f"{dest.url}: checkpoint {ckpt.name!r} exists there with a damaged record "
            f"({e}); delete it there first"
        ) from e
    if same(ckpt, theirs):
        return True
    raise CheckpointExistsError(
        f"{dest.url}: checkpoint {ckpt.name!r} exists there with other content; delete it "
        "there first, or send the others by name"
    )


def same(a: Checkpoint, b: Checkpoint) -> bool:
    """Whether ``a`` and ``b`` are one checkpoint: the same record, or one of them made
    weights-only by a retention (same creation, its objects a subset of the other's).
    Labels do not count: a mark moves without changing the checkpoint."""
    if _unlabelled(a.doc) == _unlabelled(b.doc):
        return True
    if a.created != b.created:
        return False
    small, big = (a, b) if a.doc.get("weights_only") is True else (b, a)
    if small.doc.get("weights_only") is not True:
        return False
    return small.objects.items() <= big.objects.items()


def _unlabelled(doc: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "labels"}
