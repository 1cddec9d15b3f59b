"""Pack files: a save's new objects in one file instead of one file each.

Creating a file costs a few hundred microseconds on a local disk (and a request on an
object store) however small it is, so a save of many small tensors spent most of its time
creating files (docs/benchmarks-log.md, section 14). A save that writes two or more objects
now writes them into one pack, ``packs/<id>.pack``::

    b"WVPACK01"                                  8 bytes
    each object's raw bytes, at offsets that are multiples of 64
    the index: UTF-8 JSON {"objects": {digest: [offset, size]}, "version": 2, "sum": ...}
    the index's length, u64 little-endian; b"WVPACKIX"    16 bytes

The index ends with its checksum (``"sum"``, see :mod:`.seal`): a damaged index is
refused whole, by name, instead of pointing a read at other bytes. Version 1 indexes,
written before, have none and are read as before.

A pack is written whole, made durable, then renamed into place, and never changed after;
its index is at its end so that a writer needs to know nothing before the bytes. An object
in a pack is its raw bytes, exactly as a loose raw object under ``objects/`` would be:
its name is still the blake3 of those bytes, and a load checks them as it checks any.

**Loose objects win**, except for reads of the bytes, which either copy serves: what an
object's frame says (its delta base, which gc keeps) is always the loose file's, and a
pack is only ever a second copy once the compactor has written an object loose (as a
compressed object or a delta). Once every object of a pack is loose the pack is deleted;
a reader that found an object in it meanwhile and then cannot open it looks again, and
finds the loose copy. The compactor leaves the newest checkpoint's new objects in their
pack (a resume reads them there, raw), and takes the rest out as it compacts (in a
vault without compression, every pack, as soon as its save has committed); gc frees a
pack that holds nothing live (through its trash, as it frees objects, see :mod:`.gc`).

A process keeps every pack's index it has read (packs never change) in :class:`PackTable`,
one per store, and lists ``packs/`` again only when an object is in none of them.

Example:
    >>> offsets, index_at = layout([10, 100])
    >>> offsets, index_at
    ([64, 128], 256)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._base.atomic import WRITEBACK_BYTES, open_temp, start_writeback
from ..._base.errors import ChecksumError, FormatError, capped
from .backend import Store
from .seal import seal_json, unseal

__all__ = [
    "ALIGN",
    "INDEX_VERSION",
    "PACKS",
    "PACK_BYTES",
    "PACK_OBJECT",
    "PackTable",
    "PackWriter",
    "Packed",
    "check_pack",
    "encode_index",
    "find",
    "forget",
    "is_pack",
    "layout",
    "missing",
    "new_pack_name",
    "pack_groups",
    "pack_key",
    "pack_parts",
    "pack_table",
    "parse_index",
    "read_index",
]

MAGIC = b"WVPACK01"
FOOTER = b"WVPACKIX"
#: Objects start at multiples of this (a tensor read straight from a mapping is aligned).
ALIGN = 64
#: Objects smaller than this go into a save's pack; larger ones are written as files of
#: their own, where creating the file costs little beside writing the bytes.
PACK_OBJECT = 4 << 20
#: The most object bytes one pack holds (an object store's upload is one buffer).
PACK_BYTES = 256 << 20
#: The largest index a reader accepts (about 700,000 objects).
MAX_INDEX = 64 << 20
#: Where packs live.
PACKS = "packs"
_TAIL = 16
#: The index version written: 2 is sealed by its checksum (:mod:`.seal`); 1, written
#: before indexes were sealed, is still read.
INDEX_VERSION = 2
_INDEX_READS = (1, 2)
_FIX = (
    "its objects count as missing; restore the pack from a mirror, or delete the "
    "checkpoints that need them"
)
_NAME = re.compile(r"[0-9a-f]{32}\.pack")
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Packed:
    """Where an object lies in a pack: the pack's file name, its offset and size."""

    pack: str
    offset: int
    size: int


def new_pack_name() -> str:
    return f"{uuid.uuid4().hex}.pack"


def is_pack(leaf: str) -> bool:
    """Whether a file name is a pack's (not a temporary file, not anything else)."""
    return _NAME.fullmatch(leaf) is not None


def pack_key(name: str) -> str:
    return f"{PACKS}/{name}"


def _up(n: int) -> int:
    return n + (-n % ALIGN)


