"""The compactor: compression and backward deltas, after a save has committed.

A save writes raw objects and leaves a to-do marker, ``compact/<name>.todo``, beside its
record (:func:`mark`). Compacting checkpoint N then does two things:

1. **The newest loads whole.** Each object of N becomes a full compressed object (a
   frame, when that saves at least 5%), or stays raw. The background compactor
   (``settle=False``) leaves raw the objects that are new in the newest checkpoint, and
   its marker in place: a resume, which reads the newest, then copies raw bytes instead
   of decoding them, and the next save's compaction turns them into deltas (or full
   compressed objects) anyway. Objects the newest shares with the checkpoint before it,
   and its frozen tensors' objects (a frozen backbone), are compressed at once, but only
   when that saves at least ``1 - SHARED_PAYS`` (a quarter) of them: every resume of every
   checkpoint that shares one decodes it, and the vault stores it once already, so on
   trained fp32 weights (about 0.84) they stay raw. :meth:`Vault.compact`, ``gc`` and
   ``weightvault vault compact`` settle: they compress the newest too.
2. **Deltas point back.** Each object X of the checkpoint before N (P) whose tensor (same
   name, dtype and shape) has another object Y in N becomes a delta on Y, when that is
   smaller than X in full. So a resume reads one object per tensor, and older
   checkpoints read a chain that ends at a newer full object. At most ``max_chain``
   deltas ever hang behind one full object: an X with that many behind it stays full
   (a *key object*), so any checkpoint reads at most ``max_chain + 1`` objects per
   tensor. Training state dropped from old checkpoints is never the base of a kept one.
3. **A resumable oldest loads whole too.** The oldest checkpoint, when it holds training
   state (a run's start, what a user restarts from), is never turned into deltas. When
   deleting checkpoints makes a delta checkpoint the oldest (or the newest: deleting the
   newest leaves the one before it a delta on what went), ``Vault.delete`` and
   ``retain`` leave it a to-do marker, and its compaction makes its delta objects full
   again (the newest's too when the background compactor leaves its raw objects raw); a
   crash between the two leaves it deltas, loadable. In a run of ``max_chain + 1``
   checkpoints that costs nothing (the two full objects are the newest and the oldest
   instead of the newest and the one ``max_chain`` behind it); otherwise at most one
   more full object per tensor than chains alone would keep. A weights-only oldest
   (``training_state_last``, or a retain that dropped its state later and left it a
   marker) is history: its full objects become deltas on the next checkpoint's, onto
   that object's chain when it is short enough (:func:`_delta_oldest`), so a retain
   after the run leaves what ``Vault(training_state_last=N)`` would have.

An object is named by the blake3 of its raw bytes, so a new encoding replaces the old
one atomically (a rename over it) and every reader, before or after, gets the same raw
bytes. Safety, point by point:

- **Never from damaged bytes.** Every object is decoded and its blake3 checked against
  its name before anything is encoded from it. A damaged object is reported and left as
  it is; nothing is built on it.
- **No cycle.** A delta's base is always a full (or raw) object when the delta is
  written: Y is made full and published before X is encoded against it. Only one
  compactor runs per vault at a time (:class:`CompactLock`: an ``flock`` on a local disk,
  which the kernel releases when a process dies; an exclusive marker with a heartbeat on
  object stores), so nothing turns Y into a delta meanwhile.
- **gc.** The compactor registers an intent naming every object it touches (:mod:`.commit`)
  and checks them in ``objects/`` after that, as a save does; gc keeps every base a live
  object's frame names, read afresh each time (:mod:`.gc`).
- **Crashes.** Each replacement is written to a temporary file, made durable, then
  renamed into place; a SIGKILL leaves the old encoding or the new, and at most a
  temporary file gc removes. The marker goes only once its checkpoint is done, so work
  left when a process exits is picked up by the next compaction.

Example:
    >>> report = compact(vault.store, vault.storage)
    >>> report.checkpoints
    ['000001', '000002']
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..._base.dtypes import ITEMSIZE
from ..._base.errors import CheckpointNotFoundError, FormatError
from ..._file.layout import is_training
from ..objects.access import checksum, content_hash, object_key, read_object, write_loose
from ..objects.encoding import (
    PAYS,
    SHARED_PAYS,
    Parts,
    Storage,
    delta_wins,
    encode_delta,
    encode_full,
    size_of,
)
from ..objects.frame import HEADER_SIZE, decode_into, is_frame, parse_frame, parse_frame_header
from ..records.record import creation_order, read_doc, record_key, record_names
from ..records.todo import TODO, held_packs, mark, pending, todo_key
from ..store.backend import Store
from ..store.pack import Packed, find, pack_key, pack_table
from ..writing.commit import begin, release

__all__ = [
    "LOCK",
    "TODO",
    "CompactLock",
    "CompactReport",
    "compact",
    "held_packs",
    "mark",
    "pending",
]

#: Where the lock lives, beside the to-do markers (:mod:`.todo`).
LOCK = f"{TODO}/lock"
#: A lock marker on an object store not rewritten for this long belongs to a dead
#: compactor (its heartbeat is rewritten every tenth of it).
LOCK_STALE_SECONDS = 60.0


@dataclass
class CompactReport:
    """What one compaction did.

    Attributes:
        checkpoints: The checkpoints compacted, oldest first.
        full: Objects rewritten as full compressed objects.
        deltas: Objects rewritten as deltas on the next checkpoint's.
        bytes_before: Their files' bytes before.
        bytes_after: Their files' bytes after.
        damaged: One line per damaged object found (left as it is).
        unpacked: Objects taken out of pack files raw (:mod:`.pack`).
        packs_deleted: Pack files deleted once every object in them was loose.
        busy: Another process held the vault's compaction lock; nothing was done.
        seconds: Wall time.
    """

    checkpoints: list[str] = field(default_factory=list)
    full: int = 0
    deltas: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    damaged: list[str] = field(default_factory=list)
    unpacked: int = 0
    packs_deleted: int = 0
    busy: bool = False
    seconds: float = 0.0


class CompactLock:
    """One compactor per vault at a time.

    On a local disk, ``flock`` on ``compact/lock``: the kernel drops it when the holder's
    process dies, SIGKILL included, so no stale lock is ever left. On object stores, an
    exclusive ``compact/lock`` marker holding the owner and rewritten as a heartbeat; one
    older than :data:`LOCK_STALE_SECONDS`, or written on this host by a process that
    has exited, is taken over.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._fd = -1
        self._beat = 0.0

    def acquire(self) -> bool:
        """Take the lock if it is free; whether it was taken."""
        path = self.store.local_path(LOCK)
        if path is not None:
            import fcntl

            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            self._fd = fd
            return True
        for attempt in range(2):  # a stale marker is removed once, then tried again
            if self.store.put(LOCK, self._owner(), exclusive=True):
                self._beat = time.monotonic()
                return True
            if attempt or not self._stale():
                return False
            self.store.delete(LOCK)
        return False

    def beat(self) -> None:
        """Refresh an object store's marker (a no-op for ``flock``)."""
        if self._fd < 0 and time.monotonic() - self._beat > LOCK_STALE_SECONDS / 10:
            self.store.put(LOCK, self._owner())
            self._beat = time.monotonic()

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the flock; the file stays for the next holder
            self._fd = -1
        else:
            self.store.delete(LOCK)

    def _owner(self) -> bytes:
        from .gc import process_start

        pid = os.getpid()
        doc = {"pid": pid, "host": socket.gethostname(), "started": process_start(pid)}
        return json.dumps({"created": time.time(), **doc}).encode()

    def _stale(self) -> bool:
        from .gc import _owner_gone

        blobs = [b for b in self.store.list(TODO) if b.key == LOCK]
        if not blobs:
            return True
        if time.time() - blobs[0].mtime > LOCK_STALE_SECONDS:
            return True
        try:
            return _owner_gone(json.loads(self.store.get(LOCK)))
        except (FileNotFoundError, ValueError, RecursionError):
            return False


