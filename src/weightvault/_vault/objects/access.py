"""Object addressing: where a tensor's bytes live in a vault, and how they are read.

Every object is one tensor (or one DCP chunk), named by the blake3 hex digest of its raw
bytes and kept at ``objects/<digest[:2]>/<digest>``: either those raw bytes, or a frame
(:mod:`.frame`) that holds them compressed, or as a delta on a base object (:mod:`.diff`).
:func:`read_object` and :func:`read_range` give raw bytes whichever it is, following a
delta's chain of bases (:func:`chain`) to a full object. While a gc runs it
may hold an object in its trash, ``trash/<gc id>/<digest>``, until it either deletes it
(no checkpoint names it) or puts it back; the trash of a gc that died stays until the
next gc or :meth:`~weightvault.Vault.break_gc_lock` puts it back. So every read looks in
``objects/`` first, then in any trash, then in ``objects/`` again (the object may have
been put back meanwhile): :func:`locations` is that order, and every reader of objects
(whole-tensor checkpoints, DCP chunks, ranged DCP reads, verify) goes through it.

Nothing here maps a file: local objects and packs are read with ``preadv`` into memory
of the reader's own. An object is immutable once named, but another process, a damaged
disk or a hostile user can still cut one short, and touching a mapped page past a
file's new end kills the process with ``SIGBUS``; a short ``preadv`` is a
:class:`FormatError` naming the object instead (docs/benchmarks.md, section 31, measures both).

Example:
    >>> object_key(content_hash(b"abc"))[:11]
    'objects/64/'
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import blake3
import xxhash

from ..._base.errors import FormatError
from ..._file.checkpoint import HASH_WINDOW, Checkpoint, new_buffer
from ..._file.header import TensorInfo
from ..._file.manifest import Manifest
from ..store.backend import Store
from ..store.pack import Packed, find, forget, pack_key, pack_table
from .codec import codec_pool
from .frame import (
    HEADER_SIZE,
    MAX_DEPTH,
    Frame,
    decode_range,
    is_frame,
    parse_frame,
    parse_frame_header,
    table_size,
)

__all__ = [
    "DIGEST",
    "Files",
    "Link",
    "ObjectCheckpoint",
    "ObjectFile",
    "OpenObject",
    "chain",
    "checksum",
    "content_hash",
    "damaged",
    "in_trash",
    "is_temp",
    "locations",
    "object_file",
    "object_frame",
    "object_key",
    "object_size",
    "open_file",
    "open_object",
    "pack_locations",
    "prefetch",
    "read_object",
    "read_range",
    "with_bases",
    "write_loose",
]

#: An object's name: a blake3 hex digest.
DIGEST = re.compile(r"[0-9a-f]{64}")


def content_hash(data: memoryview | bytes) -> str:
    """The blake3 hex digest that names an object (multithreaded for large buffers)."""
    view = memoryview(data).cast("B")
    threads = blake3.blake3.AUTO if view.nbytes >= 1 << 22 else 1
    return blake3.blake3(view, max_threads=threads).hexdigest()


def checksum(data: memoryview | bytes) -> str:
    """The xxh3-64 hex digest a manifest records for a stored tensor (what loads check)."""
    return xxhash.xxh3_64(data).hexdigest()


def object_key(digest: str) -> str:
    """The key of object ``digest`` under ``objects/``."""
    return f"objects/{digest[:2]}/{digest}"


def is_temp(key: str) -> bool:
    """Whether ``key`` is a file a writer is still writing (or died writing)."""
    # LocalStore writes "<dir>/.<random>.tmp" and renames it into place.
    return key.rsplit("/", 1)[-1].startswith(".")


def in_trash(store: Store, digest: str) -> str | None:
    """The key of object ``digest`` in some gc's trash, or ``None``."""
    for blob in store.list("trash"):
        if blob.key.rsplit("/", 1)[-1] == digest and not is_temp(blob.key):
            return blob.key
    return None


def locations(store: Store, digest: str) -> Iterator[str]:
    """Keys to try, in order, for object ``digest`` (see the module docstring).

    The trash is listed only when ``objects/`` did not serve the first key, so a healthy
    read costs one lookup.
    """
    key = object_key(digest)
    yield key
    trashed = in_trash(store, digest)
    if trashed is not None:
        yield trashed
    yield key