def layout(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Each object's offset in a pack, and where the index starts."""
    offsets, at = [], ALIGN  # the magic, padded to the first aligned offset
    for size in sizes:
        offsets.append(at)
        at = _up(at + size)
    return offsets, at


def header() -> bytes:
    """The pack's first bytes, up to the first object's offset."""
    return MAGIC + bytes(ALIGN - len(MAGIC))


def pack_groups(objects: Sequence[tuple[str, int]]) -> list[list[str]]:
    """``[(digest, size)]`` split into packs of at most :data:`PACK_BYTES` each."""
    groups: list[list[str]] = [[]]
    total = 0
    for digest, size in objects:
        if groups[-1] and total + size > PACK_BYTES:
            groups.append([])
            total = 0
        groups[-1].append(digest)
        total += _up(size)
    return [g for g in groups if g]


def pack_parts(objects: Sequence[tuple[str, bytes | memoryview]]) -> tuple[str, list[Any]]:
    """A new pack holding ``[(digest, raw bytes)]``: its key and its file as parts."""
    views = [memoryview(data).cast("B") for _, data in objects]
    offsets, _ = layout(v.nbytes for v in views)
    parts: list[Any] = [header()]
    entries: dict[str, tuple[int, int]] = {}
    at = ALIGN
    for (digest, _), view, offset in zip(objects, views, offsets, strict=True):
        if offset > at:
            parts.append(bytes(offset - at))
        parts.append(view)
        entries.setdefault(digest, (offset, view.nbytes))
        at = offset + view.nbytes
    end = _up(at)
    if end > at:
        parts.append(bytes(end - at))
    parts.append(encode_index(entries))
    return pack_key(new_pack_name()), parts


def encode_index(entries: Mapping[str, tuple[int, int]]) -> bytes:
    """The index and the tail that follow the objects (``{digest: (offset, size)}``),
    sealed by its checksum (:mod:`.seal`)."""
    doc = {"version": INDEX_VERSION, "objects": {d: [o, s] for d, (o, s) in entries.items()}}
    body = seal_json(doc, sort_keys=True)
    return body + struct.pack("<Q", len(body)) + FOOTER


def parse_index(tail: bytes, body: bytes, file_size: int, where: str) -> dict[str, Packed]:
    """A pack's index from its last 16 bytes and the index bytes before them.

    Every entry is checked against the file: a hostile index cannot point a read outside
    the pack's object bytes.

    Raises:
        FormatError: The index is damaged or points outside the pack.
        ChecksumError: A sealed index does not match its checksum.
    """
    return _parse_index(tail, body, file_size, where)[0]


def _parse_index(
    tail: bytes, body: bytes, file_size: int, where: str
) -> tuple[dict[str, Packed], bool]:
    """:func:`parse_index`, and whether the index carries a checksum."""
    leaf = where.rsplit("/", 1)[-1]
    length = index_length(tail, file_size, where)
    if len(body) != length:
        raise FormatError(f"{where}: the pack's index was cut short")
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise FormatError(f"{where}: the pack's index is not JSON; the pack is damaged") from None
    objects = doc.get("objects") if isinstance(doc, dict) else None
    version = doc.get("version") if isinstance(doc, dict) else None
    if type(version) is not int or version not in _INDEX_READS or not isinstance(objects, dict):
        raise FormatError(f"{where}: the pack's index is not a version 1 or 2 index")
    # Version 2 indexes are sealed; a version 1 index (written before) has no sum.
    sealed = unseal(body, doc, where, "pack index", sealed=version == 2, fix=_FIX)
    end = file_size - _TAIL - length
    out = {}
    for digest, entry in objects.items():
        ok = (
            isinstance(digest, str)
            and _DIGEST.fullmatch(digest) is not None
            and isinstance(entry, list)
            and len(entry) == 2
            and all(type(v) is int for v in entry)
            and ALIGN <= entry[0] <= entry[0] + entry[1] <= end
            and entry[1] >= 0
        )
        if not ok:
            shown = f"{str(digest)[:64]!r}: {str(entry)[:60]}"
            raise FormatError(f"{where}: the pack's index entry {shown} is not an object in it")
        out[digest] = Packed(leaf, entry[0], entry[1])
    return out, sealed


def index_length(tail: bytes, file_size: int, where: str) -> int:
    """The index's length, from the pack's last 16 bytes.

    Raises:
        FormatError: They are not a pack's tail, or the length does not fit the file.
    """
    if len(tail) != _TAIL or tail[8:] != FOOTER:
        raise FormatError(f"{where}: not a weightvault pack (no index at its end)")
    (length,) = struct.unpack("<Q", tail[:8])
    if length > MAX_INDEX or length + _TAIL + ALIGN > file_size:
        raise FormatError(f"{where}: the pack's index claims {length} bytes, more than it holds")
    return int(length)


def read_index(store: Store, key: str) -> dict[str, Packed]:
    """The index of the pack at ``key``: two ranged reads.

    Raises:
        FileNotFoundError: The pack is gone.
        FormatError: It is damaged (a :class:`ChecksumError` when its checksum fails).
    """
    return check_pack(store, key)[0]


def check_pack(store: Store, key: str) -> tuple[dict[str, Packed], bool]:
    """:func:`read_index`, and whether the index carries a checksum (one written before
    indexes were sealed does not)."""
    size = store.size(key)
    if size is None:
        raise FileNotFoundError(key)
    where = f"{store.url}/{key}"
    if size < ALIGN + _TAIL:
        raise FormatError(f"{where}: a pack of {size} bytes is too short to hold an index")
    tail = store.get_range(key, size - _TAIL, size)
    length = index_length(tail, size, where)
    body = store.get_range(key, size - _TAIL - length, size - _TAIL)
    return _parse_index(tail, body, size, where)


class PackTable:
    """The indexes of one store's packs that this process has read (packs never change).

    :meth:`find` answers from memory; on a miss it lists ``packs/`` again and reads the
    indexes of packs it has not seen. A damaged pack is remembered as such: its objects
    are then absent, and loads name the tensors they held.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._where: dict[str, Packed] = {}
        self._packs: dict[str, dict[str, Packed]] = {}  # pack name -> its index
        self.damaged: dict[str, str] = {}  # pack name -> why
        self._unsealed: set[str] = set()  # those of them whose index failed its checksum

    def refresh(self, store: Store) -> None:
        """List ``packs/`` (and gcs' trash), read the indexes not read yet, and forget the
        packs gone from both."""
        listed: dict[str, str] = {}
        # A pack in a gc's trash (a gc running, or one that died) is read there.
        for prefix in ("trash", PACKS):
            for b in store.list(prefix):
                leaf = b.key.rsplit("/", 1)[-1]
                if is_pack(leaf):
                    listed[leaf] = b.key
        with self._lock:
            known = set(self._packs) | set(self.damaged)
        for name in sorted(set(listed) - known):
            try:
                index = read_index(store, listed[name])
            except FileNotFoundError:
                continue
            except FormatError as e:
                with self._lock:
                    self.damaged[name] = str(e)
                    if isinstance(e, ChecksumError):
                        self._unsealed.add(name)
                continue
            with self._lock:
                self._packs[name] = index
                for digest, where in index.items():
                    self._where.setdefault(digest, where)
        with self._lock:
            for name in (set(self._packs) | set(self.damaged)) - set(listed):
                self._drop(name)

    def _drop(self, name: str) -> None:
        self.damaged.pop(name, None)
        self._unsealed.discard(name)
        for digest in self._packs.pop(name, {}):
            where = self._where.get(digest)
            if where is None or where.pack != name:
                continue
            del self._where[digest]
            # Another pack may hold the same object (two saves raced to write it).
            for index in self._packs.values():
                if digest in index:
                    self._where[digest] = index[digest]
                    break

    def find(self, store: Store, digest: str, *, refresh: bool = True) -> Packed | None:
        """Where object ``digest`` lies in a pack, or ``None``; ``refresh=False`` answers
        from what was read before (a caller that refreshed once for many lookups)."""
        with self._lock:
            found = self._where.get(digest)
        if found is not None or not refresh:
            return found
        self.refresh(store)
        with self._lock:
            return self._where.get(digest)

    def packs(self) -> dict[str, dict[str, Packed]]:
        """``{pack name: its index}`` of every pack known."""
        with self._lock:
            return {k: dict(v) for k, v in self._packs.items()}

    def forget(self, name: str) -> None:
        """Drop a pack that turned out to be gone."""
        with self._lock:
            self._drop(name)

    def refused(self) -> tuple[dict[str, str], bool]:
        """``{pack name: why}`` of the packs refused as damaged, and whether one of them
        failed its checksum."""
        with self._lock:
            return dict(self.damaged), bool(self._unsealed)


_tables: dict[str, PackTable] = {}
_tables_lock = threading.Lock()


def pack_table(store: Store) -> PackTable:
    """This process's :class:`PackTable` of ``store`` (one per vault location)."""
    with _tables_lock:
        table = _tables.get(store.url)
        if table is None:
            table = _tables[store.url] = PackTable()
        return table


def find(store: Store, digest: str, *, refresh: bool = True) -> Packed | None:
    """Where object ``digest`` lies in one of ``store``'s packs, or ``None``."""
    return pack_table(store).find(store, digest, refresh=refresh)


def forget(store: Store, name: str) -> None:
    """Forget pack ``name`` of ``store`` (it was found gone)."""
    pack_table(store).forget(name)


def missing(store: Store, where: str, stored: str, what: str) -> FormatError:
    """The error for tensor ``stored`` of checkpoint ``where`` whose object is nowhere
    (``what`` says which). A pack whose index was refused may hold the object, so the
    error names it, as a :class:`ChecksumError` when that index failed its checksum.

    Example:
        >>> raise missing(store, "runs/a/checkpoints/000001.json", "w", "its object is missing")
        ChecksumError: ...: tensor 'w': its object is missing, and may be in pack ...
    """
    refused, unsealed = pack_table(store).refused()
    if not refused:
        return FormatError(
            f"{where}: tensor {stored!r}: {what}; the vault is damaged, run "
            "'weightvault vault ROOT verify'"
        )
    names = sorted(refused)
    message = (
        f"{where}: tensor {stored!r}: {what}, and may be in a pack whose index is damaged: "
        f"{capped(names)} ({refused[names[0]]})"
    )
    return ChecksumError(message, [stored]) if unsealed else FormatError(message)


class PackWriter:
    """A pack written while a save hashes: each object it is handed goes to its own
    offset in a temporary file at once, on the hashing thread, while its bytes are still
    in the CPU's caches; :meth:`finish` appends the index.

    Local stores only (it writes by offset). The temporary file becomes the pack only
    when the save publishes it, after its intent is visible, as any staged file does; an
    object handed here that the vault turns out to hold already is a harmless second copy.

    Example:
        >>> writer = PackWriter(store)
        >>> writer.add(digest, data)          # from any thread
        >>> staged[writer.key] = writer.finish()
    """

    def __init__(self, store: Store) -> None:
        self.key = pack_key(new_pack_name())
        path = store.local_path(self.key)
        assert path is not None, "PackWriter writes local packs only"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._fd, self.token = open_temp(path)
        self._lock = threading.Lock()
        self._at = ALIGN
        self._flushed = 0
        self.entries: dict[str, tuple[int, int]] = {}
        os.pwrite(self._fd, header(), 0)

    def add(self, digest: str, data: bytes | memoryview) -> bool:
        """Write object ``digest`` into the pack; False if it would pass
        :data:`PACK_BYTES` (the caller then writes it the usual way)."""
        view = memoryview(data).cast("B")
        with self._lock:
            if digest in self.entries:
                return True
            if self._at + view.nbytes > PACK_BYTES + ALIGN:
                return False
            offset = self._at
            self._at = _up(offset + view.nbytes)
            self.entries[digest] = (offset, view.nbytes)
        done = 0
        while done < view.nbytes:
            done += os.pwrite(self._fd, view[done:], offset + done)
        with self._lock:
            end = self._at
            flush = end - self._flushed >= WRITEBACK_BYTES
            start, self._flushed = self._flushed, end if flush else self._flushed
        if flush:
            start_writeback(self._fd, start, end - start)  # the disk starts meanwhile
        return True

    def finish(self) -> str:
        """Append the index and close the file; the temporary file's name (the token
        :meth:`Store.publish` takes)."""
        tail = encode_index(self.entries)
        at = self._at
        done = 0
        while done < len(tail):
            done += os.pwrite(self._fd, tail[done:], at + done)
        os.close(self._fd)
        self._fd = -1
        return self.token

    def discard(self) -> None:
        """Drop the temporary file (a failed save, or nothing in it was needed)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.token)
