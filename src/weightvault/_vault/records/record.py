"""Checkpoint records: ``checkpoints/<name>.json``, what they hold and how they are read.

A record is the commit of one checkpoint: its creation time, byte counts, your metadata,
the safetensors header the checkpoint would have as one file, and the object of each
stored tensor (or, for DCP checkpoints, of each chunk). Records are input like any file:
every field is checked before use, and damage raises :class:`FormatError` naming the
record and the field, never a crash.

Checkpoint names become keys, so :func:`check_name` is the one gate every entry point
passes a name through.

Example:
    >>> check_name("step-100", "runs/ft")
    'step-100'
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..._base.errors import (
    CheckpointExistsError,
    CheckpointNameError,
    CheckpointNotFoundError,
    FormatError,
    capped,
)
from ..._file.header import Header, parse_header
from ..._file.manifest import Manifest, read_manifest
from ..store.backend import Store
from ..store.seal import seal_json, unseal

__all__ = [
    "LABELS",
    "READABLE",
    "VERSION",
    "CheckpointRecord",
    "check_free",
    "check_name",
    "creation_order",
    "data_size",
    "delete_record",
    "encode_record",
    "head_fields",
    "label_times",
    "list_docs",
    "list_records",
    "next_name",
    "parse_header_text",
    "parse_record",
    "read_doc",
    "read_sealed",
    "record_key",
    "record_names",
    "resolve",
    "rewrite_record",
]

#: The version of every record this code writes: 2 is a record sealed by its own
#: checksum (``"sum"``, the last field), 1 one written before records were sealed.
VERSION = 2
#: The record versions this code reads.
READABLE = (1, 2)
#: What a damaged record's message suggests.
_FIX = "restore the record from a mirror (vault.pull) or delete the checkpoint"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: The largest count a record may hold (byte counts, tensor counts).
_MAX_COUNT = 2**63 - 1
#: Record times must lie between the epoch and the end of year 9999 (what dates can show).
_MAX_TIME = 253402128000.0


@dataclass(frozen=True)
class CheckpointRecord:
    """One committed checkpoint.

    Attributes:
        name: Its name in the vault.
        created: When it was committed (seconds since the epoch).
        logical_bytes: What its tensors take with every name written out.
        stored_bytes: Its distinct tensor bytes (what a deduplicated single file holds).
        new_bytes: Raw bytes of the objects this checkpoint added to the vault when it
            was saved.
        metadata: Your metadata.
        framework: The ``"format"`` of the adapter that saved it.
        tensors: How many names the model has.
        written_bytes: What those new objects take on disk, compressed (as ``new_bytes``
            for checkpoints saved before objects were compressed).
        weights_only: Its training state was dropped (``retain(training_state_last=)``).
        labels: The labels its record carries (``("best",)`` after ``vault.mark(name)``);
            where two records carry one, the newer mark names the checkpoint
            (:func:`~.marks.marks`).
    """

    name: str
    created: float
    logical_bytes: int
    stored_bytes: int
    new_bytes: int
    metadata: dict[str, str] = field(default_factory=dict)
    framework: str | None = None
    tensors: int = 0
    written_bytes: int = 0
    weights_only: bool = False
    labels: tuple[str, ...] = ()


#: The labels :meth:`Vault.mark` puts on a checkpoint. Reads take each in place of a name,
#: as they take ``latest``, so none may name a new checkpoint.
LABELS = ("best",)
#: What a label in a record may look like (a record is hostile input), and how many.
_LABEL = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_MAX_LABELS = 8


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


def check_free(store: Store, name: str | None) -> None:
    """Refuse, before any work, a name that is invalid or already taken.

    Raises:
        CheckpointNameError: ``name`` is not a valid name.
        CheckpointExistsError: A checkpoint already has that name.
    """
    if name is None:
        return
    check_name(name, store.url, new=True)
    if store.exists(record_key(name)):
        raise CheckpointExistsError(
            f"{store.url}: checkpoint {name!r} already exists; pick another name "
            "or delete it first with vault.delete(name)"
        )


def next_name(store: Store) -> str:
    """The next checkpoint number (``000001``, ...), never one handed out before."""
    # Deleted checkpoints leave a tombstone, so a number is never handed out twice.
    gone = [b.key.rsplit("/", 1)[-1].removesuffix(".json") for b in store.list("deleted")]
    # isascii: "²".isdigit() holds, but int("²") fails.
    numbers = [int(n) for n in [*record_names(store), *gone] if n.isascii() and n.isdigit()]
    return f"{max(numbers, default=0) + 1:06d}"


def delete_record(store: Store, name: str) -> None:
    """Remove checkpoint ``name``'s record, leaving a tombstone for a numbered name.

    Raises:
        CheckpointNameError: ``name`` is not a valid name.
        CheckpointNotFoundError: No checkpoint has that name.
    """
    with contextlib.suppress(FormatError):  # a damaged record can still be removed
        read_doc(store, name)
    if name.isdigit():
        store.put(f"deleted/{name}.json", json.dumps({"deleted": time.time()}).encode())
    store.delete(record_key(name))


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


def encode_record(doc: Mapping[str, Any]) -> bytes:
    """The bytes of record ``doc``, sealed: its JSON with a last field ``"sum"``, the
    xxh3-128 of every byte before it (the JSON up to that field, closed by ``}``). A
    record read as version 1 (written before records were sealed) is written as version
    2: a version 1 record may not carry a sum.

    Example:
        >>> encode_record({"version": 1, "created": 1.5})
        b'{"version":2,"created":1.5,"sum":"..."}'
    """
    # A dict update keeps the key where it was: the version stays first, for head_fields.
    return seal_json({**doc, "version": VERSION})


def rewrite_record(store: Store, name: str, doc: Mapping[str, Any]) -> bool:
    """Replace checkpoint ``name``'s record with ``doc``, sealed, durably and atomically.

    Returns:
        False, and nothing written, if the record was deleted meanwhile (a record is
        never brought back).
    """
    key = record_key(name)
    if not store.exists(key):
        return False
    store.put(key, encode_record(doc))
    store.sync([key])
    return True


def read_doc(store: Store, name: str) -> dict[str, Any]:
    """Checkpoint ``name``'s record as JSON, its version and checksum checked.

    Raises:
        CheckpointNotFoundError: No checkpoint has that name.
        FormatError: The record is a folder, not JSON, or of an unknown version.
        ChecksumError: The record's bytes do not match its own checksum.
    """
    return read_sealed(store, name)[0]


def read_sealed(store: Store, name: str) -> tuple[dict[str, Any], bool]:
    """As :func:`read_doc`, and whether the record carries a checksum (a record written
    before records were sealed does not; it loads as it always did)."""
    key = record_key(check_name(name, store.url))
    try:
        raw = store.get(key)
    except FileNotFoundError:
        known = record_names(store)
        raise CheckpointNotFoundError(
            f"{store.url}: no checkpoint named {name!r}; it has {capped(known) or 'none'}"
        ) from None
    except IsADirectoryError:
        raise FormatError(f"{store.url}/{key}: checkpoint record is a folder") from None
    where = f"{store.url}/{key}"
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where}: checkpoint record is not valid JSON") from e
    if (
        not isinstance(doc, dict)
        or type(doc.get("version")) is not int
        or doc["version"] not in READABLE
    ):
        raise FormatError(f"{where}: unknown checkpoint record version")
    return doc, unseal(raw, doc, where, "checkpoint record", sealed=doc["version"] != 1, fix=_FIX)


def list_records(store: Store) -> list[CheckpointRecord]:
    """Every committed checkpoint's record, oldest first."""
    return [record for record, _ in list_docs(store)]


