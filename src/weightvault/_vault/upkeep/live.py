"""What gc keeps: every object an intent or a checkpoint names, and the delta bases those need.

Intents are read before records, so a save that commits and drops its intent between
the two reads is still seen, as a checkpoint; then each delta's base is followed, from
the objects' current frames, to the full object its chain ends at.

Example:
    >>> live = live_objects(vault.store, lambda: None, expire_before=None)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..._base.errors import CheckpointNotFoundError, FormatError
from ..._file.header import METADATA_KEY
from ..objects.address import is_temp
from ..objects.chain import with_bases
from ..records.checkpoint import check_objects, open_record, record_objects
from ..records.intents import read_intent
from ..records.names import record_key, record_names
from ..records.reading import read_doc
from ..records.record import object_digests
from ..store.backend import Store

__all__ = ["STALE_SECONDS", "live_objects", "named_objects"]

#: An intent or temporary file older than this belongs to a process that died.
STALE_SECONDS = 3600.0

Beat = Callable[[], None]


def _intent_objects(store: Store, beat: Beat, expire_before: float | None) -> set[str]:
    """Every object an intent names; removes intents older than ``expire_before``."""
    live: set[str] = set()
    for blob in store.list("intents"):
        if is_temp(blob.key):
            continue  # an intent still being written; its save has not looked yet
        if expire_before is not None and blob.mtime < expire_before:
            store.delete(blob.key)  # its save died
            continue
        if blob.size == 0:
            # Intents are not fsynced (they only need to be seen): a power loss can leave
            # one empty. A live save's intent is renamed into place whole, never empty.
            store.delete(blob.key)
            continue
        try:
            live |= set(read_intent(store.get(blob.key), f"{store.url}/{blob.key}"))
        except FileNotFoundError:
            continue  # its save finished; its checkpoint is read next
        # A damaged intent (read_intent's FormatError) stops gc: it deletes nothing.
        beat()
    return live


def live_objects(store: Store, beat: Beat, *, expire_before: float | None) -> set[str]:
    """Every object an intent or a checkpoint names, and every delta base those need."""
    # Intents before checkpoints: a save that commits and drops its intent between the
    # two reads is then still seen, as a checkpoint.
    live = _intent_objects(store, beat, expire_before)
    for name in record_names(store):
        try:
            live |= named_objects(store, name, read_doc(store, name))
        except CheckpointNotFoundError:
            continue
        except FormatError as e:
            raise FormatError(
                f"{e}; gc deleted nothing, since it cannot tell which objects that "
                f"checkpoint needs. Remove it with vault.delete({name!r}) or restore it"
            ) from e
        beat()
    # A delta needs its base, and the base its own: each frame names the next.
    return with_bases(store, live, beat)


def named_objects(store: Store, name: str, doc: dict[str, Any]) -> set[str]:
    """The objects checkpoint ``name``'s record ``doc`` names.

    What gc needs of a record is which objects it names: its ``objects``, whose names must
    be exactly its header's tensors, each a digest. Checking only that takes 0.07 ms per
    record of the lm run, where building every tensor's and the manifest's entries as a
    load does (:func:`open_record`) took 1.2 ms: two thirds of a gc after 300 saves, which
    reads every record twice (docs/benchmarks-log.md, section 27). A record of
    ``weightvault.dcp`` names its chunks in its header: it is opened whole.

    Raises:
        FormatError: The record does not say which objects it needs.
    """
    if doc.get("kind") is not None:
        return set(open_record(store, name, doc).objects.values())
    where = f"{store.url}/{record_key(name)}"
    objects, header = record_objects(doc, where)
    try:
        tensors = json.loads(header)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where}: checkpoint header is malformed ({e!r:.100})") from e
    names = tensors.keys() - {METADATA_KEY} if isinstance(tensors, dict) else None
    check_objects(objects, names, where)
    return object_digests(doc) or set()  # every one a digest, checked just now
