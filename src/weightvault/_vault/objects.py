"""Object addressing: where a tensor's bytes live in a vault, and how they are read.

Every object is one tensor (or one DCP chunk), named by the blake3 hex digest of its raw
bytes and kept at ``objects/<digest[:2]>/<digest>``: either those raw bytes, or a frame
(:mod:`.frame`) that holds them compressed, or as the XOR with a base object (a delta).
:func:`read_object` and :func:`read_range` give raw bytes whichever it is, following a
delta's chain of bases (:func:`chain`) to a full object. While a gc runs it
may hold an object in its trash, ``trash/<gc id>/<digest>``, until it either deletes it
(no checkpoint names it) or puts it back; the trash of a gc that died stays until the
next gc or :meth:`~weightvault.Vault.break_gc_lock` puts it back. So every read looks in
``objects/`` first, then in any trash, then in ``objects/`` again (the object may have
been put back meanwhile): :func:`locations` is that order, and every reader of objects
(whole-tensor checkpoints, DCP chunks, ranged DCP reads, verify) goes through it.

Example:
    >>> object_key(content_hash(b"abc"))[:11]
    'objects/64/'
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

import blake3
import xxhash

from .._base.errors import FormatError
from .._file.checkpoint import Checkpoint
from .._file.header import TensorInfo
from .._file.manifest import Manifest
from .codec import codec_pool
from .frame import (
    HEADER_SIZE,
    MAX_DEPTH,
    Frame,
    decode_into,
    is_frame,
    parse_frame,
    parse_frame_header,
)
from .store import Store

__all__ = [
    "DIGEST",
    "Files",
    "Link",
    "ObjectCheckpoint",
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
    "prefetch",
    "read_object",
    "read_range",
    "with_bases",
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


def object_file(store: Store, digest: str) -> memoryview:
    """The bytes of object ``digest``'s file (raw bytes or a frame), wherever a gc holds it.

    Raises:
        FileNotFoundError: The object is nowhere; callers name the tensor it held.
    """
    for key in locations(store, digest):
        try:
            return store.view(key)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(object_key(digest))


#: Where a read finds an object's file: the store, or files fetched ahead (remote stores).
Files = Mapping[str, bytes | memoryview]


def _getter(store: Store, files: Files | None) -> Callable[[str], memoryview]:
    def get(digest: str) -> memoryview:
        if files is not None and digest in files:
            return memoryview(files[digest])
        return object_file(store, digest)

    return get


def _is_raw(data: memoryview, size: int | None) -> bool:
    """Whether a file is the object's raw bytes rather than a frame (see :mod:`.frame`)."""
    return not is_frame(data) or (size is not None and data.nbytes == size)


def read_object(
    store: Store, digest: str, nbytes: int | None = None, *, files: Files | None = None
) -> memoryview:
    """The raw bytes of object ``digest``, decompressed and its delta chain applied.

    A raw object comes back as its file's bytes (mapped, for a local store); a frame is
    decoded into a new buffer of exactly the raw size, which must be ``nbytes`` when
    given: a frame that claims more is refused before anything is allocated.

    Raises:
        FileNotFoundError: The object is nowhere; callers name the tensor it held.
        FormatError: Its frame is damaged or lies, or a delta base is missing or does not
            fit; the message names the object.
    """
    get = _getter(store, files)
    data = get(digest)
    if _is_raw(data, nbytes):
        return data
    return _rebuild(store, digest, get, data, nbytes, 0, None)


def read_range(store: Store, digest: str, start: int, end: int) -> bytes:
    """Raw bytes ``[start, end)`` of object ``digest``, wherever a gc may hold it.

    A raw object is read by range; a frame decodes only the blocks that cover it.

    Raises:
        FileNotFoundError: The object is nowhere.
        FormatError: Its frame is damaged, or the range lies outside the object.
    """
    for key in locations(store, digest):
        try:
            head = store.get_range(key, 0, HEADER_SIZE)
            if not is_frame(head):
                return store.get_range(key, start, end)
            data = store.view(key)
        except FileNotFoundError:
            continue
        get = _getter(store, None)
        return bytes(_rebuild(store, digest, get, data, None, start, end))
    raise FileNotFoundError(object_key(digest))