#: ``{stored name: (digest, dtype, shape, nbytes)}`` of one checkpoint.
Tensors = dict[str, tuple[str, str, tuple[int, ...], int]]


class _Records:
    """The checkpoints, oldest first, and their tensors, read once per compaction."""

    def __init__(self, store: Store) -> None:
        self.store = store
        listed = record_names(store)
        self.listed = set(listed)  # damaged ones too: what a second listing sees
        # Ordered from the start of each record; a record is read whole only when its
        # tensors are needed (every record whole cost each pass 0.23 ms per checkpoint
        # the vault holds: docs/benchmarks.md, section 26). A record damaged past its
        # start is listed, and its tensors are None: its objects stay as they are, and
        # the checkpoints on either side of it are not paired (verify reports it).
        order = creation_order(store, listed, skip_damaged=True)
        self.names = [name for _, name in order]
        self._tensors: dict[str, Tensors | None] = {}
        self._frozen: dict[str, set[str]] = {}
        #: Each record's size when its tensors were read (see :meth:`still_named`).
        self._sizes: dict[str, int | None] = {}

    def oldest(self) -> str | None:
        """The oldest checkpoint whose tensors the compactor handles (not DCP's)."""
        return next((n for n in self.names if self.tensors(n) is not None), None)

    def still_named(self, name: str, tensor: str, digest: str) -> bool:
        """Whether checkpoint ``name``'s record still names ``digest`` for ``tensor``.

        A retain may drop a checkpoint's training state while it is being compacted
        (a loop's ``training_state_last`` does so right after each save): its objects are
        then about to be freed, and rewriting them would only leave garbage. The record is
        read again only when its file's size changed (one ``stat``).
        """
        size = self.store.size(record_key(name))
        if size is None:
            return False
        if size != self._sizes.get(name):
            self._tensors.pop(name, None)
            self._sizes[name] = size
        tensors = self.tensors(name)
        entry = tensors.get(tensor) if tensors else None
        return entry is not None and entry[0] == digest

    def naming(self, packed: dict[str, str]) -> dict[str, tuple[str, str, int]]:
        """``{digest: (checkpoint, tensor, nbytes)}`` for each object of ``packed``
        (``{digest: its pack}``) that a record names.

        Records are read newest first, and an object is looked for no further back than
        the record whose save wrote its pack: none older can name an object first written
        after it (two saves at once write such an object into a pack each, and the other
        copy is found). So a pass reads the records of the newest saves, not every one (4
        ms each for a 70-tensor model with its AdamW: 0.6 s a pass after 150 saves), even
        for the objects a retain left unnamed.
        """
        out: dict[str, tuple[str, str, int]] = {}
        left = dict(packed)
        for name in reversed(self.names):
            if not left:
                break
            try:
                doc = self._doc(name)
            except (FormatError, CheckpointNotFoundError):
                continue
            objects, packs = doc.get("objects"), doc.get("packs")
            named = objects.values() if isinstance(objects, dict) else ()
            hit = doc.get("kind") is None and any(isinstance(d, str) and d in left for d in named)
            if hit and name not in self._tensors:
                self._tensors[name] = self._parse(name, doc)  # the doc just read, not again
            tensors = self.tensors(name) if hit else None
            for tensor, (digest, _, _, nbytes) in (tensors or {}).items():
                if digest in left:
                    out[digest] = (name, tensor, nbytes)
                    del left[digest]
            if isinstance(packs, list):
                own = {p for p in packs if isinstance(p, str)}
                left = {d: p for d, p in left.items() if p not in own}
        return out

    def tensors(self, name: str) -> Tensors | None:
        """The tensors of ``name``; ``None`` for a DCP record or one that is unreadable
        or gone (its objects are then left as they are)."""
        if name not in self._tensors:
            self._tensors[name] = self._read(name)
        return self._tensors[name]

    def frozen(self, name: str) -> set[str]:
        """The objects of ``name``'s frozen tensors (its record's ``frozen`` list)."""
        self.tensors(name)
        return self._frozen.get(name, set())

    def _doc(self, name: str) -> dict[str, Any]:
        """``name``'s record, its size noted first: a change after that is seen."""
        self._sizes[name] = self.store.size(record_key(name))
        return read_doc(self.store, name)

    def _read(self, name: str) -> Tensors | None:
        try:
            doc = self._doc(name)
        except (FormatError, CheckpointNotFoundError):
            return None
        return self._parse(name, doc)

    def _parse(self, name: str, doc: dict[str, Any]) -> Tensors | None:
        from ..records.checkpoint import VaultCheckpoint

        if doc.get("kind") is not None:
            return None  # weightvault.dcp's chunks: stored as written
        try:
            ckpt = VaultCheckpoint(self.store, name, doc)
        except (FormatError, CheckpointNotFoundError):
            return None
        frozen = set(ckpt.manifest.frozen)
        self._frozen[name] = {d for n, d in ckpt.objects.items() if n in frozen}
        return {n: (ckpt.objects[n], i.dtype, i.shape, i.nbytes) for n, i in ckpt.stored.items()}


