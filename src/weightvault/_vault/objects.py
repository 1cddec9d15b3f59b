"""Object addressing: where a tensor's bytes live in a vault, and how they are found.

Every object is one tensor (or one DCP chunk) of raw bytes, named by the blake3 hex
digest of those bytes and kept at ``objects/<digest[:2]>/<digest>``. While a gc runs it
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
from collections.abc import Iterator

import blake3
import xxhash

from .._base.errors import FormatError
from .._file.checkpoint import Checkpoint
from .._file.header import TensorInfo
from .._file.manifest import Manifest
from .store import Store

__all__ = [
    "DIGEST",
    "ObjectCheckpoint",
    "checksum",
    "content_hash",
    "damaged",
    "in_trash",
    "is_temp",
    "locations",
    "object_key",
    "object_size",
    "read_object",
    "read_range",
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


def read_object(store: Store, digest: str) -> memoryview:
    """The bytes of object ``digest``, wherever a gc may hold it.

    Raises:
        FileNotFoundError: The object is nowhere; callers name the tensor it held.
    """
    for key in locations(store, digest):
        try:
            return store.view(key)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(object_key(digest))


def read_range(store: Store, digest: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of object ``digest``, wherever a gc may hold it.

    Raises:
        FileNotFoundError: The object is nowhere.
    """
    for key in locations(store, digest):
        try:
            return store.get_range(key, start, end)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(object_key(digest))


def object_size(store: Store, digest: str) -> int | None:
    """The size of object ``digest`` wherever a gc may hold it, or ``None`` if it is gone."""
    for key in locations(store, digest):
        size = store.size(key)
        if size is not None:
            return size
    return None


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
            size = object_size(self.store, digest)
            if size is None:
                out[label] = "object missing"
            elif size != self._sizes[label]:
                out[label] = f"object holds {size} bytes, expected {self._sizes[label]}"
        return out

    def fetch(self) -> None:
        """Bring the objects into memory now, concurrently (used for remote stores)."""
        raise NotImplementedError
