"""Checkpoints open for reading: validated names, a manifest, and bytes on demand.

:class:`Checkpoint` is what the load policy and every adapter read from. Its bytes may
come from a safetensors file (:class:`SafetensorsFile`, read with ``preadv``), from arrays decoded
out of a foreign format (:class:`MemoryCheckpoint`) or from a vault; the policy cannot
tell the difference, so renames, strictness, ties and frozen flags behave the same for all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import mmap
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Self

import xxhash

from .._base.dtypes import ITEMSIZE, numel
from .._base.errors import ChecksumError, FormatError, capped
from .._base.limits import ENV_VAR, resolve_limit
from .._base.types import PathLike
from .header import Header, TensorInfo, read_header
from .manifest import INTERNAL_PREFIX, Manifest, View, read_manifest

Kind = Literal["stored", "alias", "copy", "view"]


@dataclass(frozen=True)
class Entry:
    """One name in a checkpoint, whatever way it is held."""

    name: str
    kind: Kind
    stored: str  # the stored tensor whose bytes this name reads
    dtype: str
    shape: tuple[int, ...]
    view: View | None = None
    #: Names with the same group are one tensor (tied). A copy or a view is a group of its
    #: own, shared with its aliases.
    group: str = ""

    @property
    def value_key(self) -> str | None:
        """Names with the same value key hold equal bytes; ``None`` means compare the bytes."""
        return self.stored if self.view is None else None

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * ITEMSIZE[self.dtype]


class Checkpoint:
    """Names, manifest and bytes of one checkpoint, however it is kept.

    Public as ``weightvault.Checkpoint``: what :meth:`weightvault.Vault.open` and
    :func:`weightvault.formats.open_any` return, and what every adapter's ``load``
    accepts in place of a path. Subclasses provide :meth:`raw` and, if they can,
    :meth:`check`.

    Example:
        >>> with weightvault.formats.open_any("model-0000.params") as ckpt:
        ...     isinstance(ckpt, weightvault.Checkpoint), ckpt.container
        (True, 'mxnet')
    """

    def __init__(self, path: str, stored: dict[str, TensorInfo], manifest: Manifest) -> None:
        self.path = path
        self.stored = stored
        self.manifest = manifest
        self.entries = self._entries()

    def _entries(self) -> dict[str, Entry]:
        t, m = self.stored, self.manifest

        def held(name: str, kind: Kind, group: str) -> Entry:
            if name in t:
                return Entry(name, kind, name, t[name].dtype, t[name].shape, None, group)
            if name in m.copies and m.copies[name] in t:
                s = t[m.copies[name]]
                return Entry(name, kind, s.name, s.dtype, s.shape, None, group)
            v = m.views[m.copies.get(name, name)]
            return Entry(name, kind, v.base, v.dtype, v.shape, v, group)

        out: dict[str, Entry] = {}
        for name in m.names:
            if name in m.aliases:
                target = m.aliases[name]
                out[name] = held(target, "alias", target)
            elif name in t:
                out[name] = held(name, "stored", name)
            else:
                out[name] = held(name, "copy" if name in m.copies else "view", name)
            out[name] = dataclasses.replace(out[name], name=name)
        return out

    @property
    def names(self) -> list[str]:
        """Every name a model may ask for, in the order the model had them."""
        return list(self.entries)

    @property
    def size(self) -> int:
        """Bytes the checkpoint occupies where it is kept."""
        return sum(t.nbytes for t in self.stored.values())

    @property
    def framework(self) -> str | None:
        return None

    @property
    def container(self) -> str:
        """What holds the bytes: ``"safetensors"``, ``"vault"``, or a foreign format."""
        return "memory"

    def is_internal(self, name: str) -> bool:
        return name.startswith(INTERNAL_PREFIX)

    def entry(self, name: str) -> Entry:
        return self.entries[name]

    def owns_memory(self, e: Entry) -> bool:
        """Whether ``e``'s tensor is a copy: memory of its own (shared with its aliases)."""
        # Asked of the manifest, not of ``entries``: an alias may name internal storage,
        # which is no entry of its own.
        return e.group in self.manifest.copies

    def raw(self, stored: str) -> memoryview:
        """The bytes of a stored tensor."""
        raise NotImplementedError

    def mapped(self, stored: str) -> memoryview:
        """The bytes of a stored tensor for tensors built on them without a copy
        (``mmap=True``): a file's mapping where there is one, else :meth:`raw`."""
        return self.raw(stored)

    def check(self, stored: str) -> bool:
        """Whether ``stored``'s bytes match their checksum (``True`` if none was recorded)."""
        return True

    def unchanged(self, stored: str) -> bool:
        """Whether the model being filled holds ``stored``'s bytes already, so that an
        adapter's load may skip assigning it: never, but in ``Vault.walk``, for what the
        previous checkpoint it loaded into the same model stored unchanged."""
        return False

    def read_into(self, stored: str, buffer: memoryview) -> bool:
        """Copy ``stored``'s bytes into ``buffer`` with file reads; ``False`` if unsupported."""
        return False

    def read(self, stored: str) -> memoryview:
        """A private, writable copy of ``stored``'s bytes.

        File-backed checkpoints read it with ``preadv``, so a file truncated meanwhile is
        a :class:`FormatError`, never the ``SIGBUS`` that touching a mapping would raise.
        """
        buffer = memoryview(bytearray(self.stored[stored].nbytes))
        if buffer.nbytes and not self.read_into(stored, buffer):
            buffer[:] = self.raw(stored)
        return buffer

    def materializing(self, nbytes: int, what: str, limit: int | None = None) -> None:
        """Refuse to allocate ``nbytes`` for ``what`` if that is out of all proportion.

        Aliases, copies and stride-0 views let a header of a few hundred bytes describe
        gigabytes of values. A reader that builds every value eagerly asks here first,
        with the total it is about to allocate.

        Args:
            nbytes: Bytes the read will allocate.
            what: What is read, for the message.
            limit: The caller's own cap; by default :func:`materialize_limit`.

        Raises:
            FormatError: ``nbytes`` exceeds the limit.
        """
        cap = materialize_limit(self.size) if limit is None else limit
        if nbytes > cap:
            raise FormatError(
                f"{self.path}: {what} would allocate {nbytes} bytes, more than the "
                f"{cap}-byte limit for a {self.size}-byte file (aliases, copies or "
                "stride-0 views describe far more values than the file stores); if the "
                f"file is trusted, pass a larger max_bytes= or set {ENV_VAR}"
            )

    def verify(self, stored: list[str] | None = None) -> None:
        """Check the checksums of ``stored`` (default: all), before any byte is used.

        Raises:
            ChecksumError: Naming every tensor whose bytes changed since it was saved.
        """
        names = list(self.stored) if stored is None else stored
        # Hashing releases the GIL: check several tensors at once.
        with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
            ok = list(pool.map(self.check, names))
        bad = [n for n, good in zip(names, ok, strict=True) if not good]
        if bad:
            raise checksum_error(self.path, bad)

    def stage(self, stored: list[str], verify: bool) -> None:
        """Make sure every byte of ``stored`` can be read (and, with ``verify``, matches its
        checksum) before a load changes anything: a load is all or nothing.

        Here every stored tensor is reached once; a vault checkpoint decodes and checks its
        objects within a memory budget instead
        (:meth:`weightvault._vault.records.checkpoint.VaultCheckpoint.stage`).

        Raises:
            FormatError: A stored tensor cannot be read.
            ChecksumError: ``verify`` and a tensor's bytes are damaged.
        """
        if verify:
            self.verify(stored)
        for name in stored:
            self.raw(name)

    def close(self) -> None:
        """Release what the checkpoint holds open."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SafetensorsFile(Checkpoint):
    """A validated safetensors file (ours or anyone's).

    Nothing is read beyond the header until bytes are asked for. Bytes are read with
    ``preadv``, so a file cut short meanwhile is a :class:`FormatError` naming the file
    and the tensor; only :meth:`mapped` (``mmap=True``) hands out the file's mapping,
    whose pages then die with ``SIGBUS`` if the file is truncated while they live.

    Example:
        >>> with SafetensorsFile("model.safetensors") as ckpt:
        ...     ckpt.entry("lm_head.weight").kind
        'alias'
    """

    def __init__(self, path: PathLike) -> None:
        where = os.fspath(path)
        with open(where, "rb") as f:
            self.header: Header = read_header(f, where)
            manifest = read_manifest(
                self.header.metadata, self.header.tensors, where, sealed=self.header.sealed
            )
            # MAP_PRIVATE: tensors built on this map may be written without touching the file.
            self._map = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                if self.header.file_size > self.header.data_start
                else None
            )
            # Reads, checksums included, go through this descriptor of the very file whose
            # header was validated, never through the map (see :meth:`check`).
            # A FileIO owns it, so a checkpoint dropped without close() does not leak it.
            self._file: io.FileIO | None = io.FileIO(os.dup(f.fileno()), "rb")
            self._fd = self._file.fileno()
        super().__init__(where, self.header.tensors, manifest)

    @property
    def size(self) -> int:
        return self.header.file_size

    @property
    def framework(self) -> str | None:
        return self.header.metadata.get("format")

    @property
    def container(self) -> str:
        return "safetensors"

    def raw(self, stored: str) -> memoryview:
        # A buffer of its own, read with preadv (see the class): never the mapping.
        info = self.stored[stored]
        if info.nbytes == 0:
            return memoryview(b"")
        buffer = new_buffer(info.nbytes)
        self.read_into(stored, buffer)
        return buffer

    def mapped(self, stored: str) -> memoryview:
        info = self.stored[stored]
        if self._map is None or info.nbytes == 0:
            return memoryview(b"")
        start = self.header.data_start + info.start
        return memoryview(self._map)[start : start + info.nbytes]

    def stage(self, stored: list[str], verify: bool) -> None:
        # Every byte reachable: the file still holds what its header describes (raw()
        # would read every tensor whole).
        if verify:
            self.verify(stored)
        if self._fd < 0:
            raise FormatError(f"{self.path}: the file is closed")
        size = os.fstat(self._fd).st_size
        short = [n for n in stored if self.header.data_start + self.stored[n].end > size]
        if short:
            raise FormatError(
                f"{self.path}: tensor {short[0]!r}: the file was cut to {size} bytes "
                f"after it was opened ({self.header.file_size} expected; "
                f"{capped(short)} lie past its end); save or copy it again"
            )

    def read_into(self, stored: str, buffer: memoryview) -> bool:
        info = self.stored[stored]
        if buffer.nbytes != info.nbytes:
            return False
        if self._fd < 0:
            raise FormatError(f"{self.path}: tensor {stored!r}: the file is closed")
        read_fully(self._fd, buffer, self.header.data_start + info.start, self.path, stored)
        return True

    def check(self, stored: str) -> bool:
        expected = self.manifest.sums.get(stored)
        if expected is None:
            return True
        # Hashed from preadv'd chunks, not from the map: a file that shrinks meanwhile is
        # then a FormatError instead of a SIGBUS that kills the process.
        info = self.stored[stored]
        h = xxhash.xxh3_64()
        chunk = memoryview(bytearray(min(info.nbytes, HASH_WINDOW)))
        done, start = 0, self.header.data_start + info.start
        while done < info.nbytes:
            part = chunk[: min(HASH_WINDOW, info.nbytes - done)]
            read_fully(self._fd, part, start + done, self.path, stored)
            h.update(part)
            done += part.nbytes
        return h.hexdigest() == expected

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file, self._fd = None, -1
        # Tensors built on the map keep their own export; closing then is refused, and the
        # map is released when the last of them goes.
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()


class MemoryCheckpoint(Checkpoint):
    """A checkpoint over buffers already in memory, such as arrays decoded from MXNet.

    Args:
        path: Where the data came from, for messages.
        arrays: ``{name: (dtype, shape, bytes)}`` in the source's order.
        manifest: Aliases, copies and so on; by default every name is stored.
    """

    def __init__(
        self,
        path: str,
        arrays: Mapping[str, tuple[str, tuple[int, ...], memoryview | bytes]],
        manifest: Manifest | None = None,
    ) -> None:
        self._data: dict[str, memoryview] = {}
        stored: dict[str, TensorInfo] = {}
        m = manifest or Manifest(names=list(arrays), ours=False)
        position = 0
        for name, (dtype, shape, data) in arrays.items():
            view = memoryview(data).cast("B")
            if view.nbytes != numel(shape) * ITEMSIZE[dtype]:
                raise FormatError(
                    f"{path}: tensor {name!r}: {dtype}{list(shape)} needs "
                    f"{numel(shape) * ITEMSIZE[dtype]} bytes, got {view.nbytes}"
                )
            if name in m.aliases or name in m.copies or name in m.views:
                continue
            self._data[name] = view
            stored[name] = TensorInfo(name, dtype, tuple(shape), position, position + view.nbytes)
            position += view.nbytes
        super().__init__(path, stored, m)

    def raw(self, stored: str) -> memoryview:
        return self._data[stored]


def checksum_error(path: str, bad: list[str]) -> ChecksumError:
    """The error for the stored tensors ``bad`` of checkpoint ``path``, whose checksums fail."""
    return ChecksumError(
        f"{path}: checksum mismatch in {len(bad)} tensor(s): {capped(bad)}. "
        "The data was damaged after it was saved; restore it from a good copy.",
        bad,
    )


#: Bytes read and checksummed at a time, so verifying needs no tensor-sized buffer. Small
#: enough that each reading thread's window stays in its core's cache between the read and
#: the hash: with 4 MiB windows, two threads overflowed an 8 MiB L3 and the hash read the
#: bytes from memory again (a verified vault load of GPT-2's 497 MB: 225 ms with 4 MiB
#: windows, 185 ms with 1 MiB; docs/benchmarks-log.md section 28).
HASH_WINDOW = 1 << 20
#: An eager reader may allocate this many bytes for any file, however small.
MATERIALIZE_FLOOR = 256 << 20
#: ... and this many times the file's size, for larger files.
MATERIALIZE_RATIO = 16


def materialize_limit(file_size: int) -> int:
    """Bytes an eager read of a ``file_size``-byte file may allocate by default.

    The larger of :data:`MATERIALIZE_FLOOR` (256 MiB) and :data:`MATERIALIZE_RATIO` (16)
    times the file's size. A checkpoint that really holds more (a model of many equal
    copies of one big tensor) is read by passing ``max_bytes``, or, for the whole process,
    with the environment variable ``WEIGHTVAULT_MAX_DECODED_BYTES`` that also limits the
    foreign-format readers (:mod:`weightvault._base.limits`): one knob for every cap.
    """
    if os.environ.get(ENV_VAR, "").strip():
        return resolve_limit(file_size)[0]
    return max(MATERIALIZE_FLOOR, MATERIALIZE_RATIO * file_size)


def new_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of new memory of this process' own for a read to fill.

    Never zeroed first (a pass of its own over half a gigabyte). From
    :data:`HUGE_BUFFER` bytes on, an anonymous mapping advised to transparent huge pages:
    a ``preadv`` into fresh 4 KiB pages faults each one in, which made reading a 200 MiB
    object into memory 2.7x slower than into huge pages (docs/benchmarks-log.md, section 31).
    Anonymous, so no truncation of any file can take its pages away; unmapped when the
    last view of it goes.
    """
    if nbytes >= HUGE_BUFFER:
        length = -(-nbytes // HUGE_BUFFER) * HUGE_BUFFER
        private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
        area = mmap.mmap(-1, length, flags=private) if private else mmap.mmap(-1, length)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            with contextlib.suppress(OSError):  # no transparent huge pages: 4 KiB ones
                area.madvise(advice)
        return memoryview(area)[:nbytes]
    import numpy as np  # not at import: `import weightvault` stays numpy-free

    return memoryview(np.empty(nbytes, np.uint8)).cast("B")  # type: ignore[arg-type]


#: Buffers at least this large are whole huge pages (see :func:`new_buffer`).
HUGE_BUFFER = 2 << 20


def read_fully(fd: int, buffer: memoryview, offset: int, where: str, name: str) -> None:
    """``preadv`` until ``buffer`` is full; a short file is a :class:`FormatError`."""
    view = buffer.cast("B")
    while view.nbytes:
        # One call moves at most ~2 GiB on Linux, so large tensors take several.
        n = os.preadv(fd, [view[: 1 << 30]], offset)
        if n == 0:
            raise FormatError(f"{where}: tensor {name!r}: the file ended before its bytes did")
        view, offset = view[n:], offset + n


#: What a load reads from: a path, or a checkpoint already open.
CheckpointSource = PathLike | Checkpoint
