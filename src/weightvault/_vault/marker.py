"""``vault.json``: what makes a folder (or a URL prefix) a vault.

A vault is created by its first write (a save's intent, see :mod:`.commit`) or by
``Vault(path, create=True)``, never by opening it: ``Vault("typo")`` followed by a read
raises :class:`VaultNotFoundError` and leaves nothing behind.

Example:
    >>> holds_vault(open_store("runs/none-yet"))
    False
"""

from __future__ import annotations

import json

from .._base.errors import FormatError, VaultNotFoundError
from .store import Store

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
    if ours and version not in _READS:
        raise FormatError(
            f"{store.url}/{MARKER}: vault format version {version!r}, which this "
            f"weightvault does not know (it reads versions {', '.join(map(str, _READS))}); "
            "upgrade weightvault on this machine"
        )
    if not ours:
        raise _not_a_vault(store, "vault.json is another file")
    return True


def create_vault(store: Store) -> None:
    """Make the root a vault, unless it is one already (the first writer wins).

    Raises:
        FormatError: The root holds something that is not a vault.
    """
    if holds_vault(store):
        return
    marker = {"format": FORMAT, "version": LAYOUT, "hash": "blake3"}
    if not store.put(MARKER, json.dumps(marker).encode(), exclusive=True):
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
        marker = {"format": FORMAT, "version": LAYOUT, "hash": "blake3"}
        store.put(MARKER, json.dumps(marker).encode())


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
