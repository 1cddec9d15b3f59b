"""Garbage collection: freeing objects no checkpoint or in-flight save references.

**gc safety.** gc never deletes a key a save may have just decided to reuse. It first
picks candidates (objects no intent or checkpoint names), then *moves* each one into its
trash, ``trash/<gc id>/<digest>``, then reads every intent and checkpoint again: objects
someone now names go back, only the rest are deleted, from the trash. A save checks an
object after its intent is visible (see :mod:`.commit`); if that check came before the
move, the intent (or the checkpoint it became) is visible to the re-read, which puts the
object back; if it came after, the save found the object missing and wrote it again.
However long gc stalls at any point, no checkpoint loses an object.

**Delta bases.** An object stored as a delta (see :mod:`.delta`) needs its base, which
its frame names. Each read of what is live follows those names, transitively, from the
objects' current frames: a save that writes a delta names its base in its intent, and a
checkpoint that reuses a delta object keeps its whole chain. Reads find an object
in a gc's trash while it sits there (:mod:`.objects`), and the trash of a gc that died is
put back by the next gc or by :func:`break_gc_lock`.

**The marker.** A running gc keeps ``gc/<id>.json`` fresh (a heartbeat: pid, host, time);
saves wait while one is fresh (:func:`wait_for_gc`), to avoid churn. It is not what
keeps objects safe.

Example:
    >>> freed = collect(vault.store)      # what Vault.gc() does
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from ..._base.errors import CheckpointNotFoundError, FormatError, VaultBusyError
from ..._file.header import METADATA_KEY
from ..objects.access import (
    DIGEST,
    content_hash,
    is_temp,
    object_key,
    read_object,
    with_bases,
    write_loose,
)
from ..records.checkpoint import check_objects, open_record, record_objects
from ..records.intents import read_intent
from ..records.record import read_doc, record_key, record_names
from ..records.todo import held_packs, pending
from ..store.backend import Blob, Store
from ..store.pack import PACKS, Packed, is_pack, pack_key, pack_table, read_index

__all__ = [
    "GC_HEARTBEAT_SECONDS",
    "GC_STALE_SECONDS",
    "STALE_SECONDS",
    "break_gc_lock",
    "collect",
    "gc_markers",
    "process_start",
    "wait_for_gc",
]

#: An intent or temporary file older than this belongs to a process that died.
STALE_SECONDS = 3600.0
#: A running gc rewrites its marker this often; one not rewritten for GC_STALE_SECONDS
#: belongs to a gc that died or stalls, and saves stop waiting for it. Neither number
#: matters for safety (see the module docstring), only for how long a save may wait.
GC_HEARTBEAT_SECONDS = 10.0
GC_STALE_SECONDS = 60.0

log = logging.getLogger("weightvault")

Beat = Callable[[], None]


class _Heartbeat:
    """A gc's marker, rewritten now and then so saves can tell a live gc from a dead one."""

    def __init__(self, store: Store, key: str) -> None:
        self.store, self.key = store, key
        self.last = 0.0
        self()

    def __call__(self) -> None:
        now = time.time()
        if now - self.last >= GC_HEARTBEAT_SECONDS:
            pid = os.getpid()
            owner = {"pid": pid, "host": socket.gethostname(), "started": process_start(pid)}
            self.store.put(self.key, json.dumps({"created": now, **owner}).encode())
            self.last = now


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), to tell a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # Field 22, counted after the command name, which may itself hold spaces.
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _owner_gone(doc: object) -> bool:
    """Whether a marker's process has provably exited (same host, pid gone or reused)."""
    if not isinstance(doc, dict) or doc.get("host") != socket.gethostname():
        return False  # another machine's gc: only its heartbeat can tell
    pid = doc.get("pid")
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, owned by someone else
    started = doc.get("started")
    now_started = process_start(pid)
    return type(started) is int and now_started is not None and now_started != started


def _ours(doc: object) -> bool:
    """Whether a marker is this process's own gc's (on any of its threads)."""
    if not isinstance(doc, dict) or doc.get("host") != socket.gethostname():
        return False
    pid = os.getpid()
    return doc.get("pid") == pid and doc.get("started") == process_start(pid)


def gc_markers(store: Store, *, others: bool = False) -> list[tuple[Blob, str | None]]:
    """Each gc marker, with why its gc is dead (None: it may be running); ``others``
    leaves out this process's own gc."""
    out: list[tuple[Blob, str | None]] = []
    now = time.time()
    for blob in store.list("gc"):
        if is_temp(blob.key):
            continue
        age = now - blob.mtime
        if age >= GC_STALE_SECONDS:
            out.append((blob, f"its heartbeat is {age:.0f} s old"))
            continue
        try:
            doc = json.loads(store.get(blob.key))
        except FileNotFoundError:
            continue  # that gc just finished
        except (ValueError, RecursionError, OSError):
            doc = None  # a marker being rewritten, or damaged: only its age can tell
        if others and _ours(doc):
            continue
        gone = _owner_gone(doc)
        out.append((blob, "its process has exited" if gone else None))
    return out