class _Damaged(Exception):
    """An object whose bytes do not match its name (or cannot be read)."""


def _head(store: Store, digest: str) -> tuple[int, Any] | None:
    """``(file size, frame header or None for raw bytes)`` of ``digest`` in ``objects/``,
    or ``None`` when it is not there (a gc holds it, or it is gone)."""
    key = object_key(digest)
    size = store.size(key)
    if size is None:
        packed = find(store, digest)
        return None if packed is None else (packed.size, None)  # a pack holds raw bytes
    try:
        head = store.get_range(key, 0, HEADER_SIZE)
    except FileNotFoundError:
        return None
    if not is_frame(head):
        return size, None
    try:
        return size, parse_frame_header(memoryview(head))
    except FormatError:
        return size, None  # decoding it below says what is wrong


#: ``{(vault URL, digest): pays}``: raw objects this process found not worth compressing
#: at that threshold (an object's bytes never change, so neither does the answer).
_STAYS_RAW: dict[tuple[str, str], float] = {}
_STAYS_RAW_MAX = 1 << 16

#: Verified raw objects a compaction keeps at hand (a tensor's new and old values).
_RECENT = 3


class _Work:
    """One compaction's state: what it read, what it wrote, what it found damaged."""

    def __init__(self, store: Store, storage: Storage, report: CompactReport) -> None:
        self.store, self.storage, self.report = store, storage, report
        self.bad: set[str] = set()
        self._recent: dict[str, memoryview] = {}  # the last few verified raw bytes

    def raw(self, digest: str, nbytes: int, where: str) -> memoryview:
        """The verified raw bytes of ``digest`` (the last few are kept: an object made
        full is the base of the next delta, which then needs no second decode or hash).

        Raises:
            _Damaged: They do not decode, or their blake3 is not the name (reported), or
                the object is gone (not reported: a gc freed it since its checkpoint was
                deleted or its training state dropped, which only the intent of the
                newer checkpoint's objects keeps from happening).
        """
        if digest in self.bad:
            raise _Damaged(digest)
        if digest in self._recent:
            return self._recent[digest]
        try:
            data = read_object(self.store, digest, nbytes)
            if data.nbytes == nbytes and content_hash(data) == digest:
                self._recent[digest] = data
                while len(self._recent) > _RECENT:
                    del self._recent[next(iter(self._recent))]
                return data
            why = "its bytes do not match its name (blake3)"
        except FileNotFoundError:
            self.bad.add(digest)
            raise _Damaged(digest) from None
        except FormatError as e:
            why = str(e)
        self.bad.add(digest)
        self.report.damaged.append(f"{self.store.url}/{object_key(digest)} ({where}): {why}")
        raise _Damaged(digest)

    def publish(self, staged: dict[str, tuple[str, int, int]]) -> None:
        """Put the staged ``{digest: (token, old size, new size)}`` files in place."""
        if not staged:
            return
        tokens = {object_key(d): t for d, (t, _, _) in staged.items()}
        self.store.publish(tokens, sum(n for _, _, n in staged.values()))
        for _, old, new in staged.values():
            self.report.bytes_before += old
            self.report.bytes_after += new
        staged.clear()

    def stage(
        self,
        digest: str,
        parts: Parts,
        old: int,
        staged: dict[str, Any],
        raw: memoryview,
        base: memoryview | None = None,
    ) -> None:
        """Stage ``parts`` as ``digest``'s new file, once they decode back to ``raw``
        (on ``base``, for a delta): a load then trusts a frame's block sums alone.

        Raises:
            FormatError: They do not (a codec fault): nothing is staged.
        """
        _round_trip(parts, raw, base)
        staged[digest] = (self.store.stage(object_key(digest), parts), old, size_of(parts))


