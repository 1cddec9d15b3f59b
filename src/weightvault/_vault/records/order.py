"""Creation order: which checkpoint is older, from the first bytes of each record.

A resume asks for the newest checkpoint, and retention for all but the newest few: both
need only each record's ``version`` and ``created``, which the writers put first, so
:func:`creation_order` reads :data:`HEAD` bytes of each record and parses them with
:func:`head_fields`, reading a record whole only where its start does not tell.

Example:
    >>> [name for _, name in creation_order(vault.store)]
    ['000001', '000002']
"""

from __future__ import annotations

import re
from typing import Any

from ..._base.errors import CheckpointNotFoundError, FormatError
from ..store.backend import Store
from .names import check_name, record_key, record_names
from .reading import list_records, read_doc
from .record import READABLE, is_moment, parse_record

__all__ = ["HEAD", "SCALAR", "creation_order", "head_fields", "resolve"]


def resolve(store: Store, name: str) -> str:
    """``name`` itself, or for ``"latest"`` the newest checkpoint's name.

    Only the start of each record is read (:func:`creation_order`), and the newest one
    whole: a resume costs the same after 10 checkpoints as after 1000.

    Raises:
        CheckpointNameError: ``name`` is not a valid name.
        CheckpointNotFoundError: ``name`` is ``"latest"`` and the vault has no checkpoints.
        FormatError: The newest record, or one whose start does not say when it was
            created, is damaged.
    """
    if check_name(name, store.url, latest=True) != "latest":
        return name
    order = creation_order(store)
    if not order:
        raise CheckpointNotFoundError(f"{store.url}: the vault has no checkpoints yet")
    created, newest = order[-1]
    try:
        doc = read_doc(store, newest)
    except CheckpointNotFoundError:
        doc = None  # deleted since it was listed
    # A record's start is its own only if the JSON does not repeat the key later (then
    # the last one counts): otherwise, and after a deletion, every record is read whole.
    where = f"{store.url}/{record_key(newest)}"
    if doc is None or parse_record(newest, doc, where).created != created:
        records = list_records(store)
        if not records:
            raise CheckpointNotFoundError(f"{store.url}: the vault has no checkpoints yet")
        return records[-1].name
    return newest


#: How much of a record :func:`creation_order` reads: the writers put ``version`` and
#: ``created`` first, and a whole record is 85 KB for a 70-tensor model with its AdamW
#: (read and parsed: 0.3 ms per checkpoint the vault holds, per resume).
HEAD = 512
#: One top-level field whose value is a number, a string without escapes, or a literal.
SCALAR = re.compile(
    rb'\s*"([A-Za-z_]+)"\s*:\s*'
    rb'(-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|"[^"\\\x00-\x1f]*"|true|false|null)'
    rb"\s*([,}])"
)


def head_fields(head: bytes) -> dict[str, Any]:
    """The top-level fields at the start of a record's JSON, up to the first that is not
    a plain scalar (an object, a string with escapes, a value cut off by the end of
    ``head``); the first of a repeated key.

    Example:
        >>> head_fields(b'{"version":1,"created":1.5,"header":"{\\"a')
        {'version': 1, 'created': 1.5}
    """
    out: dict[str, Any] = {}
    if not head.startswith(b"{"):
        return out
    pos = 1
    while (m := SCALAR.match(head, pos)) is not None:
        try:
            value = _scalar(m.group(2))
        except UnicodeDecodeError:  # a string that is not UTF-8
            break
        out.setdefault(m.group(1).decode(), value)
        if m.group(3) == b"}":
            break
        pos = m.end()
    return out


def _scalar(token: bytes) -> Any:
    """A value :data:`SCALAR` matched, as ``json.loads`` reads it (a third of the time:
    a resume reads the start of every record)."""
    if token.startswith(b'"'):
        return token[1:-1].decode("utf-8")  # no escapes, no control characters
    literal = _LITERALS.get(token, token)
    if literal is not token:
        return literal
    return float(token) if any(c in token for c in b".eE") else int(token)


_LITERALS: dict[bytes, Any] = {b"true": True, b"false": False, b"null": None}


def creation_order(
    store: Store, names: list[str] | None = None, *, skip_damaged: bool = False
) -> list[tuple[float, str]]:
    """``(created, name)`` of every record (or of ``names``, as listed), oldest first
    (ties by name, as :func:`list_records`), from the first :data:`HEAD` bytes of each.

    A record whose start does not give its version and creation time (one written by
    hand, or damaged there) is read whole. One whose JSON repeats ``created`` later is
    placed by the first (a JSON reader keeps the last): :func:`resolve` reads the record
    it picks whole and, when the two differ, every record.

    Raises:
        FormatError: Such a record is damaged (left out instead with ``skip_damaged``).
    """
    out = []
    for name in record_names(store) if names is None else names:
        try:
            fields = head_fields(store.get_range(record_key(name), 0, HEAD))
        except FileNotFoundError:
            continue  # deleted while we listed
        except OSError:
            fields = {}  # a folder, say: read_doc says what is wrong
        created = fields.get("created")
        if fields.get("version") in READABLE and is_moment(created):
            out.append((float(fields["created"]), name))
            continue
        try:
            doc = read_doc(store, name)
            record = parse_record(name, doc, f"{store.url}/{record_key(name)}")
        except CheckpointNotFoundError:
            continue
        except FormatError:
            if skip_damaged:
                continue
            raise
        out.append((record.created, name))
    return sorted(out)
