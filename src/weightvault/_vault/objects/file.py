"""An object's file, opened for reads by range, and loose objects written durably.

Nothing here maps a file: local objects and packs are read with ``preadv`` into memory
of the reader's own. An object is immutable once named, but another process, a damaged
disk or a hostile user can still cut one short, and touching a mapped page past a
file's new end kills the process with ``SIGBUS``; a short ``preadv`` is a
:class:`FormatError` naming the object instead (docs/benchmarks-log.md, section 31, measures both).

Example:
    >>> with ObjectFile(data=memoryview(b"abc")) as f:
    ...     bytes(f.read(1, 5))
    b'bc'
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

from ..._base.errors import FormatError
from ..._file.checkpoint import new_buffer
from ..store.backend import Store
from ..store.pack import Packed
from .address import object_key, search_order

__all__ = [
    "Files",
    "ObjectFile",
    "object_file",
    "open_file",
    "open_file_at",
    "write_loose",
]

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
        # An object in a pack is a window of the pack's file (see :mod:`..store.pack`).
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
    """Object ``digest``'s file, opened wherever a gc may hold it (:func:`~.address.locations`).

    Raises:
        FileNotFoundError: The object is nowhere; callers name the tensor it held.
    """
    if files is not None and digest in files:
        return ObjectFile(data=memoryview(files[digest]).cast("B"))
    for key, packed in search_order(store, digest, known_first=True):
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


def object_file(store: Store, digest: str) -> memoryview:
    """The bytes of object ``digest``'s file (raw bytes or a frame), wherever it is.

    Raises:
        FileNotFoundError: The object is nowhere; callers name the tensor it held.
    """
    for key, packed in search_order(store, digest, known_first=True):
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