def _round_trip(parts: Parts, raw: memoryview, base: memoryview | None) -> None:
    """Check that the file ``parts`` decodes to ``raw`` (applied on ``base`` for a delta)."""
    data = memoryview(parts[0] if len(parts) == 1 else b"".join(parts)).cast("B")
    if not is_frame(data) or data.nbytes == raw.nbytes:
        if bytes(data) != bytes(raw):
            raise FormatError("an encoded object does not hold its raw bytes")
        return
    frame = parse_frame(data, raw.nbytes)
    out = memoryview(bytearray(base if frame.base is not None and base is not None else raw.nbytes))
    decode_into(data, frame, out, 0)
    if checksum(out) != checksum(raw):
        raise FormatError("an encoded object does not decode to its raw bytes (codec fault)")


def _run_behind(
    records: _Records, index: int, name: str, digest: str, dtype: str, shape: Any, limit: int
) -> int:
    """How many deltas already hang behind object ``digest`` of tensor ``name``, counted
    back from checkpoint ``index`` (each older object whose chain of frames reaches the
    next), up to ``limit``. A chain may pass through objects no record names any more
    (a checkpoint deleted in the middle keeps its objects as bases): they count too."""
    run, newer = 0, digest
    for older in reversed(records.names[:index]):
        tensors = records.tensors(older)
        entry = tensors.get(name) if tensors else None
        if entry is None or (entry[1], entry[2]) != (dtype, shape):
            return run
        if entry[0] == newer:
            continue
        links = _links_to(records.store, entry[0], newer, limit - run)
        if links is None:
            return run
        run += links
        if run >= limit:
            return run
        newer = entry[0]
    return run