def pack_locations(store: Store, digest: str) -> Iterator[tuple[str, Packed]]:
    """``(key, where)`` to try, in order, for object ``digest`` in a pack (:mod:`.pack`):
    the pack under ``packs/``, then in a gc's trash, then under ``packs/`` again. Nothing
    when no pack holds it. A pack found gone everywhere is forgotten, and the packs
    listed once more (the object may be in another)."""
    for _ in range(2):
        where = find(store, digest)
        if where is None:
            return
        key = pack_key(where.pack)
        yield key, where
        trashed = in_trash(store, where.pack)
        if trashed is not None:
            yield trashed, where
        yield key, where
        forget(store, where.pack)


def _loose_then_packed(
    store: Store, digest: str, *, known_first: bool = False
) -> Iterator[tuple[str, Packed | None]]:
    """Where to look for object ``digest``: ``objects/``, a pack, a gc's trash,
    ``objects/`` again (loose objects win: see :mod:`.pack`).

    ``known_first`` (for reads of the bytes only) tries first a pack this process
    already knows to hold the object: it holds the same raw bytes any loose copy decodes
    to, and the failed open of the loose name it saves was a tenth of a small resume. A
    pack deleted since fails to open, and the loose file is next. Never for what an
    object's frame says (its delta base, which gc must keep): that is the loose file's.
    """
    known = find(store, digest, refresh=False) if known_first else None
    if known is not None:
        yield pack_key(known.pack), known
    keys = locations(store, digest)
    yield next(keys), None
    yield from pack_locations(store, digest)
    for key in keys:
        yield key, None


def object_file(store: Store, digest: str) -> memoryview:
    """The bytes of object ``digest``'s file (raw bytes or a frame), wherever it is.

    Raises:
        FileNotFoundError: The object is nowhere; callers name the tensor it held.
    """
    for key, packed in _loose_then_packed(store, digest, known_first=True):
        try:
            path = store.local_path(key)
            if path is not None:
                with open_file_at(path, packed) as f:
                    return f.whole()
            if packed is None:
                return store.view(key)
            return _packed_view(store, key, packed)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(object_key(digest))


def _packed_view(store: Store, key: str, where: Packed) -> memoryview:
    """An object's bytes in the pack at ``key`` of a remote store (one ranged read)."""
    if where.size == 0 and store.size(key) is not None:
        return memoryview(bytearray())  # a ranged read of nothing may read the whole file
    data = store.get_range(key, where.offset, where.offset + where.size)
    if len(data) != where.size:
        raise FormatError(f"{store.url}/{key}: the pack ended before its objects did")
    return memoryview(bytearray(data))


#: Where a read finds an object's file: the store, or files fetched ahead (remote stores).
Files = Mapping[str, bytes | memoryview]


