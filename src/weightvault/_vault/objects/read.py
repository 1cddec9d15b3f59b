"""Reading an object: its raw bytes, whole or a range, decoded through its delta chain.

:func:`read_object` and :func:`read_range` give raw bytes whichever way an object is
stored (raw, a compressed frame, or a delta on a base object), following its chain
(:func:`~.chain.chain`) to a full object; :func:`read_verified` also checks the bytes
against the object's name. Every read finds the object's file through
:func:`~.address.locations`, so a gc holding it in its trash does not fail the read.

Example:
    >>> from weightvault._vault.store.backend import LocalStore
    >>> import tempfile
    >>> store = LocalStore(tempfile.mkdtemp())
    >>> from .file import write_loose
    >>> write_loose(store, [(content_hash(b"abc"), b"abc")])
    1
    >>> bytes(read_verified(store, content_hash(b"abc"), 3))
    b'abc'
"""

from __future__ import annotations

from collections.abc import Callable

from ..._base.errors import ChecksumError, FormatError
from ..._file.checkpoint import HASH_WINDOW
from ..store.backend import Store
from .address import content_hash, object_key
from .chain import Link, chain
from .file import Files, ObjectFile, open_file
from .frame import HEADER_SIZE, decode_range, is_frame

__all__ = [
    "OpenObject",
    "damaged",
    "open_object",
    "read_object",
    "read_range",
    "read_verified",
]


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
    store: Store,
    digest: str,
    nbytes: int | None = None,
    *,
    files: Files | None = None,
    into: Callable[[int], memoryview] | None = None,
) -> memoryview:
    """The raw bytes of object ``digest``, decompressed and its delta chain applied.

    A raw object comes back as its file's bytes, read into a buffer of its own (never
    mapped: a file cut short meanwhile is a :class:`FormatError`); a frame is decoded
    into a new buffer of exactly the raw size, which must be ``nbytes`` when
    given: a frame that claims more is refused before anything is allocated.

    ``into(n)``, when given, supplies that buffer (``n`` bytes, or more): a reader of
    many objects in turn (the compactor) reuses memory it has already touched, since new
    memory is zeroed by the kernel page by page before the read fills it.

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
            if into is None or f.preadv is None:
                return f.whole()
            out = into(f.size)[: f.size]
            try:
                f.read_into(0, out)
            except FormatError as e:
                raise FormatError(f"{f.where}: {e}") from None
            return out
    try:
        with open_object(store, digest, nbytes, files=files, first=f) as obj:
            out = memoryview(bytearray(obj.size)) if into is None else into(obj.size)
            out = out.cast("B")[: obj.size]
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


def damaged(where: str, stored: str, what: str) -> FormatError:
    """The error for an object that cannot serve tensor ``stored`` (``what`` says why)."""
    return FormatError(
        f"{where}: tensor {stored!r}: {what}; the vault is damaged, run "
        "'weightvault vault ROOT verify'"
    )


def read_verified(
    store: Store, digest: str, nbytes: int | None = None, *, files: Files | None = None
) -> memoryview:
    """:func:`read_object`, then checked against the object's name: its raw bytes must be
    ``nbytes`` long (when given) and their blake3 must be ``digest``. This is the one
    read that proves an object is the tensor its name says.

    Raises:
        FileNotFoundError: The object (or a base, when read from ``files``) is nowhere.
        FormatError: As :func:`read_object`.
        ChecksumError: The bytes decoded (to the size the message gives) but are not
            the object named ``digest``.
    """
    raw = read_object(store, digest, nbytes, files=files)
    if (nbytes is not None and raw.nbytes != nbytes) or content_hash(raw) != digest:
        raise ChecksumError(f"its {raw.nbytes} bytes do not match its name (blake3)")
    return raw
