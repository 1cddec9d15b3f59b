"""``vault.json``: what makes a folder (or a URL prefix) a vault.

A vault is created by its first write (a save's intent, see :mod:`.commit`) or by
``Vault(path, create=True)``, never by opening it: ``Vault("typo")`` followed by a read
raises :class:`VaultNotFoundError` and leaves nothing behind.

``vault.json`` is sealed by its checksum (:mod:`.seal`)::

    {"format":"weightvault-vault","version":2,"hash":"blake3","sum":"<xxh3-128 hex>"}

A marker written before seals holds the first three fields only and is read as before.

Example:
    >>> holds_vault(open_store("runs/none-yet"))
    False
"""

from __future__ import annotations

import json
from typing import Any

from ..._base.errors import ChecksumError, FormatError, VaultNotFoundError, capped
from .backend import Store
from .seal import SUM, seal_json, unseal

__all__ = [
    "FORMAT",
    "LAYOUT",
    "MARKER",
    "create_vault",
    "holds_vault",
    "layout_of",
    "require_vault",
    "upgrade_vault",
]

FORMAT = "weightvault-vault"
MARKER = "vault.json"
#: The layout version ``vault.json`` records: 1, objects only under ``objects/``; 2, a
#: save's small objects may sit in a pack under ``packs/`` (:mod:`.pack`) until the
#: compactor takes them out. Both are read; a vault becomes 2 when a save writes a pack.
LAYOUT = 2
_READS = (1, 2)
#: The fields of ``vault.json`` besides its checksum (:mod:`.seal`).
_KEYS = {"format", "version", "hash"}


def _not_a_vault(store: Store, why: str) -> FormatError:
    return FormatError(
        f"{store.url}: {why}, not a weightvault vault of version {LAYOUT}; point Vault() "
        "at an empty folder, a new path, or an existing vault"
    )


def holds_vault(store: Store) -> bool:
    """Whether the store's root holds a vault; ``False`` if it holds nothing of one yet.

    Raises:
        FormatError: The root is a file, or its ``vault.json`` is not one of ours, or is
            of a format version this code does not know.
    """
    try:
        raw = store.get(MARKER)
    except (FileNotFoundError, NotADirectoryError):
        if store.root_is_file():
            raise _not_a_vault(store, "this is a file") from None
        return False
    except IsADirectoryError:
        raise _not_a_vault(store, "vault.json is a folder") from None
    try:
        found = json.loads(raw)
        ours = found.get("format") == FORMAT
        version = found.get("version")
    except (ValueError, AttributeError, RecursionError):
        ours, version = False, None
    if ours:
        _unseal(bytes(raw), found, f"{store.url}/{MARKER}")
    if ours and version not in _READS:
        raise FormatError(
            f"{store.url}/{MARKER}: vault format version {version!r}, which this "
            f"weightvault does not know (it reads versions {', '.join(map(str, _READS))}); "
            "upgrade weightvault on this machine"
        )
    if not ours:
        raise _not_a_vault(store, "vault.json is another file")
    return True


def _unseal(raw: bytes, doc: dict[str, Any], where: str) -> bool:
    """Check the checksum of ``vault.json``; whether it has one.

    Every marker this code writes is sealed, and one written before holds only
    :data:`_KEYS`: so a marker holding anything else (``"sux"``, a ``"sum"`` whose
    name one changed byte damaged) is refused, and no change of one byte makes a sealed
    marker one read unchecked.

    Raises:
        ChecksumError: The marker holds another field, or its checksum does not match.
    """
    fix = "restore it from a mirror, or write it anew as docs/format.md shows"
    extra = sorted(set(doc) - _KEYS - {SUM})
    if extra:
        raise ChecksumError(
            f"{where}: vault.json holds {capped(repr(k)[:40] for k in extra)}, which no "
            f"weightvault writes: it is damaged; {fix}"
        )
    return unseal(raw, doc, where, "vault.json", sealed=SUM in doc, fix=fix)


def _marker(version: int) -> bytes:
    return seal_json({"format": FORMAT, "version": version, "hash": "blake3"})


def create_vault(store: Store) -> None:
    """Make the root a vault, unless it is one already (the first writer wins).

    Raises:
        FormatError: The root holds something that is not a vault.
    """
    if holds_vault(store):
        return
    if not store.put(MARKER, _marker(LAYOUT), exclusive=True):
        holds_vault(store)  # another writer made it meanwhile: check it is a vault


def layout_of(store: Store) -> int:
    """The layout version ``vault.json`` records (the vault must exist)."""
    version = json.loads(store.get(MARKER)).get("version")
    return version if isinstance(version, int) else 1


def upgrade_vault(store: Store) -> None:
    """Record layout :data:`LAYOUT` in a vault created by an older weightvault, before
    the first pack is written: a weightvault that reads only layout 1 then refuses the
    vault by its version instead of finding packed objects missing."""
    if layout_of(store) < LAYOUT:
        store.put(MARKER, _marker(LAYOUT))


def require_vault(store: Store) -> None:
    """Refuse to read a path that holds no vault.

    Raises:
        VaultNotFoundError: Nothing there is a vault yet; names the path and the fix.
        FormatError: The root holds something that is not a vault.
    """
    if not holds_vault(store):
        raise VaultNotFoundError(
            f"{store.url}: no vault here (no vault.json); check the path, or save a "
            "checkpoint first: a vault is created by its first save, or by "
            "Vault(path, create=True)"
        )