class ObjectFile:
    """One object's file, open for reads by range.

    A local file is read with ``pread`` through one descriptor, so a load touches only
    the blocks it decodes and maps nothing (mapped pages would count in the process'
    RSS); a file fetched ahead, or from a remote store, is its bytes in memory.
    """

    def __init__(
        self,
        *,
        fd: int = -1,
        data: memoryview | None = None,
        window: Packed | None = None,
        where: str = "",
    ) -> None:
        self._fd = fd
        self._data = data
        #: The file (the pack, for an object in one), for messages.
        self.where = where
        # An object in a pack is a window of the pack's file (see :mod:`.pack`).
        self._at = window.offset if window is not None else 0
        self._window = window is not None
        if window is not None:
            self.size = window.size
        else:
            self.size = os.fstat(fd).st_size if data is None else data.nbytes

    def read(self, offset: int, length: int) -> bytes | memoryview:
        """Up to ``length`` bytes at ``offset`` (fewer only past the end of the file)."""
        length = max(0, min(length, self.size - offset))
        if self._data is not None:
            return self._data[offset : offset + length]
        return os.pread(self._fd, length, self._at + offset)

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``offset``.

        Raises:
            FormatError: The file ends first (it was truncated).
        """
        out = out.cast("B")
        if (self._data is not None or self._window) and offset + out.nbytes > self.size:
            raise FormatError("the object ended before its bytes did")
        if self._data is not None:
            out[:] = self._data[offset : offset + out.nbytes]
            return
        offset += self._at
        while out.nbytes:
            n = os.preadv(self._fd, [out[: 1 << 30]], offset)  # ~2 GiB per call at most
            if n == 0:
                raise FormatError("the object ended before its bytes did (truncated)")
            out, offset = out[n:], offset + n

    def whole(self) -> memoryview:
        """Every byte of the file (or of its window in a pack), in a buffer of its own.

        Raises:
            FormatError: The file was cut short since it was opened, naming it.
        """
        if self._data is not None:
            return self._data
        out = new_buffer(self.size)
        try:
            self.read_into(0, out)
        except FormatError as e:
            raise FormatError(f"{self.where}: {e}") from None
        return out

    @property
    def preadv(self) -> Callable[[int, memoryview], None] | None:
        """:meth:`read_into` for a local file (reads into a buffer); ``None`` for bytes
        in memory, which are sliced without a copy."""
        return self.read_into if self._data is None else None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._data = None

    def __del__(self) -> None:
        # A checkpoint dropped without close() must not leak the descriptors it held.
        self.close()

    def __enter__(self) -> ObjectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_file_at(path: str, packed: Packed | None) -> ObjectFile:
    """The local file at ``path`` (or the window ``packed`` of it, in a pack), open for
    ``preadv``. A pack's index was checked against the pack's size when it was read; a
    pack cut short since then fails the read (:meth:`ObjectFile.read_into`).

    Raises:
        FileNotFoundError: Nothing is at ``path``.
    """
    return ObjectFile(fd=os.open(path, os.O_RDONLY), window=packed, where=path)


def open_file(store: Store, digest: str, files: Files | None = None) -> ObjectFile:
    """Object ``digest``'s file, opened wherever a gc may hold it (:func:`locations`).

    Raises:
        FileNotFoundError: The object is nowhere; callers name the tensor it held.
    """
    if files is not None and digest in files:
        return ObjectFile(data=memoryview(files[digest]).cast("B"))
    for key, packed in _loose_then_packed(store, digest, known_first=True):
        path = store.local_path(key)
        try:
            if path is None:
                if packed is None:
                    return ObjectFile(data=store.view(key))
                return ObjectFile(data=_packed_view(store, key, packed))
            return open_file_at(path, packed)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(object_key(digest))


#: One object of a delta chain: ``(digest, its file, its frame or None for raw bytes)``.
Link = tuple[str, ObjectFile, Frame | None]


class OpenObject:
    """An object and its delta bases down to a full object, every file open and every
    frame checked (:func:`open_object`); decodes any range of the object's raw bytes.

    Use it as a context manager: it holds a descriptor per link.
    """

    def __init__(self, links: list[Link]) -> None:
        self.links = links
        top = links[0][2]
        self.size = top.raw_size if top is not None else links[0][1].size
        #: A delta applies to whole items: decoded ranges start and end on them.
        self.itemsize = top.itemsize if top is not None else 1

    @property
    def raw(self) -> bool:
        """Whether the object is its raw bytes (no frame, no chain)."""
        return self.links[0][2] is None

    @property
    def window(self) -> int:
        """The bytes a sequential reader decodes at once: the top frame's block, when every
        link's blocks line up with it and with whole items, else the whole object."""
        frames = [f for _, _, f in self.links if f is not None]
        if not frames:
            return max(1, min(self.size, _RAW_WINDOW))  # an empty object: one empty window
        block = frames[0].block_size
        if block % self.itemsize or any(f.block_size != block for f in frames):
            return self.size
        return min(self.size, block)

    def decode_into(self, out: memoryview, start: int = 0, *, parallel: bool = True) -> None:
        """Raw bytes ``[start, start + len(out))`` into ``out`` (item-aligned for a delta).

        Raises:
            FormatError: A block does not decode, or a file was truncated while read.
        """
        out = out.cast("B")
        _, base, frame = self.links[-1]
        if frame is None:
            base.read_into(start, out)
        else:
            decode_range(base.read, frame, out, start, parallel=parallel, read_into=base.preadv)
        for _, delta, frame in reversed(self.links[:-1]):
            assert frame is not None
            decode_range(delta.read, frame, out, start, parallel=parallel, read_into=delta.preadv)

    def close(self) -> None:
        for _, f, _ in self.links:
            f.close()

    def __enter__(self) -> OpenObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Raw objects are hashed in windows of this size (a frame's are its blocks).
_RAW_WINDOW = HASH_WINDOW


def open_object(
    store: Store,
    digest: str,
    nbytes: int | None = None,
    *,
    files: Files | None = None,
    first: ObjectFile | None = None,
) -> OpenObject:
    """Object ``digest`` and its delta chain, opened and checked (:func:`chain`).

    ``first``: the object's file, opened already (the result owns it from then on).

    Raises:
        FileNotFoundError: The object itself is nowhere.
        FormatError: Its frame is damaged or lies, or a base is missing or does not fit.
    """
    if first is None:
        first = open_file(store, digest, files)
    opened = [first]

    def get(d: str) -> ObjectFile:
        f = open_file(store, d, files)
        opened.append(f)
        return f

    try:
        return OpenObject(chain(digest, first, nbytes, get))
    except BaseException:
        for f in opened:
            f.close()
        raise


def _is_raw(head: memoryview, size: int | None, file_size: int) -> bool:
    """Whether a file of ``file_size`` bytes that starts with ``head`` is the object's raw
    bytes rather than a frame (see :mod:`.frame`)."""
    return not is_frame(head) or (size is not None and file_size == size)


def read_object(
    store: Store, digest: str, nbytes: int | None = None, *, files: Files | None = None
) -> memoryview:
    """The raw bytes of object ``digest``, decompressed and its delta chain applied.

    A raw object comes back as its file's bytes, read into a buffer of its own (never
    mapped: a file cut short meanwhile is a :class:`FormatError`); a frame is decoded
    into a new buffer of exactly the raw size, which must be ``nbytes`` when
    given: a frame that claims more is refused before anything is allocated.

    Raises:
        FileNotFoundError: The object is nowhere; callers name the tensor it held.
        FormatError: Its frame is damaged or lies, or a delta base is missing or does not
            fit; the message names the object.
    """
    # Told apart by the file's size and first bytes, so a frame is not read whole first;
    # a frame is decoded through the same open file.
    f = open_file(store, digest, files)
    try:
        raw = _is_raw(memoryview(f.read(0, HEADER_SIZE)), nbytes, f.size)
    except BaseException:
        f.close()
        raise
    if raw:
        with f:
            return f.whole()
    try:
        with open_object(store, digest, nbytes, files=files, first=f) as obj:
            out = memoryview(bytearray(obj.size))
            obj.decode_into(out)
            return out
    except FormatError as e:
        raise FormatError(f"{store.url}/{object_key(digest)}: {e}") from None


def read_range(store: Store, digest: str, start: int, end: int) -> bytes:
    """Raw bytes ``[start, end)`` of object ``digest``, wherever a gc may hold it.

    A raw object is read by range; a frame decodes only the blocks that cover it.

    Raises:
        FileNotFoundError: The object is nowhere.
        FormatError: Its frame is damaged, or the range lies outside the object.
    """
    try:
        with open_object(store, digest) as obj:
            size = obj.size
            if not 0 <= start <= end <= size:
                raise FormatError(f"bytes [{start}, {end}) lie outside the object's {size}")
            item = obj.itemsize  # a delta applies to whole items
            lo, hi = start - start % item, min(size, end + (-end % item))
            out = memoryview(bytearray(hi - lo))
            obj.decode_into(out, lo)
            return bytes(out[start - lo : end - lo])
    except FormatError as e:
        raise FormatError(f"{store.url}/{object_key(digest)}: {e}") from None


def chain(
    digest: str, first: ObjectFile, nbytes: int | None, get: Callable[[str], ObjectFile]
) -> list[Link]:
    """Object ``digest`` (file ``first``) and its delta bases down to a full object, every
    link checked.

    A base must be as large as its delta, split into the same byte planes, and one level
    shallower, so a chain ends: a cycle or a chain deeper than :data:`~.frame.MAX_DEPTH`
    is refused. Only each frame's header and block table are read here.

    Raises:
        FormatError: A frame is damaged, or a base is missing or does not fit its delta.
    """
    links: list[Link] = []
    f = first
    while True:
        frame = _frame_of(f, nbytes)
        if frame is None and nbytes is not None and f.size != nbytes:
            raise FormatError(f"object {digest[:12]} holds {f.size} bytes, expected {nbytes}")
        if links:
            _check_base(links, digest, frame)
        links.append((digest, f, frame))
        if frame is None or frame.base is None:
            return links
        digest, nbytes = frame.base, frame.raw_size
        try:
            f = get(digest)
        except FileNotFoundError:
            raise FormatError(f"its delta base {digest[:12]} is missing") from None


def _frame_of(f: ObjectFile, nbytes: int | None) -> Frame | None:
    """The frame of file ``f``, or ``None`` if it holds raw bytes (see :mod:`.frame`)."""
    if nbytes is not None and f.size == nbytes:
        return None
    head = memoryview(f.read(0, HEADER_SIZE))
    if not is_frame(head):
        return None
    header = parse_frame_header(head)
    if nbytes is not None and header.raw_size != nbytes:
        raise FormatError(f"the frame claims {header.raw_size} raw bytes, the record says {nbytes}")
    # The table is read only once the header says it fits in the file.
    table = table_size(head)
    if table > f.size:
        blocks = -(-header.raw_size // header.block_size)
        raise FormatError(
            f"the frame's block table ({blocks} blocks) runs past its end (truncated)"
        )
    return parse_frame(memoryview(f.read(0, table)), nbytes, f.size)


def _check_base(links: list[Link], digest: str, frame: Frame | None) -> None:
    """Check that ``digest`` (``frame``) can be the base of the last link's delta.

    Version 1 frames (forward deltas, issue 20) name a base exactly one level shallower.
    Version 2 frames record their depth as written, and the compactor later turns their
    full bases into deltas of newer objects, so there only the chain as a whole is
    bounded: no object twice (a cycle) and at most :data:`~.frame.MAX_DEPTH` links.
    """
    parent = links[-1][2]
    assert parent is not None
    depth = frame.depth if frame else 0
    if parent.version == 1 and (frame is None or frame.version == 1):
        if depth != parent.depth - 1:
            raise FormatError(
                f"delta base {digest[:12]} has depth {depth}, expected {parent.depth - 1} "
                "(a broken or cyclic delta chain)"
            )
    elif any(d == digest for d, _, _ in links) or len(links) >= MAX_DEPTH:
        raise FormatError(
            f"delta base {digest[:12]} makes a chain of {len(links) + 1} objects "
            "(a cyclic or overlong delta chain)"
        )
    if frame is not None and frame.itemsize != parent.itemsize:
        raise FormatError(
            f"delta base {digest[:12]} holds {frame.itemsize}-byte items, its delta "
            f"{parent.itemsize}-byte ones (another dtype)"
        )


def object_frame(store: Store, digest: str) -> Frame | None:
    """The frame header of object ``digest`` (its block table unread), or ``None`` if the
    object is raw bytes, absent, or its header does not parse (the full read says why)."""
    for key, packed in _loose_then_packed(store, digest):
        if packed is not None:
            return None  # a pack holds raw bytes only
        try:
            head = store.get_range(key, 0, HEADER_SIZE)
        except FileNotFoundError:
            continue
        if not is_frame(head):
            return None
        try:
            return parse_frame_header(memoryview(head))
        except FormatError:
            return None
    return None


def with_bases(
    store: Store, digests: set[str], beat: Callable[[], None] = lambda: None
) -> set[str]:
    """``digests`` and every delta base their frames name, transitively (what gc keeps).

    Read from the objects' own frames, wherever they are (``objects/`` or a gc's trash),
    so no record needs to list bases, and an object reused by a later checkpoint keeps
    its chain. A frame that does not parse names nothing (loads report it).
    """
    live = set(digests)
    frontier = sorted(live)
    while frontier:
        # A few runs of digests per thread, not one task each: reading a frame's header
        # costs about what handing it to a thread does (a gc after 300 saves of the lm
        # run reads 4,200, twice; docs/benchmarks.md, section 27).
        runs = [frontier[i::_FRAME_RUNS] for i in range(min(_FRAME_RUNS, len(frontier)))]
        found = {
            f.base
            for frames in codec_pool().map(lambda run: [object_frame(store, d) for d in run], runs)
            for f in frames
            if f is not None and f.base is not None
        }
        frontier = sorted(found - live)
        live |= found
        beat()
    return live


#: How many runs :func:`with_bases` splits each round's digests into.
_FRAME_RUNS = 16


def object_size(store: Store, digest: str, nbytes: int | None = None) -> int | None:
    """The raw size of object ``digest`` wherever a gc may hold it, or ``None`` if gone.

    A file of exactly ``nbytes`` (the size the record expects) is raw bytes; any other
    is asked for its frame header.
    """
    for key, packed in _loose_then_packed(store, digest):
        if packed is not None:
            if store.size(key) is None:
                continue
            return packed.size  # a pack holds raw bytes only
        size = store.size(key)
        if size is None:
            continue
        if size == nbytes or size < HEADER_SIZE:
            return size
        frame = object_frame(store, digest)
        return frame.raw_size if frame is not None else size
    return None


def prefetch(store: Store, digests: Iterator[str] | list[str]) -> dict[str, bytes]:
    """The files of ``digests`` and of their delta bases, fetched concurrently in rounds
    (one per chain level); used for remote stores, where each read is a round trip.

    Objects in a save's pack come with one read of each pack they are in (a pack holds
    raw bytes only, so they name no bases). An object that is in neither (a gc may hold
    it in its trash) ends the prefetch early: reads then look for it one by one, and name
    its tensor if it is gone.
    """
    out: dict[str, bytes] = {}
    wanted = sorted(set(digests))
    pack_table(store).refresh(store)
    for _ in range(MAX_DEPTH + 1):
        _prefetch_packed(store, [d for d in wanted if d not in out], out)
        keys = {object_key(d): d for d in wanted if d not in out}
        if not keys:
            break
        try:
            got = store.get_many(list(keys))
        except FileNotFoundError:
            break
        bases = []
        for key, data in got.items():
            out[keys[key]] = data
            if is_frame(data) and len(data) >= HEADER_SIZE:
                try:
                    base = parse_frame_header(memoryview(data)).base
                except FormatError:
                    continue
                if base is not None:
                    bases.append(base)
        wanted = bases
    return out


def _prefetch_packed(store: Store, digests: list[str], out: dict[str, bytes]) -> None:
    """Add to ``out`` the objects of ``digests`` a known pack holds, one read per pack (a
    pack gone since is left out: those objects are then read one by one)."""
    where = {d: w for d in digests if (w := find(store, d, refresh=False)) is not None}
    keys = sorted({pack_key(w.pack) for w in where.values()})
    if not keys:
        return
    try:
        got = store.get_many(keys)
    except FileNotFoundError:
        return
    for digest, w in where.items():
        data = got[pack_key(w.pack)]
        if w.offset + w.size <= len(data):
            out[digest] = bytes(memoryview(data)[w.offset : w.offset + w.size])


def write_loose(store: Store, objects: Iterable[tuple[str, bytes | memoryview]]) -> int:
    """Write each ``(digest, raw bytes)`` as a file of its own under ``objects/``, all
    made durable and put in place at once, as a save's are; how many were written. On
    any error nothing of them is left (what was staged is discarded)."""
    staged: dict[str, str] = {}
    nbytes = 0
    try:
        for digest, raw in objects:
            staged[object_key(digest)] = store.stage(object_key(digest), [raw])
            nbytes += memoryview(raw).nbytes
        store.publish(staged, nbytes)
    except BaseException:
        store.discard(staged)
        raise
    return len(staged)


def damaged(where: str, stored: str, what: str) -> FormatError:
    """The error for an object that cannot serve tensor ``stored`` (``what`` says why)."""
    return FormatError(
        f"{where}: tensor {stored!r}: {what}; the vault is damaged, run "
        "'weightvault vault ROOT verify'"
    )


class ObjectCheckpoint(Checkpoint):
    """A checkpoint whose bytes are vault objects, whatever the record's kind.

    Args:
        store: The vault's store.
        where: The record, for messages.
        stored: The tensors, as a single file's header lists them.
        manifest: Their manifest.
        framework: The ``"format"`` the header records.
        objects: ``{label: digest}``, one label per object the checkpoint needs (a stored
            tensor, or a DCP chunk): gc keeps and verify checks each of them.
        sizes: ``{label: nbytes}``, what each of those objects must hold.
    """

    def __init__(
        self,
        store: Store,
        where: str,
        stored: dict[str, TensorInfo],
        manifest: Manifest,
        *,
        framework: str | None,
        objects: dict[str, str],
        sizes: dict[str, int],
    ) -> None:
        self.store = store
        self.objects = objects
        self._sizes = sizes
        self._framework = framework
        super().__init__(where, stored, manifest)

    @property
    def framework(self) -> str | None:
        return self._framework

    @property
    def container(self) -> str:
        return "vault"

    def object_nbytes(self, label: str) -> int:
        """The size the object named under ``label`` in :attr:`objects` must have."""
        return self._sizes[label]

    def missing(self) -> dict[str, str]:
        """``{label: problem}`` for objects that are absent or of the wrong size."""
        out = {}
        for label, digest in self.objects.items():
            size = object_size(self.store, digest, self._sizes[label])
            if size is None:
                out[label] = "object missing"
            elif size != self._sizes[label]:
                out[label] = f"object holds {size} bytes, expected {self._sizes[label]}"
        return out

    def fetch(self) -> None:
        """Bring the objects into memory now, concurrently (used for remote stores)."""
        raise NotImplementedError