def list_docs(store: Store) -> list[tuple[CheckpointRecord, dict[str, Any]]]:
    """Every committed checkpoint's record with its JSON document, oldest first: for
    callers that must tell a field the record holds from one :func:`parse_record`
    filled in for an older record."""
    out = []
    for name in record_names(store):
        try:
            doc = read_doc(store, name)
        except CheckpointNotFoundError:
            continue  # deleted while we listed
        out.append((parse_record(name, doc, f"{store.url}/{record_key(name)}"), doc))
    return sorted(out, key=lambda pair: (pair[0].created, pair[0].name))


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
_HEAD = 512
#: One top-level field whose value is a number, a string without escapes, or a literal.
_SCALAR = re.compile(
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
    while (m := _SCALAR.match(head, pos)) is not None:
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
    """A value :data:`_SCALAR` matched, as ``json.loads`` reads it (a third of the time:
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
    (ties by name, as :func:`list_records`), from the first :data:`_HEAD` bytes of each.

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
            fields = head_fields(store.get_range(record_key(name), 0, _HEAD))
        except FileNotFoundError:
            continue  # deleted while we listed
        except OSError:
            fields = {}  # a folder, say: read_doc says what is wrong
        created = fields.get("created")
        if fields.get("version") in READABLE and _is_moment(created):
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


def data_size(raw: bytes, where: str) -> int:
    """How big the data behind header ``raw`` would be, from its own offsets.

    :func:`~.._file.header.parse_header` then checks the offsets against that size.
    """
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where}: checkpoint header is not valid JSON") from e
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: checkpoint header is {type(doc).__name__}, not an object")
    ends = [0]
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int and 0 <= o <= _MAX_COUNT for o in offsets)
        ):
            raise FormatError(f"{where}: checkpoint header: tensor {name!r:.80} has bad offsets")
        ends.append(offsets[1])
    return max(ends)


def parse_header_text(header_text: object, where: str) -> tuple[Header, Manifest]:
    """A record's ``header`` string, parsed and its manifest read.

    Raises:
        FormatError: Whatever is wrong with it, never another error: a record is input
            like any file, so damage is reported, never a crash of verify() or the CLI.
    """
    if not isinstance(header_text, str):
        raise FormatError(f"{where}: checkpoint record lacks its header")
    try:
        raw = header_text.encode("utf-8")
        header = parse_header(raw, 8 + len(raw) + data_size(raw, where), where)
        return header, read_manifest(header.metadata, header.tensors, where)
    except FormatError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
            RecursionError, MemoryError) as e:  # fmt: skip
        raise FormatError(f"{where}: checkpoint header is malformed ({e!r:.100})") from e


_REQUIRED: Any = object()


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v <= _MAX_COUNT


def _is_moment(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and 0 <= v <= _MAX_TIME


def _is_strings(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(x, str) for k, x in v.items()
    )


def _field(
    doc: Mapping[str, Any],
    where: str,
    key: str,
    ok: Callable[[Any], bool],
    expected: str,
    default: Any = _REQUIRED,
) -> Any:
    if key not in doc and default is not _REQUIRED:
        return default
    if key not in doc:
        raise FormatError(
            f"{where}: checkpoint record lacks {key!r}; restore the record or delete it"
        )
    value = doc[key]
    if not ok(value):
        raise FormatError(
            f"{where}: checkpoint record field {key!r} is {_shown(value)}, expected "
            f"{expected}; restore the record or delete it"
        )
    return value


def parse_record(name: str, doc: Mapping[str, Any], where: str) -> CheckpointRecord:
    """The record's fields, each checked: a record is hostile input like any file.

    Raises:
        FormatError: A field is absent or of the wrong kind, naming it.
    """
    n = "a byte count"
    new_bytes = _field(doc, where, "new_bytes", _is_count, n)
    return CheckpointRecord(
        name=name,
        created=float(
            _field(doc, where, "created", _is_moment, "seconds since 1970 before year 10000")
        ),
        logical_bytes=_field(doc, where, "logical_bytes", _is_count, n),
        stored_bytes=_field(doc, where, "stored_bytes", _is_count, n),
        new_bytes=new_bytes,
        metadata=dict(_field(doc, where, "metadata", _is_strings, "an object of strings", {})),
        framework=_field(
            doc, where, "framework", lambda v: v is None or isinstance(v, str), "a string", None
        ),
        tensors=_field(doc, where, "tensors", _is_count, "a count", 0),
        written_bytes=_field(doc, where, "written_bytes", _is_count, n, new_bytes),
        weights_only=_field(
            doc, where, "weights_only", lambda v: type(v) is bool, "true or false", False
        ),
        labels=tuple(sorted(label_times(doc, where))),
    )


def label_times(doc: Mapping[str, Any], where: str) -> dict[str, float]:
    """A record's ``labels`` field, checked: ``{label: when it was marked}``.

    The field comes before every field whose value is an object or an array (where
    :meth:`Vault.mark` writes it), so the 512 bytes a resume reads of each record tell
    whether it carries a label (:func:`~.marks.marks`) without reading it whole.

    Raises:
        FormatError: It is not an object of at most 8 labels (lowercase letters, digits,
            ``_`` and ``-``) each with a time, or it comes after an object or an array.
    """
    if "labels" not in doc:
        return {}
    value = doc["labels"]
    if not (
        isinstance(value, dict)
        and len(value) <= _MAX_LABELS
        and all(isinstance(k, str) and _LABEL.fullmatch(k) and _is_moment(t)
                for k, t in value.items())
    ):  # fmt: skip
        raise FormatError(
            f"{where}: checkpoint record field 'labels' is {_shown(value)}, expected an "
            f'object of at most {_MAX_LABELS} labels (such as "best") each with the time '
            "it was marked; restore the record or delete it"
        )
    before = list(doc)[: list(doc).index("labels")]
    late = [k for k in before if isinstance(doc[k], (dict, list))]
    if late:
        raise FormatError(
            f"{where}: checkpoint record field 'labels' comes after {late[0]!r}, an object; "
            "it must come before every object and array (where vault.mark writes it); "
            "restore the record or delete it"
        )
    return {k: float(t) for k, t in value.items()}
