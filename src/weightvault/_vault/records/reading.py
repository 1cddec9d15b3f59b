"""Reading, rewriting and deleting records, each read checked against its own seal.

Every read of ``checkpoints/<name>.json`` goes through :func:`read_sealed`: a record that
is missing, not JSON, of an unknown version or whose bytes fail their checksum raises
an error naming the record. :func:`rewrite_record` replaces one atomically and never
brings back a deleted one.

Example:
    >>> read_doc(vault.store, "000001")["version"]
    2
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

from ..._base.errors import CheckpointExistsError, CheckpointNotFoundError, FormatError, capped
from ..store.backend import Store
from ..store.seal import unseal
from .names import check_name, record_key, record_names
from .record import READABLE, CheckpointRecord, encode_record, parse_record

__all__ = [
    "check_free",
    "delete_record",
    "list_docs",
    "list_records",
    "read_doc",
    "read_sealed",
    "rewrite_record",
]

#: What a damaged record's message suggests.
_FIX = "restore the record from a mirror (vault.pull) or delete the checkpoint"


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
