"""The record format: ``checkpoints/<name>.json``, what it holds and how it is parsed.

A record is the commit of one checkpoint: its creation time, byte counts, your metadata,
the safetensors header the checkpoint would have as one file, and the object of each
stored tensor (or, for DCP checkpoints, of each chunk). Records are input like any file:
every field is checked before use, and damage raises :class:`FormatError` naming the
record and the field, never a crash. Names live in :mod:`.names`, reading and rewriting
in :mod:`.reading`, and the order of records in :mod:`.order`.

Example:
    >>> parse_record("000001", read_doc(vault.store, "000001"), "runs/ft").tensors
    70
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..._base.errors import FormatError
from ..._file.header import Header, parse_header
from ..._file.manifest import Manifest, read_manifest
from ..store.seal import seal_json

__all__ = [
    "READABLE",
    "VERSION",
    "CheckpointRecord",
    "data_size",
    "encode_record",
    "is_moment",
    "label_times",
    "object_digests",
    "object_map",
    "parse_header_text",
    "parse_record",
]

#: The version of every record this code writes: 2 is a record sealed by its own
#: checksum (``"sum"``, the last field), 1 one written before records were sealed.
VERSION = 2
#: The record versions this code reads.
READABLE = (1, 2)
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


#: What a label in a record may look like (a record is hostile input), and how many.
_LABEL = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_MAX_LABELS = 8


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


def is_moment(v: Any) -> bool:
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


def object_map(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The record ``doc``'s ``objects``, ``{stored tensor: object name}``, unchecked, or
    ``None`` where it holds none that is a JSON object. Every reader of a record's
    objects starts here: :func:`object_digests`, and a load's
    :func:`~.checkpoint.record_objects`.

    Example:
        >>> object_map({"objects": {"w": "ab12"}})
        {'w': 'ab12'}
    """
    objects = doc.get("objects")
    return objects if isinstance(objects, dict) else None


def object_digests(doc: Mapping[str, Any]) -> set[str] | None:
    """The objects the record ``doc`` names: every digest its ``objects`` holds, checked
    for type only (a load checks them against the header); ``None`` for a record that
    names chunks, not objects (DCP), or holds no ``objects``.

    Example:
        >>> object_digests({"objects": {"w": "ab12", "b": "cd34"}}) == {"ab12", "cd34"}
        True
    """
    objects = object_map(doc)
    if doc.get("kind") is not None or objects is None:
        return None
    return {d for d in objects.values() if isinstance(d, str)}


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
            _field(doc, where, "created", is_moment, "seconds since 1970 before year 10000")
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
        and all(isinstance(k, str) and _LABEL.fullmatch(k) and is_moment(t)
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
