"""Labels on checkpoints: ``vault.mark(name, "best")``, and reads that take ``"best"``.

A label lives in the record of the checkpoint it marks, as one field with the time it
was marked: ``"labels": {"best": 1767225600.5}``. There is no second store of marks, so
a push carries a mark with its record, ``delete`` takes it away with its checkpoint, and
a retention that keeps marked checkpoints asks the records (:func:`marks`).

A label names at most one checkpoint. Moving it is two writes, the new record first,
then the old one without it, so a crash between them leaves two records carrying it,
never none. Where two records carry a label, the one marked later names the checkpoint
(ties: the later-created checkpoint, then the greater name), and a mark is always given
a time after every other mark of its label, so a clock that runs behind cannot make an
earlier mark win. The next ``mark`` or ``unmark`` takes the stale copy away.

Records are rewritten whole (:func:`~.records.rewrite_record`), as a retention rewrites
them: two processes that rewrite one record at the same moment may lose one change.
This process's marks are serialised; see docs/vault.md.

Example:
    >>> vault.mark("000007")          # "best" by default
    >>> vault.marks()
    {'best': '000007'}
    >>> vault.resolve("best")
    '000007'
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ..._base.errors import CheckpointNotFoundError
from ..store.backend import Store
from .names import LABELS, record_key, record_names
from .order import HEAD, SCALAR, resolve
from .reading import read_doc, rewrite_record
from .record import VERSION, label_times, parse_record

__all__ = [
    "Held",
    "carry_marks",
    "check_label",
    "holders",
    "mark",
    "marks",
    "protected",
    "resolve_label",
    "unmark",
]

#: One top-level field's name and the first character of its value.
_KEY = re.compile(rb'\s*"([A-Za-z_]+)"\s*:\s*(.)', re.DOTALL)
#: The smallest step a new mark's time takes past an older mark of its label.
_AFTER = 1e-3
#: Marks of this process, one at a time: two threads moving one label read the same
#: holders, and each would leave the other's record carrying it.
_LOCK = threading.Lock()

#: ``(label time, checkpoint created, name)`` of one record carrying a label: the
#: greatest names the checkpoint (see the module docstring).
Held = tuple[float, float, str]


def check_label(label: object, where: str) -> str:
    """``label`` itself if :meth:`Vault.mark` may put it on a checkpoint.

    Raises:
        ValueError: It is not one of :data:`~.records.LABELS`.
    """
    if isinstance(label, str) and label in LABELS:
        return label
    raise ValueError(
        f"{where}: {label!r:.40} is not a label; the labels are {', '.join(LABELS)} "
        "(vault.mark(name, 'best'))"
    )


def _may_carry(head: bytes) -> bool:
    """Whether a record starting with ``head`` may carry a label: ``False`` only when its
    leading plain fields end at an object or array field that is not ``labels``, since
    ``labels`` comes before every object and array (:func:`~.records.label_times`)."""
    if not head.startswith(b"{"):
        return True
    pos = 1
    while (m := SCALAR.match(head, pos)) is not None:
        if m.group(1) == b"labels" or m.group(3) == b"}":
            return True  # a scalar "labels" (damaged), or a record of plain fields only
        pos = m.end()
    key = _KEY.match(head, pos)
    return key is None or key.group(1) == b"labels" or key.group(2) not in (b"{", b"[")


def holders(store: Store, names: Iterable[str] | None = None) -> dict[str, list[Held]]:
    """Every record that carries a label, by label, the one that names it last.

    Only the first 512 bytes of each record are read, and whole only those that may
    carry a label (a marked one, or one whose start is not a record's).

    Raises:
        FormatError: Such a record is damaged: which checkpoint it marks is unknown.
    """
    out: dict[str, list[Held]] = {}
    for name in record_names(store) if names is None else names:
        try:
            head = store.get_range(record_key(name), 0, HEAD)
        except FileNotFoundError:
            continue  # deleted while we listed
        except OSError:
            head = b""  # a folder, say: read_doc says what is wrong
        if not _may_carry(head):
            continue
        try:
            doc = read_doc(store, name)
        except CheckpointNotFoundError:
            continue
        where = f"{store.url}/{record_key(name)}"
        created = parse_record(name, doc, where).created
        for label, when in label_times(doc, where).items():
            out.setdefault(label, []).append((when, created, name))
    return {label: sorted(held) for label, held in out.items()}


def marks(store: Store) -> dict[str, str]:
    """``{label: checkpoint}`` of every label some checkpoint carries.

    Raises:
        FormatError: A record that may carry a label is damaged.
    """
    return {label: held[-1][2] for label, held in sorted(holders(store).items())}


def resolve_label(store: Store, name: str) -> str:
    """``name`` itself, the newest checkpoint for ``"latest"``, or the checkpoint a label
    such as ``"best"`` marks.

    A checkpoint literally named ``best`` (saved before labels existed) stands for
    ``"best"`` while no checkpoint is marked.

    Raises:
        CheckpointNameError: ``name`` is not a valid name.
        CheckpointNotFoundError: No checkpoint carries the label (naming the marks the
            vault has, and how to mark one), or ``"latest"`` in an empty vault.
        FormatError: A record that decides it is damaged.
    """
    if name not in LABELS:
        return resolve(store, name)
    found = marks(store)
    if name in found:
        return found[name]
    if store.exists(record_key(name)):
        return name
    shown = ", ".join(f"{k!r} on {v!r}" for k, v in found.items()) or "none"
    raise CheckpointNotFoundError(
        f"{store.url}: it has no checkpoint marked {name!r}; marks: {shown}; mark one "
        f"with vault.mark(name, {name!r}) (or 'weightvault vault ROOT mark NAME')"
    )


def _relabelled(doc: Mapping[str, Any], labels: Mapping[str, float]) -> dict[str, Any]:
    """``doc`` with ``labels`` (none: the field dropped) before its first object or
    array field, where :func:`_may_carry` looks for it, and of the version of the sealed
    record :func:`~.records.rewrite_record` makes of it (a version 1 record has no seal)."""
    out: dict[str, Any] = {}
    placed = not labels
    for key, value in doc.items():
        if key == "labels":
            continue
        if key == "version":
            value = VERSION
        if not placed and isinstance(value, (dict, list)):
            out["labels"], placed = dict(labels), True
        out[key] = value
    if not placed:
        out["labels"] = dict(labels)
    return out


def _set(store: Store, name: str, label: str, when: float | None) -> bool:
    """Put ``label`` (at time ``when``) on checkpoint ``name``, or with ``None`` take it
    off; whether the record still exists."""
    try:
        doc = read_doc(store, name)
    except CheckpointNotFoundError:
        return False
    where = f"{store.url}/{record_key(name)}"
    parse_record(name, doc, where)  # a damaged record is not rewritten
    labels = label_times(doc, where)
    if when is None:
        if label not in labels:
            return True
        del labels[label]
    else:
        labels[label] = when
    return rewrite_record(store, name, _relabelled(doc, labels))


def mark(store: Store, name: str, label: str = "best") -> str:
    """Put ``label`` on checkpoint ``name`` (``latest`` allowed) and take it off every
    other; returns the checkpoint marked.

    Raises:
        ValueError: ``label`` is not a label.
        CheckpointNameError: ``name`` is not a valid name.
        CheckpointNotFoundError: No checkpoint has that name.
        FormatError: Its record, or one that may carry the label, is damaged.
    """
    check_label(label, store.url)
    with _LOCK:
        target = resolve(store, name)
        held = holders(store).get(label, [])
        if [h[2] for h in held] == [target]:
            return target  # marked already, and only it
        when = max([time.time(), *(h[0] + _AFTER for h in held)])
        if not _set(store, target, label, when):
            read_doc(store, target)  # raises CheckpointNotFoundError, naming what exists
            raise CheckpointNotFoundError(f"{store.url}: checkpoint {target!r} was deleted")
        # Only now the old ones: a crash before this leaves two marked, the new one winning.
        for _, _, other in held:
            if other != target:
                _set(store, other, label, None)
        return target


def unmark(store: Store, label: str = "best") -> str | None:
    """Take ``label`` off every checkpoint; the one it named, or ``None``.

    The stale copies go first and the checkpoint it names last, so a crash between the
    writes never leaves an older mark naming a checkpoint.
    """
    check_label(label, store.url)
    with _LOCK:
        held = holders(store).get(label, [])
        for _, _, name in held:
            _set(store, name, label, None)
        return held[-1][2] if held else None


def protected(store: Store) -> set[str]:
    """The checkpoints a label names: a retention by count keeps them.

    Raises:
        FormatError: A record that may carry a label is damaged (the retention then
            deletes nothing, as gc does: it cannot know which checkpoint is marked).
    """
    return set(marks(store).values())


def carry_marks(sender: Store, receiver: Store, sent: Iterable[str]) -> list[str]:
    """Mark in ``receiver`` each checkpoint of ``sent`` that a label names in ``sender``
    (a push copies a record as it is, so a mark made after an earlier push, or a stale
    copy of one, would not otherwise name the same checkpoint there); the labels moved.
    """
    names = set(sent)
    theirs = marks(receiver)
    moved = []
    for label, name in marks(sender).items():
        if name in names and theirs.get(label) != name:
            mark(receiver, name, label)
            moved.append(label)
    return moved
