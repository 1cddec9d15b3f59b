"""Garbage collection: freeing objects no checkpoint or in-flight save references.

**gc safety.** gc never deletes a key a save may have just decided to reuse. It first
picks candidates (objects no intent or checkpoint names), then *moves* each one into its
trash, ``trash/<gc id>/<digest>``, then reads every intent and checkpoint again: objects
someone now names go back, only the rest are deleted, from the trash. A save checks an
object after its intent is visible (see :mod:`..writing.commit`); if that check came
before the move, the intent (or the checkpoint it became) is visible to the re-read,
which puts the object back; if it came after, the save found the object missing and
wrote it again. However long gc stalls at any point, no checkpoint loses an object.

**Delta bases.** An object stored as a delta (see :mod:`..objects.encoding`) needs its
base, which its frame names. Each read of what is live follows those names,
transitively, from the objects' current frames: a save that writes a delta names its
base in its intent, and a checkpoint that reuses a delta object keeps its whole chain.
Reads find an object in a gc's trash while it sits there (:mod:`..objects.access`), and
the trash of a gc that died is put back by the next gc or by :func:`break_gc_lock`.

**The lease.** A running gc keeps its lease, ``gc/<id>.json``, fresh (a heartbeat: pid,
host, time; :mod:`..store.lease`); saves wait while one is fresh
(:func:`~..store.lease.wait_for_gc`), to avoid churn. It is not what keeps objects safe.
What is live is found by :mod:`.live`; packs are taken apart by :mod:`.unpack`.

Example:
    >>> freed = collect(vault.store)      # what Vault.gc() does
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

from ..._base.errors import ChecksumError, FormatError, VaultBusyError
from ..objects.address import DIGEST, is_temp, object_key
from ..objects.read import read_verified
from ..records.todo import held_packs, pending
from ..store import lease
from ..store.backend import Blob, Store
from ..store.lease import (  # the names gc has always offered
    GC_HEARTBEAT_SECONDS,
    GC_STALE_SECONDS,
    Lease,
    gc_leases,
    process_start,
)
from ..store.pack import PACKS, Packed, is_pack, pack_key, pack_table, read_index
from .live import STALE_SECONDS, Beat, live_objects
from .unpack import unpack

__all__ = [
    "GC_HEARTBEAT_SECONDS",
    "GC_STALE_SECONDS",
    "STALE_SECONDS",
    "break_gc_lock",
    "collect",
    "gc_leases",
    "process_start",
]

log = logging.getLogger("weightvault")


def _untrash(store: Store, whose: Callable[[str], bool], beat: Beat = lambda: None) -> int:
    """Move objects back from the trash of every gc ``whose(id)`` selects."""
    restored = 0
    for blob in store.list("trash"):
        parts = blob.key.split("/")
        if len(parts) != 3 or is_temp(blob.key):
            continue
        if is_pack(parts[2]):
            home = pack_key(parts[2])
        elif DIGEST.fullmatch(parts[2]):
            home = object_key(parts[2])
        else:
            continue
        if whose(parts[1]) and store.put_back(blob.key, home):
            restored += 1
            beat()
    return restored


def break_gc_lock(store: Store) -> list[str]:
    """Remove the leases of gcs that died, after putting their trash back.

    See :meth:`weightvault.Vault.break_gc_lock`.

    Raises:
        VaultBusyError: A lease's gc may still be running; nothing was changed.
    """
    leases = gc_leases(store)
    alive = [b for b, dead in leases if dead is None]
    if alive:
        age = time.time() - alive[0].mtime
        raise VaultBusyError(
            f"{store.url}: {alive[0].key}: a gc may still be running (heartbeat "
            f"{age:.0f} s old, under {lease.GC_STALE_SECONDS:.0f} s); nothing was changed. Wait "
            "for it to finish, or stop that process and retry once its heartbeat is stale"
        )
    # No gc runs, so all trash is a dead gc's (even one whose lease was removed).
    restored = _untrash(store, lambda owner: True)
    broken = []
    for blob, why in leases:
        store.delete(blob.key)
        log.warning("%s: removed the marker %s of a dead gc (%s)", store.url, blob.key, why)
        broken.append(blob.key)
    if restored:
        log.warning("%s: put %d objects back from dead gcs' trash", store.url, restored)
    return broken


def _free_trash(
    store: Store, gc_id: str, moved: list[tuple[Blob, str]], live: set[str], beat: Beat
) -> int:
    """Put back what ``live`` names, delete the rest; return the bytes freed."""
    freed = 0
    while moved:
        blob, digest = moved.pop()
        if digest in live:
            store.put_back(f"trash/{gc_id}/{digest}", blob.key)
        else:
            store.delete(f"trash/{gc_id}/{digest}")
            freed += blob.size
        beat()
    return freed


def _remove_dead_temps(store: Store, now: float) -> int:
    """Delete temporary files of writers that died long ago; return object bytes freed.

    Like stale intents, bookkeeping files are removed without counting: what gc reports
    is tensor data freed, that is, bytes under ``objects/``.
    """
    freed = 0
    for blob in store.list(""):
        if is_temp(blob.key) and now - blob.mtime > STALE_SECONDS:
            store.delete(blob.key)
            if blob.key.startswith(("objects/", f"{PACKS}/")):
                freed += blob.size
    return freed


#: A pack moved to a gc's trash: its listing, its file name and its index.
_MovedPack = tuple[Blob, str, dict[str, Packed]]


def _copy_out(store: Store, index: dict[str, Packed], digests: list[str]) -> None:
    """Write ``digests`` loose, raw, from their pack, each checked against its name."""

    def checked(digest: str, nbytes: int) -> memoryview | None:
        try:
            return read_verified(store, digest, nbytes)
        except ChecksumError:
            log.warning(
                "%s: object %s in pack %s does not match its name; left in its pack",
                store.url, digest[:12], index[digest].pack,
            )  # fmt: skip
            return None

    unpack(store, ((d, index[d].size) for d in digests), checked)


def _move_packs(store: Store, gc_id: str, live: set[str], beat: Beat) -> list[_MovedPack]:
    """Move to the trash every pack that holds no live object without a loose copy.

    A pack that holds some, and more dead bytes than live ones, is repacked first: its
    live objects written loose (packs are never rewritten in place). One whose stranded
    objects the compactor will take out is left to it; a damaged pack is left as found
    (verify reports the tensors it held).
    """
    moved: list[_MovedPack] = []
    held: set[str] | None = None
    for blob in store.list(PACKS):
        leaf = blob.key.rsplit("/", 1)[-1]
        if not is_pack(leaf):
            continue
        try:
            index = read_index(store, blob.key)
        except (FileNotFoundError, FormatError):
            continue
        stranded = [d for d in index if d in live and not store.exists(object_key(d))]
        if stranded:
            if held is None:
                # The packs of checkpoints the compactor has not finished: it takes them
                # apart itself (written loose here, they would only be rewritten).
                held = held_packs(store, set(pending(store)))
            dead = sum(p.size for d, p in index.items() if d not in live)
            if leaf in held or 2 * dead < blob.size:
                continue
            _copy_out(store, index, stranded)
            if not all(store.exists(object_key(d)) for d in stranded):
                continue
        if store.rename(blob.key, f"trash/{gc_id}/{leaf}"):
            moved.append((blob, leaf, index))
            beat()
    return moved


def _free_packs(
    store: Store, gc_id: str, moved: list[_MovedPack], live: set[str], beat: Beat
) -> int:
    """Put back each moved pack that holds an object now live and not loose; delete the
    rest; return the bytes freed."""
    freed = 0
    while moved:
        blob, leaf, index = moved.pop()
        if any(d in live and not store.exists(object_key(d)) for d in index):
            store.put_back(f"trash/{gc_id}/{leaf}", blob.key)
        else:
            store.delete(f"trash/{gc_id}/{leaf}")
            pack_table(store).forget(leaf)
            freed += blob.size
        beat()
    return freed


def collect(store: Store) -> int:
    """One gc run (see the module docstring); returns the object bytes freed.

    Raises:
        FormatError: A checkpoint record or intent is unreadable; every object is left
            in place.
    """
    gc_id = uuid.uuid4().hex
    held = Lease(store, f"gc/{gc_id}.json", every=lease.GC_HEARTBEAT_SECONDS)
    held.take()
    beat = held.beat
    moved: list[tuple[Blob, str]] = []
    packs: list[_MovedPack] = []
    try:
        running = {
            b.key.rsplit("/", 1)[-1].removesuffix(".json")
            for b, why in gc_leases(store)
            if why is None
        }
        # Trash whose gc has no live lease belongs to a gc that died: put it back, so
        # its objects are judged afresh below.
        _untrash(store, lambda owner: owner != gc_id and owner not in running, beat)
        objects = [b for b in store.list("objects") if not is_temp(b.key)]
        now = time.time()
        live = live_objects(store, beat, expire_before=now - STALE_SECONDS)
        for blob in objects:
            digest = blob.key.rsplit("/", 1)[-1]
            if digest not in live and store.rename(blob.key, f"trash/{gc_id}/{digest}"):
                moved.append((blob, digest))
                beat()
        packs = _move_packs(store, gc_id, live, beat)
        # The decision: anything named now, after the move, goes back. A save that saw
        # one of these objects before it moved registered its intent before that, so it
        # (or the checkpoint it committed) is visible here.
        live = live_objects(store, beat, expire_before=None)
        freed = _free_trash(store, gc_id, moved, live, beat)
        # After the loose objects: a pack goes back only if one of its live objects has
        # no loose copy once those are back.
        freed += _free_packs(store, gc_id, packs, live, beat)
        return freed + _remove_dead_temps(store, now)
    finally:
        # On any error, whatever is still in the trash goes back before gc stops.
        for blob, digest in moved:
            store.put_back(f"trash/{gc_id}/{digest}", blob.key)
        for blob, leaf, _ in packs:
            store.put_back(f"trash/{gc_id}/{leaf}", blob.key)
        held.drop()