def _rebuild(
    store: Store,
    digest: str,
    get: Callable[[str], memoryview],
    data: memoryview,
    nbytes: int | None,
    start: int,
    end: int | None,
) -> memoryview:
    try:
        links = chain(digest, data, nbytes, get)
        top = links[0][2]
        size = top.raw_size if top else data.nbytes
        end = size if end is None else end
        if not 0 <= start <= end <= size:
            raise FormatError(f"bytes [{start}, {end}) lie outside the object's {size}")
        item = top.itemsize if top else 1  # a delta applies to whole items
        lo, hi = start - start % item, min(size, end + (-end % item))
        out = memoryview(bytearray(hi - lo))
        _, base, frame = links[-1]
        if frame is None:
            out[:] = base[lo:hi]
        else:
            decode_into(base, frame, out, lo)
        for _, delta, frame in reversed(links[:-1]):
            decode_into(delta, frame, out, lo)  # type: ignore[arg-type]
        return out[start - lo : end - lo]
    except FormatError as e:
        raise FormatError(f"{store.url}/{object_key(digest)}: {e}") from None


Link = tuple[str, memoryview, Frame | None]


def chain(
    digest: str, data: memoryview, nbytes: int | None, get: Callable[[str], memoryview]
) -> list[Link]:
    """Object ``digest`` and its delta bases down to a full object, every link checked.

    Each link is ``(digest, file bytes, frame or None for raw bytes)``. A base must be
    as large as its delta, split into the same byte planes, and one level shallower, so
    a chain ends: a cycle or a chain deeper than :data:`~.frame.MAX_DEPTH` is refused.

    Raises:
        FormatError: A frame is damaged, or a base is missing or does not fit its delta.
    """
    links: list[Link] = []
    while True:
        frame = None if _is_raw(data, nbytes) else parse_frame(data, nbytes)
        if frame is None and nbytes is not None and data.nbytes != nbytes:
            raise FormatError(f"object {digest[:12]} holds {data.nbytes} bytes, expected {nbytes}")
        if links:
            _check_base(links[-1], digest, frame)
        links.append((digest, data, frame))
        if frame is None or frame.base is None:
            return links
        digest, nbytes = frame.base, frame.raw_size
        try:
            data = get(digest)
        except FileNotFoundError:
            raise FormatError(f"its delta base {digest[:12]} is missing") from None


def _check_base(delta: Link, digest: str, frame: Frame | None) -> None:
    parent = delta[2]
    assert parent is not None
    depth = frame.depth if frame else 0
    if depth != parent.depth - 1:
        raise FormatError(
            f"delta base {digest[:12]} has depth {depth}, expected {parent.depth - 1} "
            "(a broken or cyclic delta chain)"
        )
    if frame is not None and frame.itemsize != parent.itemsize:
        raise FormatError(
            f"delta base {digest[:12]} holds {frame.itemsize}-byte items, its delta "
            f"{parent.itemsize}-byte ones (another dtype)"
        )


def object_frame(store: Store, digest: str) -> Frame | None:
    """The frame header of object ``digest`` (its block table unread), or ``None`` if the
    object is raw bytes, absent, or its header does not parse (the full read says why)."""
    for key in locations(store, digest):
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
        frames = codec_pool().map(lambda d: object_frame(store, d), frontier)
        found = {f.base for f in frames if f is not None and f.base is not None}
        frontier = sorted(found - live)
        live |= found
        beat()
    return live


def object_size(store: Store, digest: str, nbytes: int | None = None) -> int | None:
    """The raw size of object ``digest`` wherever a gc may hold it, or ``None`` if gone.

    A file of exactly ``nbytes`` (the size the record expects) is raw bytes; any other
    is asked for its frame header.
    """
    for key in locations(store, digest):
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

    An object that is not in ``objects/`` (a gc may hold it in its trash) ends the
    prefetch early: reads then look for it one by one, and name its tensor if it is gone.
    """
    out: dict[str, bytes] = {}
    wanted = sorted(set(digests))
    for _ in range(MAX_DEPTH + 1):
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