def _links_to(store: Store, digest: str, target: str, most: int) -> int | None:
    """The number of delta frames from ``digest`` to ``target`` following bases; ``None``
    if the chain ends (a full or raw object) first. Past ``most`` links the count stops
    there: the caller only compares it with its limit."""
    links = 0
    while links < max(most, 1) + 1:
        found = _head(store, digest)
        if found is None or found[1] is None or found[1].base is None:
            return None
        links += 1
        if found[1].base == target:
            return links
        digest = found[1].base
    return links


def _compact_one(
    work: _Work,
    records: _Records,
    index: int,
    make_full: bool,
    pause: Callable[[], None],
    *,
    new_raw: bool = False,
) -> None:
    """Compact checkpoint ``records.names[index]`` (see the module docstring), tensor by
    tensor: its object made full, then the previous checkpoint's turned into a delta on
    it while its verified raw bytes are still at hand. ``new_raw`` leaves raw the objects
    the previous checkpoint does not hold."""
    store = work.store
    name = records.names[index]
    new = records.tensors(name)
    if new is None:
        return
    prev = records.names[index - 1] if index > 0 else None
    old = (records.tensors(prev) if prev else None) or {}
    # A resumable oldest's objects stay whole (going back to a run's start is one
    # decode), also where the checkpoint before this one shares them (a tensor unchanged
    # since then). A weights-only oldest is history like the rest: deltas.
    oldest = records.oldest()
    oldest_tensors = records.tensors(oldest) if oldest else None
    oldest_objects = (
        {d for d, *_ in oldest_tensors.values()}
        if oldest_tensors and _resumable(oldest_tensors)
        else set()
    )
    # The intent names the new checkpoint's objects, the bases of every delta written
    # here: a gc keeps them even if that checkpoint is deleted meanwhile. The older
    # objects are named by their own record, or were dropped (training state a retain
    # took away): a gc may free those, and they are left alone (see still_named).
    keep_whole = {d for d, *_ in new.values()}  # what the newer checkpoint reads stays whole
    shared = {d for d, *_ in old.values()} & keep_whole
    # Read by every resume of the checkpoints that share it: compressed only if that
    # saves much (SHARED_PAYS).
    spared = shared | records.frozen(name)
    intent = begin(store, keep_whole, gc_wait=3600.0)
    staged: dict[str, tuple[str, int, int]] = {}
    done: set[str] = set()
    limit = work.storage.max_chain
    try:
        for tensor, (digest, dtype, shape, nbytes) in new.items():
            itemsize = ITEMSIZE.get(dtype, 4)
            if (
                make_full
                and digest not in done
                and (not new_raw or digest in shared or _is_delta(store, digest))
            ):
                done.add(digest)
                pause()
                pays = SHARED_PAYS if digest in spared else PAYS
                if _full(work, digest, nbytes, itemsize, f"{name}: {tensor}", staged, pays):
                    work.publish(staged)  # it was a delta: full on disk before a delta names it
            old_entry = old.get(tensor)
            if old_entry is None or old_entry[0] in keep_whole or old_entry[0] in done:
                continue
            done.add(old_entry[0])
            pause()
            if prev is None or not records.still_named(prev, tensor, old_entry[0]):
                continue
            where = f"{prev}: {tensor}"
            if (
                limit > 0
                and old_entry[0] not in oldest_objects
                and (old_entry[1], old_entry[2]) == (dtype, shape)
                and _run_behind(records, index - 1, tensor, old_entry[0], dtype, shape, limit)
                < limit
                and _delta(
                    work, old_entry[0], digest, nbytes, itemsize, where, f"{name}: {tensor}", staged
                )
            ):
                continue
            _full(work, old_entry[0], old_entry[3], ITEMSIZE.get(old_entry[1], 4), where, staged)
        for tensor, (digest, dtype, _, nbytes) in old.items():  # tensors the new one lacks
            if digest not in keep_whole and digest not in done:
                done.add(digest)
                pause()
                if prev is not None and records.still_named(prev, tensor, digest):
                    where = f"{prev}: {tensor}"
                    _full(work, digest, nbytes, ITEMSIZE.get(dtype, 4), where, staged)
        work.publish(staged)
    except BaseException:
        store.discard({object_key(d): t for d, (t, _, _) in staged.items()})
        raise
    finally:
        release(store, [intent])


def _resumable(tensors: Tensors) -> bool:
    """Whether a checkpoint of ``tensors`` holds training state: one a run resumes from,
    which the compactor keeps whole when it is the oldest."""
    return any(is_training(n) for n in tensors)


