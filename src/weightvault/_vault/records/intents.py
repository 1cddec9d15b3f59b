"""Intents, ``intents/<id>.json``: the objects a save, transfer or compaction will reference.

gc keeps every object an intent names (see :mod:`.commit` and :mod:`.gc`), so a damaged
intent could let gc free an object a save in flight relies on. Every writer names a new
intent with :func:`new_intent_key` and writes it, and rewrites it with a fresh time, with
:func:`write_intent`; gc and verify read it with :func:`read_intent`. An intent is sealed
(:mod:`.seal`)::

    {"version": 2, "created": 1767225600.0, "objects": ["<blake3 hex>", ...], "sum": "..."}

Intents written before seals have no ``version`` and no ``sum``; they are read as before.
One that fails its checks stops gc (it deletes nothing) until it expires.

Example:
    >>> read_intent(encode_intent(["ab" * 32], 1.5), "intents/x.json")
    ['abab...']
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable

from ..._base.errors import FormatError
from ..store.backend import Store
from ..store.seal import seal_json, unseal

__all__ = [
    "INTENT_VERSION",
    "encode_intent",
    "new_intent_key",
    "parse_intent",
    "read_intent",
    "write_intent",
]

#: The version of the intents written: 2 is sealed; an intent without one predates seals.
INTENT_VERSION = 2
_FIX = (
    "gc deletes nothing while it is there: delete it if no save is running (it expires "
    "after an hour)"
)


def encode_intent(objects: Iterable[str], created: float) -> bytes:
    """An intent naming ``objects`` (sorted, once each), sealed."""
    doc = {"version": INTENT_VERSION, "created": created, "objects": sorted(set(objects))}
    return seal_json(doc)


def new_intent_key() -> str:
    """The key of a new intent, ``intents/<random id>.json``, that no other writer uses."""
    return f"intents/{uuid.uuid4().hex}.json"


def write_intent(store: Store, key: str, objects: Iterable[str], *, durable: bool = True) -> None:
    """Write intent ``key`` naming ``objects``, created now; a rewrite replaces it whole.

    Args:
        store: The vault's store.
        key: From :func:`new_intent_key`.
        objects: The digests of every object the writer may reference.
        durable: ``False`` for an intent nothing needs after a crash (see
            :meth:`~.backend.Store.put`).
    """
    store.put(key, encode_intent(objects, time.time()), durable=durable)


def read_intent(raw: bytes | memoryview, where: str) -> list[str]:
    """The objects an intent names, its checksum checked when it has one.

    Raises:
        FormatError: It is not an intent's JSON, or of an unknown version.
        ChecksumError: A sealed intent does not match its checksum.
    """
    return parse_intent(raw, where)[0]


def parse_intent(raw: bytes | memoryview, where: str) -> tuple[list[str], bool]:
    """:func:`read_intent`, and whether the intent carries a checksum."""
    try:
        doc = json.loads(bytes(raw))
    except (ValueError, RecursionError):
        raise FormatError(f"{where}: intent is not JSON; {_FIX}") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: intent is not a JSON object; {_FIX}")
    version = doc.get("version")
    if "version" in doc and (type(version) is not int or version != INTENT_VERSION):
        raise FormatError(f"{where}: intent of unknown version {str(version)[:20]!r}; {_FIX}")
    sealed = unseal(raw, doc, where, "intent", sealed="version" in doc, fix=_FIX)
    objects = doc.get("objects")
    if not isinstance(objects, list) or not all(isinstance(o, str) for o in objects):
        raise FormatError(f"{where}: intent lacks its list of objects; {_FIX}")
    return objects, sealed