def _say_waiting(store: Store, marker: Blob, gc_wait: float) -> None:
    age = max(0.0, time.time() - marker.mtime)
    log.warning(
        "%s: waiting for the gc that holds %s (heartbeat %.0f s old): up to %.0f s, until "
        "its heartbeat is %.0f s old or gc_wait=%.0f s runs out. If that gc was killed on "
        "another machine, 'weightvault vault ROOT gc --break-lock' ends the wait once the "
        "heartbeat is stale",
        store.url,
        marker.key,
        age,
        min(gc_wait, max(0.0, GC_STALE_SECONDS - age)),
        GC_STALE_SECONDS,
        gc_wait,
    )


def wait_for_gc(store: Store, gc_wait: float) -> None:
    """Return once no gc runs; give up after ``gc_wait`` seconds.

    Waiting is not what keeps objects safe (gc re-checks before it deletes anything); it
    only keeps a save from rewriting objects a running gc is about to free. So a gc of
    this very process is not waited for: it is the vault's own background gc (what
    ``training_state_last`` runs on the compactor's thread), which frees the training
    state a retain dropped, not what the next save writes. Waiting for it blocked a
    ``training_state_last=1`` loop's save for the whole gc (0.8 s after 300 saves of the lm
    run), with a warning about a gc on another machine.

    Raises:
        VaultBusyError: A gc's heartbeat stayed fresh for ``gc_wait`` seconds.
    """
    deadline = time.monotonic() + gc_wait
    delay = 0.01
    told = False
    while True:
        running = [b for b, dead in gc_markers(store, others=True) if dead is None]
        if not running:
            return
        if not told:
            _say_waiting(store, running[0], gc_wait)
            told = True
        if time.monotonic() > deadline:
            raise VaultBusyError(
                f"{store.url}: a gc has been running for over {gc_wait:.0f} s "
                f"({running[0].key}); retry later, or run 'weightvault vault ROOT gc "
                "--break-lock' if that gc died"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


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
    """Remove the markers of gcs that died, after putting their trash back.

    See :meth:`weightvault.Vault.break_gc_lock`.

    Raises:
        VaultBusyError: A marker's gc may still be running; nothing was changed.
    """
    markers = gc_markers(store)
    alive = [b for b, dead in markers if dead is None]
    if alive:
        age = time.time() - alive[0].mtime
        raise VaultBusyError(
            f"{store.url}: {alive[0].key}: a gc may still be running (heartbeat "
            f"{age:.0f} s old, under {GC_STALE_SECONDS:.0f} s); nothing was changed. Wait "
            "for it to finish, or stop that process and retry once its heartbeat is stale"
        )
    # No gc runs, so all trash is a dead gc's (even one whose marker was removed).
    restored = _untrash(store, lambda owner: True)
    broken = []
    for blob, why in markers:
        store.delete(blob.key)
        log.warning("%s: removed the marker %s of a dead gc (%s)", store.url, blob.key, why)
        broken.append(blob.key)
    if restored:
        log.warning("%s: put %d objects back from dead gcs' trash", store.url, restored)
    return broken


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


def _live(store: Store, beat: Beat, *, expire_before: float | None) -> set[str]:
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
    reads every record twice (docs/benchmarks.md, section 27). A record of
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
    return set(objects.values())


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

    def checked() -> Iterator[tuple[str, memoryview]]:
        for digest in digests:
            raw = read_object(store, digest, index[digest].size)
            if content_hash(raw) == digest:
                yield digest, raw
            else:
                log.warning(
                    "%s: object %s in pack %s does not match its name; left in its pack",
                    store.url, digest[:12], index[digest].pack,
                )  # fmt: skip

    write_loose(store, checked())


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
    marker = f"gc/{gc_id}.json"
    beat = _Heartbeat(store, marker)
    moved: list[tuple[Blob, str]] = []
    packs: list[_MovedPack] = []
    try:
        running = {
            b.key.rsplit("/", 1)[-1].removesuffix(".json")
            for b, why in gc_markers(store)
            if why is None
        }
        # Trash whose gc has no live marker belongs to a gc that died: put it back, so
        # its objects are judged afresh below.
        _untrash(store, lambda owner: owner != gc_id and owner not in running, beat)
        objects = [b for b in store.list("objects") if not is_temp(b.key)]
        now = time.time()
        live = _live(store, beat, expire_before=now - STALE_SECONDS)
        for blob in objects:
            digest = blob.key.rsplit("/", 1)[-1]
            if digest not in live and store.rename(blob.key, f"trash/{gc_id}/{digest}"):
                moved.append((blob, digest))
                beat()
        packs = _move_packs(store, gc_id, live, beat)
        # The decision: anything named now, after the move, goes back. A save that saw
        # one of these objects before it moved registered its intent before that, so it
        # (or the checkpoint it committed) is visible here.
        live = _live(store, beat, expire_before=None)
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
        store.delete(marker)