def _depth(store: Store, digest: str, avoid: str, most: int) -> int | None:
    """The delta links from ``digest`` to the full (or raw) object its chain ends at;
    ``None`` if the chain passes through ``avoid``, is longer than ``most``, or breaks."""
    links = 0
    while True:
        if digest == avoid:
            return None
        found = _head(store, digest)
        if found is None:
            return None
        if found[1] is None or found[1].base is None:
            return links
        links += 1
        if links > most:
            return None
        digest = found[1].base


def _is_delta(store: Store, digest: str) -> bool:
    """Whether ``digest`` is stored as a delta (the newest after its successor was
    deleted: a resume must not decode a chain)."""
    found = _head(store, digest)
    return found is not None and found[1] is not None and found[1].base is not None


def _full(
    work: _Work,
    digest: str,
    nbytes: int,
    itemsize: int,
    where: str,
    staged: dict[str, Any],
    pays: float = PAYS,
) -> bool:
    """Make ``digest`` a full object (compressed from raw bytes or a delta, if that is at
    most ``pays`` of them, else raw) if it is not; whether it was a delta (then publish
    before anything names it as a base)."""
    found = _head(work.store, digest)
    if found is None:
        return False  # a gc holds it, or it is gone: nothing to rewrite
    size, frame = found
    if frame is not None and frame.base is None:
        return False  # a full frame already
    if frame is None and size != nbytes:
        return False  # not an object of this size: the load reports it
    tried = (work.store.url, digest)
    if frame is None and _STAYS_RAW.get(tried, 0.0) >= pays:
        # Found not to pay before: a frozen backbone shared by every save is not read,
        # hashed and compressed again by each save's compaction.
        return False
    try:
        raw = work.raw(digest, nbytes, where)
    except _Damaged:
        return False
    parts = encode_full(raw, itemsize, work.storage.codec, pays=pays)
    if frame is None and size_of(parts) >= size:
        if len(_STAYS_RAW) >= _STAYS_RAW_MAX:
            _STAYS_RAW.clear()
        _STAYS_RAW[tried] = pays
        return False  # raw, and compression does not pay
    work.stage(digest, parts, size, staged, raw)
    work.report.full += 1
    return frame is not None


def _delta(
    work: _Work,
    digest: str,
    base: str,
    nbytes: int,
    itemsize: int,
    where: str,
    base_where: str,
    staged: dict[str, Any],
    *,
    onto_chain: bool = False,
) -> bool:
    """Make ``digest`` a delta on ``base`` if that is smaller; whether it was handled.
    ``where`` and ``base_where`` name the checkpoint and tensor of each, for reports.
    ``onto_chain``: the caller checked that ``base``'s chain is short enough and never
    reaches ``digest``, so ``base`` may be a delta itself."""
    found, found_base = _head(work.store, digest), _head(work.store, base)
    if found is None or found_base is None:
        return False
    size, frame = found
    if frame is not None and frame.base == base:
        return True  # done by an earlier compaction
    if not onto_chain and found_base[1] is not None and found_base[1].base is not None:
        return False  # the base is itself a delta: a chain through it could cycle
    codec = work.storage.codec
    assert codec is not None
    try:
        raw = work.raw(digest, nbytes, where)
        base_raw = work.raw(base, nbytes, base_where)
    except _Damaged:
        return digest in work.bad  # damaged: left as it is
    if not delta_wins(codec, raw, base_raw, itemsize):
        return False
    parts = encode_delta(raw, base_raw, base, itemsize, codec)
    full_size = size if frame is not None and frame.base is None else None
    if size_of(parts) > 0.95 * nbytes or (full_size is not None and size_of(parts) >= full_size):
        return False
    work.stage(digest, parts, size, staged, raw, base_raw)
    work.report.deltas += 1
    return True


