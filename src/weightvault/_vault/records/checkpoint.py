"""A committed vault checkpoint, read through the same interface as a single file.

:class:`VaultCheckpoint` maps each stored tensor to its object; :func:`open_record` picks
it or, for records ``weightvault.dcp`` committed, :class:`~.dcp_record.DcpCheckpoint`.
Either reads its objects through :mod:`.objects`, so a checkpoint loads while a gc holds
some of its objects in its trash.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import wait
from typing import Any, TypeVar

import blake3
import xxhash

from ..._base.errors import FormatError
from ..._file.checkpoint import HASH_WINDOW, checksum_error
from ..objects.address import DIGEST, checksum, content_hash
from ..objects.codec import BLOCK, codec_pool
from ..objects.file import ObjectFile
from ..objects.frame import Frame, blocks_intact, drop_buffers, raw_intact
from ..objects.prefetch import prefetch
from ..objects.read import OpenObject, damaged, open_object
from ..store.backend import Store
from ..store.pack import missing
from .dcp import KIND, DcpCheckpoint
from .names import record_key
from .object_checkpoint import ObjectCheckpoint
from .record import object_map, parse_header_text, parse_record

__all__ = ["KEEP_FLOOR", "KEEP_FRACTION", "VaultCheckpoint", "keep_budget", "open_record"]


#: What a vault load may keep decoded between checking its objects and copying them into
#: the model: this fraction of the checkpoint's raw bytes, and at least :data:`KEEP_FLOOR`.
KEEP_FRACTION = 0.08
KEEP_FLOOR = 16 << 20


def record_objects(doc: Mapping[str, Any], where: str) -> tuple[dict[str, Any], str]:
    """A record's ``objects`` and header text, both required of every checkpoint record.

    Raises:
        FormatError: Either is missing or of the wrong type.
    """
    objects, header = object_map(doc), doc.get("header")
    if objects is None or not isinstance(header, str):
        raise FormatError(f"{where}: checkpoint record lacks its header or objects")
    return objects, header


def check_objects(objects: Mapping[str, Any], tensors: Iterable[str] | None, where: str) -> None:
    """Check that ``objects`` names exactly the stored ``tensors``, each by a digest
    (``None``: the header holds no table of tensors).

    Raises:
        FormatError: They do not match.
    """
    if (
        tensors is None
        or set(objects) != set(tensors)
        or not all(isinstance(d, str) and DIGEST.fullmatch(d) for d in objects.values())
    ):
        raise FormatError(f"{where}: objects do not match the stored tensors")


class VaultCheckpoint(ObjectCheckpoint):
    """One vault checkpoint, read through the same interface as a single file.

    ``objects`` maps each stored tensor to its object.

    A load is all or nothing, so :meth:`stage` decodes and checks every object before the
    first byte of the model changes, and :meth:`read_into` then decodes each object
    straight into its tensor. Holding every decoded object between the two (as loads
    once did) costs a whole second copy of the model. Instead, decoded objects are kept
    only while they fit in a budget (:func:`keep_budget`: 8% of the checkpoint, at least
    16 MiB), and the others are checked block by block through a small scratch buffer
    and decoded a second time into the model. The trade-off, measured in
    docs/benchmarks-log.md (sections 10 and 11): a kept object is decoded once and copied;
    any other costs a second decode (about 1 GB/s per core on blosc2 objects) but no
    memory. Kept objects are decoded into one mapping of huge pages per stage
    (:class:`_Arena`), not a buffer each. Raw
    (uncompressed) objects are never kept: they are hashed from ``pread``'d windows, and
    read with ``preadv`` straight into the tensor.

    Example:
        >>> with vault.open("latest") as ckpt:
        ...     ckpt.stage(["w"], verify=True)  # every object decoded and checked first
        ...     ckpt.read_into("w", memoryview(out))  # then decoded into the model's bytes
        True
    """

    def __init__(self, store: Store, name: str, doc: Mapping[str, Any]) -> None:
        where = f"{store.url}/{record_key(name)}"
        self.record = parse_record(name, doc, where)
        objects, text = record_objects(doc, where)
        header, manifest = parse_header_text(text, where)
        check_objects(objects, header.tensors, where)
        self._kept: dict[str, memoryview] = {}
        self._arenas: list[_Arena] = []  # what stage() decodes kept objects into
        self._handles: dict[str, OpenObject] = {}
        #: Objects read and checked against their checksums in the same pass.
        self._verified: set[str] = set()
        self._files: dict[str, bytes] = {}
        self._lock = threading.Lock()
        # A record written before records were sealed may carry a damaged tensor checksum:
        # it is then checked while staging, before anything is assigned, not on the way in.
        self._sums_trusted = doc.get("version") != 1
        super().__init__(
            store, where, header.tensors, manifest,
            framework=header.metadata.get("format"),
            objects=dict(objects),
            sizes={n: info.nbytes for n, info in header.tensors.items()},
        )  # fmt: skip
        self._keep_left = keep_budget(sum(t.nbytes for t in header.tensors.values()))

    def fetch(self) -> None:
        """Bring every object into memory now, concurrently (used for remote stores)."""
        self._files.update(prefetch(self.store, list(self.objects.values())))

    def _open(self, stored: str) -> OpenObject:
        expected = self.stored[stored].nbytes
        try:
            return open_object(self.store, self.objects[stored], expected, files=self._files)
        except FileNotFoundError:
            raise missing(self.store, self.path, stored, "its object is missing") from None
        except FormatError as e:
            raise damaged(self.path, stored, str(e)) from None

    def _reserve(self, nbytes: int) -> bool:
        with self._lock:
            if nbytes > self._keep_left:
                return False
            self._keep_left -= nbytes
            return True

    def _decoded(
        self, stored: str, obj: OpenObject, *, parallel: bool = True, out: memoryview | None = None
    ) -> memoryview:
        """The whole object, decoded into ``out`` (of its size), or else a new buffer."""
        if out is None:
            out = memoryview(bytearray(obj.size))
        try:
            obj.decode_into(out, parallel=parallel)
        except FormatError as e:
            raise damaged(self.path, stored, str(e)) from None
        return out

    def raw(self, stored: str) -> memoryview:
        kept = self._kept.get(stored)
        if kept is not None:
            return kept
        with self._handles.pop(stored, None) or self._open(stored) as obj:
            if obj.raw and not self._files:
                # A raw local object: its file's bytes, read (never mapped) into memory of
                # its own through the descriptor open already.
                try:
                    return obj.links[0][1].whole()
                except FormatError as e:
                    raise damaged(self.path, stored, str(e)) from None
            out = self._decoded(stored, obj)
        self._checked(stored, out)
        if self._reserve(out.nbytes):
            self._kept[stored] = out
        return out

    def read_into(self, stored: str, buffer: memoryview) -> bool:
        buffer = buffer.cast("B")
        if buffer.nbytes != self.stored[stored].nbytes:
            return False
        kept = self._kept.get(stored)
        if kept is not None:
            if kept.nbytes >= _NUMPY_COPY:
                import numpy as np  # not at import: `import weightvault` stays numpy-free

                # numpy copies without the GIL, so the load's reader threads copy at once.
                np.copyto(np.frombuffer(buffer, np.uint8), np.frombuffer(kept, np.uint8))
            else:
                buffer[:] = kept
            return True
        # The object stage() opened, if it is still open: no second open, stat and parse.
        with self._handles.pop(stored, None) or self._open(stored) as obj:
            try:
                if obj.raw and self._hashed_raw(stored, obj, buffer):
                    return True
                obj.decode_into(buffer)
            except FormatError as e:
                raise damaged(self.path, stored, str(e)) from None
        self._checked(stored, buffer)
        return True

    def _hashed_raw(self, stored: str, obj: OpenObject, buffer: memoryview) -> bool:
        """Read raw ``obj`` into ``buffer`` a window at a time, each window hashed while it
        is still in the core's cache (one pass over memory, not a copy and then a hash);
        ``False``, reading nothing, where the two-pass path serves as well.

        Raises:
            ChecksumError: The bytes read do not match the recorded checksum.
        """
        expected = self.manifest.sums.get(stored)
        if expected is None or stored in self._verified or buffer.nbytes <= HASH_WINDOW:
            return False
        f = obj.links[0][1]
        h = xxhash.xxh3_64()
        for lo in range(0, buffer.nbytes, HASH_WINDOW):
            part = buffer[lo : lo + HASH_WINDOW]
            f.read_into(lo, part)
            h.update(part)
        if h.hexdigest() != expected:
            raise checksum_error(self.path, [stored])
        with self._lock:
            self._verified.add(stored)
        return True

    def _checked(self, stored: str, data: memoryview) -> None:
        """Check bytes just read or decoded against their checksum, in the same pass (they
        are still in the CPU's caches), and remember it: a later :meth:`check` (the load's
        verify of training state, read before the weights are staged) reads nothing again.

        Raises:
            ChecksumError: They do not match. After stage() checked the object's blocks,
                only a codec fault gets here; the destination may then hold part of it.
        """
        if stored in self._verified:
            return
        if not self._matches(stored, data):
            raise checksum_error(self.path, [stored])
        with self._lock:
            self._verified.add(stored)

    def check(self, stored: str) -> bool:
        if stored in self._verified:
            return True  # read and checked already, in the same pass
        kept = self._kept.get(stored)
        if kept is not None:
            return self._matches(stored, kept)
        with self._open(stored) as obj:
            return self._streamed(stored, obj, None, verify=True)

    def _hasher(self, stored: str) -> Any:
        # Loads check the xxh3 sum recorded at save time (about 30 GB/s); vault.verify()
        # re-derives the blake3 object name, which is the authority but ~5x slower.
        if stored in self.manifest.sums:
            return xxhash.xxh3_64()
        return blake3.blake3(max_threads=blake3.blake3.AUTO)

    def _matches(self, stored: str, data: memoryview) -> bool:
        expected = self.manifest.sums.get(stored)
        if expected is not None:
            return checksum(data) == expected
        return content_hash(data) == self.objects[stored]

    def _streamed(
        self, stored: str, obj: OpenObject, scratch: memoryview | None, *, verify: bool
    ) -> bool:
        """Decode ``obj`` one window at a time through ``scratch``, hashing if ``verify``;
        whether it matches its checksum."""
        hasher = self._hasher(stored) if verify else None
        window = obj.window
        if scratch is None or scratch.nbytes < window:
            scratch = memoryview(bytearray(window))
        try:
            for lo in range(0, obj.size, window):
                part = scratch[: min(window, obj.size - lo)]
                obj.decode_into(part, lo, parallel=False)
                if hasher is not None:
                    hasher.update(part)
        except FormatError as e:
            raise damaged(self.path, stored, str(e)) from None
        if hasher is None:
            return True
        expected = self.manifest.sums.get(stored, self.objects[stored])
        return bool(hasher.hexdigest() == expected)

    def stage(self, stored: list[str], verify: bool) -> None:
        """Decode and check every object of ``stored`` before a load copies anything.

        Objects are checked on all cores. A compressed object is kept decoded while the
        budget allows (then :meth:`read_into` copies it), else decoded one block at a time
        into a scratch buffer per thread and decoded again by :meth:`read_into`. Without
        ``verify`` a compressed object is still decoded (so a damaged block fails here,
        not half-way through the copies), and a raw one is only checked for its size.

        Raises:
            FormatError: An object is missing, damaged or lies about its size.
            ChecksumError: ``verify`` and objects do not match their checksums.
        """
        names = sorted(set(stored), key=lambda n: -self.stored[n].nbytes)
        if not names:
            return
        window = max(min(self.stored[n].nbytes, BLOCK) for n in names)
        cores = min(os.cpu_count() or 1, len(names))
        total = sum(self.stored[n].nbytes for n in names)
        if total <= self._keep_left:
            workers, scratch = cores, 0  # everything fits: nothing is decoded twice
        else:
            # Each thread's scratch (a window, and a block read) comes out of the budget.
            workers = max(1, min(cores, self._keep_left // (4 * window)))
            scratch = workers * 2 * window
        self._keep_left -= scratch
        self._arenas.append(_Arena(min(total, self._keep_left)))
        todo = iter(names)
        bad: list[str] = []
        failed = threading.Event()  # the first error stops the other threads

        def worker() -> None:
            buffer: list[memoryview] = []  # the scratch, made when first needed
            for name in _locked(todo, self._lock):
                if failed.is_set():
                    return
                try:
                    ok = self._stage_one(name, buffer, verify)
                except BaseException:
                    failed.set()
                    raise
                if not ok:
                    with self._lock:
                        bad.append(name)

        # On the codec threads, decoding each object on its own thread (parallel=False):
        # a thread of the pool never waits on the pool, and no more threads hold memory.
        futures = [codec_pool().submit(worker) for _ in range(workers)]
        try:
            wait(futures)
            for f in futures:
                f.result()
        finally:
            self._keep_left += scratch
        if bad:
            raise checksum_error(self.path, sorted(bad, key=names.index))

    def _stage_one(self, stored: str, buffer: list[memoryview], verify: bool) -> bool:
        obj: OpenObject | None = self._open(stored)
        assert obj is not None
        try:
            check = verify or not self._sums_trusted
            if stored not in self._kept and _summed(obj) and self._sums_trusted:
                # Every block's sum checked by reading it, none decoded (and a raw base
                # hashed against the sum its delta's frame records): read_into then
                # decodes each block once, straight into the tensor, and checks the
                # tensor's own checksum on the way (one pass).
                ok = all(
                    blocks_intact(f.preadv, f.read, frame)
                    if frame is not None
                    else not check or _base_intact(f, obj.links[k - 1][2])
                    for k, (_, f, frame) in enumerate(obj.links)
                )
            elif not obj.raw and (stored in self._kept or self._reserve(obj.size)):
                if stored not in self._kept:
                    out = self._arenas[-1].take(obj.size)
                    self._kept[stored] = self._decoded(stored, obj, parallel=False, out=out)
                return not check or self._matches(stored, self._kept[stored])
            elif obj.raw and not check:
                ok = True
            else:
                if not buffer or buffer[0].nbytes < obj.window:
                    buffer[:] = [memoryview(bytearray(obj.window))]
                ok = self._streamed(stored, obj, buffer[0], verify=check)
                if ok and check:
                    with self._lock:
                        self._verified.add(stored)  # read_into need not hash it again
            # read_into() reads it again: kept open for it, up to a number of descriptors.
            with self._lock:
                if ok and len(self._handles) < _HANDLES and stored not in self._handles:
                    self._handles[stored], obj = obj, None
            return ok
        finally:
            if obj is not None:
                obj.close()

    def close(self) -> None:
        for obj in list(self._handles.values()):
            obj.close()
        self._handles.clear()
        self._verified.clear()
        self._kept.clear()
        self._arenas.clear()  # unmapped once no view of them is left
        self._files.clear()
        drop_buffers()


#: Kept objects at least this large are copied by numpy, without the GIL (measured on the
#: 13 MB GPT-2 of docs/benchmarks-log.md, section 11: a load's quartile 13.5-13.7 ms against
#: 14.0-15.3 ms copying through memoryviews).
_NUMPY_COPY = 1 << 16

#: Objects a load keeps open between stage() and read_into(), at most (each holds a
#: descriptor per link of its chain).
_HANDLES = 128


def _summed(obj: OpenObject) -> bool:
    """Whether every link of ``obj``'s chain can be checked without decoding it: a frame
    with block sums (version 2 or later), or a raw base whose delta's frame records the
    base's sum (version 3)."""
    for k, (_, _, frame) in enumerate(obj.links):
        if frame is None:
            parent = obj.links[k - 1][2] if k else None
            if parent is None or parent.base_sum is None:
                return False
        elif frame.version < 2:
            return False
    return True


