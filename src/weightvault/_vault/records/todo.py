"""The compactor's to-do markers: which checkpoints a save left to it (:mod:`.compact`).

A save that leaves its raw objects to the compactor writes ``compact/<name>.todo`` once
its record is committed (:func:`mark`); the compactor removes it when that checkpoint is
done. gc reads the markers too: the packs of a checkpoint still to compact are the
compactor's to take apart (:func:`held_packs`).

Example:
    >>> mark(vault.store, "000003"); "000003" in pending(vault.store)
    True
"""

from __future__ import annotations

import contextlib

from ..._base.errors import CheckpointNotFoundError, FormatError
from ..store.backend import Store
from .names import check_name
from .reading import read_doc

__all__ = ["TODO", "held_packs", "mark", "pending", "todo_key"]

#: Where the to-do markers live.
TODO = "compact"


def todo_key(name: str) -> str:
    return f"{TODO}/{name}.todo"


def mark(store: Store, name: str) -> None:
    """Leave checkpoint ``name`` to the compactor (called once its record is committed).

    Not fsynced: a marker a power loss takes leaves its checkpoint raw, loadable and
    whole, and the next checkpoint's compaction still encodes its objects.
    """
    store.put(todo_key(name), b"{}", durable=False)


def pending(store: Store) -> list[str]:
    """The checkpoints whose compaction has not finished, in no particular order."""
    out = []
    for blob in store.list(TODO):
        leaf = blob.key.rsplit("/", 1)[-1]
        if not leaf.endswith(".todo") or leaf.startswith("."):
            continue
        with contextlib.suppress(ValueError):
            out.append(check_name(leaf.removesuffix(".todo"), store.url))
    return out


def held_packs(store: Store, names: set[str]) -> set[str]:
    """The packs the saves of checkpoints ``names`` wrote (their records name them)."""
    out: set[str] = set()
    for name in names:
        with contextlib.suppress(FormatError, CheckpointNotFoundError):
            listed = read_doc(store, name).get("packs")
            if isinstance(listed, list):
                out |= {p for p in listed if isinstance(p, str)}
    return out