def compact(
    store: Store,
    storage: Storage,
    *,
    pause: Callable[[], None] = lambda: None,
    stop: threading.Event | None = None,
    settle: bool = True,
) -> CompactReport:
    """Compact every checkpoint left to the compactor, oldest first.

    Args:
        store: The vault's store.
        storage: Its codec and chain length (no codec: the to-do markers are dropped,
            and packs are taken apart all the same).
        pause: Called before each object; blocks while a save or load of this process
            runs, so compaction yields to them.
        stop: Set to stop after the current object (the rest stays to do).
        settle: Compress the newest checkpoint's new objects too. ``False`` (the
            background compactor) leaves them raw, and the newest's marker in place, for
            the next save's compaction or a settling one (see the module docstring).

    Returns:
        What was done; ``busy`` if another compactor holds the vault.
    """
    start = time.monotonic()
    report = CompactReport()
    lock = CompactLock(store)
    if not lock.acquire():
        report.busy = True
        return report
    try:
        todo = set(pending(store))
        table = pack_table(store)
        table.refresh(store)
        if not todo and not table.packs():
            return report
        records = _Records(store)
        work = _Work(store, storage, report)
        order = [n for n in records.names if n in todo]
        whole: set[str] = set()
        for name in order:
            if stop is not None and stop.is_set():
                break
            if storage.codec is not None:
                index = records.names.index(name)
                # The next checkpoint's compaction turns these objects into deltas on its
                # own anyway, if it is still to do and an ordinary one: no full pass first.
                after = records.names[index + 1 : index + 2]
                make_full = not (
                    after and after[0] in todo and records.tensors(after[0]) is not None
                )
                leave_raw = not after and not settle  # the newest, for a quick resume
                _compact_one(
                    work, records, index, make_full, _stopping(pause, stop, lock.beat),
                    new_raw=leave_raw,
                )  # fmt: skip
                if make_full:
                    whole.add(name)  # no delta object of its own is left
                if leave_raw:
                    continue  # the next save's compaction, or a settling one, finishes it
            store.delete(todo_key(name))
            report.checkpoints.append(name)
        # Markers of checkpoints deleted meanwhile.
        for name in todo - set(records.names):
            store.delete(todo_key(name))
        if storage.codec is not None:
            # A deletion meanwhile may have moved the ends: then read the records again.
            same = set(record_names(store)) == records.listed
            ends = records if same else _Records(store)
            _whole_ends(
                work, ends, whole if same else set(), set(order),
                _stopping(pause, stop, lock.beat),
            )  # fmt: skip
        # Without a codec too: a load that finds an object in no pack it knows reads
        # every pack's index, so packs left in place would cost a resume in a new
        # process one index per save the vault ever took.
        _take_out(work, records, set(pending(store)), _stopping(pause, stop, lock.beat))
    except _Stopped:
        pass
    finally:
        lock.release()
        report.seconds = time.monotonic() - start
    return report


def _whole_ends(
    work: _Work,
    records: _Records,
    compacted: set[str],
    marked: set[str],
    pause: Callable[[], None],
) -> None:
    """Make the delta objects of the oldest and the newest checkpoint full.

    Deleting the oldest or the newest checkpoint leaves its neighbour a to-do marker
    (``Vault.delete``), but a compaction running at that moment may remove the marker as
    it finishes that neighbour with a view of the records from before the deletion. So
    each compaction also checks both ends (one header read per object), except one it
    has ``compacted`` with a view of the records that is still current.

    A weights-only oldest is left to :func:`_delta_oldest`, only when it had a to-do
    marker in this pass (``marked``: a retention dropped its state): an object whose
    delta does not pay would otherwise be decoded and hashed again by every pass."""
    oldest = records.oldest()
    oldest_tensors = records.tensors(oldest) if oldest else None
    if oldest and oldest_tensors and not _resumable(oldest_tensors):
        if oldest in marked:
            _delta_oldest(work, records, oldest, pause)
        oldest = None  # weights-only: history like the rest, left as deltas
    ends = {n for n in (oldest, records.names[-1] if records.names else None) if n}
    for name in sorted(ends - compacted):
        tensors = records.tensors(name)
        if not tensors:
            continue
        deltas: dict[str, tuple[str, str, int]] = {}
        for tensor, (digest, dtype, _, nbytes) in tensors.items():
            if digest not in deltas and _is_delta(work.store, digest):
                deltas[digest] = (tensor, dtype, nbytes)
        if not deltas:
            continue
        intent = begin(work.store, {d for d, *_ in tensors.values()}, gc_wait=3600.0)
        staged: dict[str, tuple[str, int, int]] = {}
        try:
            for digest, (tensor, dtype, nbytes) in deltas.items():
                pause()
                if records.still_named(name, tensor, digest):
                    where = f"{name}: {tensor}"
                    _full(work, digest, nbytes, ITEMSIZE.get(dtype, 4), where, staged)
                    work.publish(staged)
        except BaseException:
            work.store.discard({object_key(d): t for d, (t, _, _) in staged.items()})
            raise
        finally:
            release(work.store, [intent])


