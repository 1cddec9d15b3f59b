"""Sealed JSON: the checksum a vault's small metadata files carry.

Pack indexes (:mod:`.pack`), intents (:mod:`.intents`) and ``vault.json``
(:mod:`.marker`) are JSON objects whose last field is ``"sum"``: the xxh3-128 of every
byte before that field, the JSON closed by ``}``. It is the seal checkpoint records carry
(:func:`~.records.encode_record`), so one rule reads them all: a file that must be sealed
(by its version, or, for ``vault.json``, by the keys it may hold) ends with its sum, and
a file written before seals existed holds no ``"sum"`` at all. No change of one byte (a
version digit, a letter of the field's name, a digit of its value) turns a sealed file
into one that is read unchecked.

Example:
    >>> raw = seal_json({"version": 2, "objects": []})
    >>> raw[:30]
    b'{"version":2,"objects":[],"sum'
    >>> unseal(raw, json.loads(raw), "intents/x.json", "intent", sealed=True, fix="...")
    True
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import xxhash

from ..._base.errors import ChecksumError

__all__ = ["SUM", "seal", "seal_json", "unseal"]

#: The field that seals a file.
SUM = "sum"
#: A sealed file's last field: ``,"sum":"<xxh3-128 hex>"}`` closes the JSON.
_TAIL = re.compile(rb',"sum":"([0-9a-f]{32})"\}\Z')


def seal(body: bytes) -> bytes:
    """``body`` (a compact JSON object of at least one field) with its sum as last field."""
    assert body.endswith(b"}") and body != b"{}", "a sealed file holds at least one field"
    return body[:-1] + b',"sum":"' + xxhash.xxh3_128_hexdigest(body).encode() + b'"}'


def seal_json(doc: Mapping[str, Any], *, sort_keys: bool = False) -> bytes:
    """``doc`` as compact JSON, sealed (a ``"sum"`` it holds is replaced)."""
    body = json.dumps(
        {k: v for k, v in doc.items() if k != SUM}, separators=(",", ":"), sort_keys=sort_keys
    )
    return seal(body.encode())


def unseal(
    raw: bytes | memoryview, doc: dict[str, Any], where: str, what: str, *, sealed: bool, fix: str
) -> bool:
    """Check the sum of a file read as ``doc`` and take it out of ``doc``; whether it had one.

    Args:
        raw: The file's bytes, as read.
        doc: The same bytes parsed as JSON.
        where: The file, for messages.
        what: What it is (``"pack index"``), for messages.
        sealed: Whether its version says it is sealed; a file that is not must hold no
            ``"sum"`` (one whose version was damaged).
        fix: The one fix a message suggests.

    Raises:
        ChecksumError: The sum is missing, misplaced or does not match, or a file that
            is not sealed holds one.
    """
    if not sealed:
        if SUM in doc:
            raise ChecksumError(
                f"{where}: this {what} holds a checksum, which only a sealed {what} has: "
                f"its version is damaged; {fix}"
            )
        return False
    data = bytes(raw).rstrip(b" \n")
    tail = _TAIL.search(data)
    if tail is None or doc.get(SUM) != tail.group(1).decode():
        raise ChecksumError(
            f'{where}: {what} does not end with its checksum (a "sum" of 32 hex digits): '
            f"it is damaged or was edited; {fix}"
        )
    found = xxhash.xxh3_128_hexdigest(data[: tail.start()] + b"}")
    if found != doc[SUM]:
        raise ChecksumError(
            f"{where}: {what}'s checksum does not match its bytes (stored {doc[SUM][:12]}..., "
            f"computed {found[:12]}...): it is damaged or was edited; {fix}"
        )
    del doc[SUM]
    return True