def _base_intact(f: ObjectFile, delta: Frame | None) -> bool:
    """Whether raw base ``f`` holds the bytes whose sum ``delta``'s frame records."""
    assert delta is not None and delta.base_sum is not None  # _summed: it does
    if f.preadv is None:
        return xxhash.xxh3_64_intdigest(f.read(0, f.size)) == delta.base_sum
    return raw_intact(f.preadv, f.size, delta.base_sum)


class _Arena:
    """One anonymous mapping that :meth:`VaultCheckpoint.stage` decodes kept objects into.

    A new buffer per object is fresh memory the kernel faults in 4 KiB at a time, and a
    load's decoded objects rarely find freed memory to reuse: the allocator gives a
    freed heap top of more than a few MiB back to the system. One mapping of huge pages
    (``MADV_HUGEPAGE``: transparent huge pages where the kernel offers them) is faulted in
    2 MiB at a time and unmapped in one call; measured on the 13 MB GPT-2 of
    docs/benchmarks-log.md (section 11), decoding its objects took 6.4 ms into one such mapping
    against 11.1 ms into fresh 4 KiB pages, and freeing 0.1 ms against 1.5 ms. Untouched
    pages cost nothing, so the mapping may be sized for the whole budget. The mapping is
    unmapped when the last view of it is released (a tensor may still hold one after the
    checkpoint is closed).
    """

    def __init__(self, nbytes: int) -> None:
        self._used = 0
        self._size = nbytes if nbytes >= _ARENA_MIN else 0
        self._lock = threading.Lock()
        self._view: memoryview | None = None
        if not self._size:
            return
        # Whole huge pages, so the kernel aligns the mapping to them; only ``nbytes`` of it
        # are handed out. Private: a shared anonymous mapping is shared memory, which
        # transparent huge pages skip.
        length = -(-nbytes // _HUGE) * _HUGE
        private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        area = mmap.mmap(-1, length, flags=private) if private else mmap.mmap(-1, length)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            # A kernel without transparent huge pages refuses: 4 KiB pages, still one map.
            with contextlib.suppress(OSError):
                area.madvise(advice)
        self._view = memoryview(area)

    def take(self, nbytes: int) -> memoryview | None:
        """``nbytes`` of the mapping, or ``None`` once it is full (or was too small to map)."""
        with self._lock:
            start = self._used
            if self._view is None or start + nbytes > self._size:
                return None
            self._used = start + -(-nbytes // 64) * 64  # each object on a cache line
            return self._view[start : start + nbytes]


#: Below this, kept objects go into buffers of their own: a huge page would be mostly unused.
_ARENA_MIN = 1 << 20
_HUGE = 2 << 20


def keep_budget(checkpoint_bytes: int) -> int:
    """Bytes a load of a ``checkpoint_bytes`` checkpoint may hold decoded besides the model
    (:class:`VaultCheckpoint`): the larger of 16 MiB and 8% of the checkpoint."""
    return max(KEEP_FLOOR, int(KEEP_FRACTION * checkpoint_bytes))


T = TypeVar("T")


def _locked(items: Iterator[T], lock: threading.Lock) -> Iterator[T]:
    """``items``, taken one at a time under ``lock`` (several threads share the iterator)."""
    while True:
        with lock:
            item = next(items, None)
        if item is None:
            return
        yield item


def open_record(store: Store, name: str, doc: Mapping[str, Any]) -> VaultCheckpoint | DcpCheckpoint:
    """The checkpoint record ``doc`` describes, of whichever kind it is."""
    # weightvault.dcp commits records of kind "dcp": tensors kept as shard chunks.
    if doc.get("kind") == KIND:
        return DcpCheckpoint(store, name, doc)
    return VaultCheckpoint(store, name, doc)