def _delta_oldest(work: _Work, records: _Records, oldest: str, pause: Callable[[], None]) -> None:
    """Turn the full objects of a weights-only oldest checkpoint into deltas on the next
    checkpoint's, where the chain stays within ``max_chain``.

    The oldest was kept whole while it held training state; a retain that drops it later
    (``retain(training_state_last=N)`` after a run) leaves it a to-do marker, and this
    makes the disk what ``Vault(training_state_last=N)`` would have made it. The next
    checkpoint's object is usually a delta by then, so the chain from it is followed
    first: it must end at a full object within ``max_chain - 1`` links and never pass
    through the object being rewritten (no cycle).
    """
    limit = work.storage.max_chain
    index = records.names.index(oldest)
    after = records.names[index + 1 : index + 2]
    tensors, newer = records.tensors(oldest), records.tensors(after[0]) if after else None
    if limit <= 0 or not tensors or not newer:
        return
    pairs = []
    for tensor, (digest, dtype, shape, nbytes) in tensors.items():
        entry = newer.get(tensor)
        if entry is None or entry[0] == digest or (entry[1], entry[2]) != (dtype, shape):
            continue
        if _is_delta(work.store, digest):
            continue  # a delta already (from a compaction before the training state went)
        pairs.append((tensor, digest, entry[0], dtype, nbytes))
    if not pairs:
        return  # before reading every record below
    # An object a later checkpoint also names (a tensor changed, then changed back) is
    # left whole: chains through it were counted with it as their end.
    elsewhere = {
        d for n in records.names if n != oldest for d, *_ in (records.tensors(n) or {}).values()
    }
    pairs = [p for p in pairs if p[1] not in elsewhere]
    if not pairs:
        return
    names = {d for _, d, *_ in pairs} | {b for _, _, b, *_ in pairs}
    intent = begin(work.store, names, gc_wait=3600.0)
    staged: dict[str, tuple[str, int, int]] = {}
    done: set[str] = set()
    try:
        for tensor, digest, base, dtype, nbytes in pairs:
            if digest in done:
                continue
            done.add(digest)
            pause()
            if not records.still_named(oldest, tensor, digest):
                continue
            if _depth(work.store, base, digest, limit - 1) is None:
                continue
            where, base_where = f"{oldest}: {tensor}", f"{after[0]}: {tensor}"
            itemsize = ITEMSIZE.get(dtype, 4)
            _delta(work, digest, base, nbytes, itemsize, where, base_where, staged, onto_chain=True)
            work.publish(staged)  # one at a time: the next one's chain check sees it
    except BaseException:
        work.store.discard({object_key(d): t for d, (t, _, _) in staged.items()})
        raise
    finally:
        release(work.store, [intent])


def _take_out(work: _Work, records: _Records, held_by: set[str], pause: Callable[[], None]) -> None:
    """Take the objects of compacted checkpoints out of their packs, then delete every
    pack whose objects are all loose (:mod:`.pack`).

    The packs of checkpoints still to compact (``held_by``: the newest, left raw for a
    quick resume) stay as they are; objects no record names (training state a retain
    dropped) stay in their pack, which gc frees. Each object taken out is checked
    against its name first and written raw: the compaction before this decided it stays
    raw.
    """
    store = work.store
    table = pack_table(store)
    table.refresh(store)
    packs = table.packs()
    if not packs:
        return
    held = held_packs(store, held_by)
    packs = {k: v for k, v in packs.items() if k not in held}
    named = records.naming({d: pack for pack, index in packs.items() for d in index})
    for pack, index in sorted(packs.items()):
        work.report.unpacked += write_loose(store, _leftovers(work, index, named, pause))
        if all(store.exists(object_key(d)) for d in index):
            # Every object is loose now, and loose objects win every lookup: a reader
            # that found one in this pack and then cannot open it looks again.
            store.delete(pack_key(pack))
            table.forget(pack)
            work.report.packs_deleted += 1


def _leftovers(
    work: _Work,
    index: dict[str, Packed],
    named: dict[str, tuple[str, str, int]],
    pause: Callable[[], None],
) -> Iterator[tuple[str, memoryview]]:
    """The verified raw bytes of each object of a pack that a record names and that has
    no loose copy yet (a damaged one is reported and left)."""
    for digest, where in index.items():
        if digest not in named or work.store.exists(object_key(digest)):
            continue
        ckpt, tensor, nbytes = named[digest]
        if where.size != nbytes:
            continue  # not the object that record names: the load reports it
        pause()
        with contextlib.suppress(_Damaged):
            yield digest, work.raw(digest, nbytes, f"{ckpt}: {tensor}")


class _Stopped(Exception):
    """Raised from ``pause`` once ``stop`` is set: leave the rest for later."""


def _stopping(
    pause: Callable[[], None], stop: threading.Event | None, beat: Callable[[], None]
) -> Callable[[], None]:
    def check() -> None:
        pause()
        beat()
        if stop is not None and stop.is_set():
            raise _Stopped

    return check
