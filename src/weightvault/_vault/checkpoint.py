"""A committed vault checkpoint, read through the same interface as a single file.

:class:`VaultCheckpoint` maps each stored tensor to its object; :func:`open_record` picks
it or, for records ``weightvault.dcp`` committed, :class:`~.dcp_record.DcpCheckpoint`.
Either reads its objects through :mod:`.objects`, so a checkpoint loads while a gc holds
some of its objects in its trash.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._base.errors import FormatError
from .._file.checkpoint import read_fully
from .dcp_record import KIND, DcpCheckpoint
from .objects import (
    DIGEST,
    ObjectCheckpoint,
    checksum,
    content_hash,
    damaged,
    object_key,
    prefetch,
    read_object,
)
from .records import parse_header_text, parse_record, record_key
from .store import Store

__all__ = ["VaultCheckpoint", "open_record"]


class VaultCheckpoint(ObjectCheckpoint):
    """One vault checkpoint, read through the same interface as a single file.

    ``objects`` maps each stored tensor to its object.
    """

    def __init__(self, store: Store, name: str, doc: Mapping[str, Any]) -> None:
        where = f"{store.url}/{record_key(name)}"
        self.record = parse_record(name, doc, where)
        objects = doc.get("objects")
        if not isinstance(objects, dict) or not isinstance(doc.get("header"), str):
            raise FormatError(f"{where}: checkpoint record lacks its header or objects")
        header, manifest = parse_header_text(doc.get("header"), where)
        if set(objects) != set(header.tensors) or not all(
            isinstance(h, str) and DIGEST.fullmatch(h) for h in objects.values()
        ):
            raise FormatError(f"{where}: objects do not match the stored tensors")
        self._cache: dict[str, memoryview] = {}
        self._files: dict[str, bytes] = {}
        super().__init__(
            store, where, header.tensors, manifest,
            framework=header.metadata.get("format"),
            objects=dict(objects),
            sizes={n: info.nbytes for n, info in header.tensors.items()},
        )  # fmt: skip

    def fetch(self) -> None:
        """Bring every object into memory now, concurrently (used for remote stores)."""
        self._files.update(prefetch(self.store, list(self.objects.values())))

    def raw(self, stored: str) -> memoryview:
        if stored not in self._cache:
            expected = self.stored[stored].nbytes
            try:
                view = read_object(self.store, self.objects[stored], expected, files=self._files)
            except FileNotFoundError:
                raise damaged(self.path, stored, "its object is missing") from None
            except FormatError as e:
                raise damaged(self.path, stored, str(e)) from None
            self._cache[stored] = view
        view = self._cache[stored]
        expected = self.stored[stored].nbytes
        if view.nbytes != expected:
            raise damaged(
                self.path, stored, f"object holds {view.nbytes} bytes, expected {expected}"
            )
        return view

    def read_into(self, stored: str, buffer: memoryview) -> bool:
        path = self.store.local_path(object_key(self.objects[stored]))
        if path is None or buffer.nbytes != self.stored[stored].nbytes:
            return False
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # raw() then looks in a gc's trash, or names the tensor
        try:
            if os.fstat(fd).st_size != buffer.nbytes:
                return False
            read_fully(fd, buffer, 0, self.path, stored)
        finally:
            os.close(fd)
        return True

    def check(self, stored: str) -> bool:
        # Loads check the xxh3 sum recorded at save time (about 30 GB/s); vault.verify()
        # re-derives the blake3 object name, which is the authority but ~5x slower.
        expected = self.manifest.sums.get(stored)
        if expected is not None:
            return checksum(self.raw(stored)) == expected
        return content_hash(self.raw(stored)) == self.objects[stored]


def open_record(store: Store, name: str, doc: Mapping[str, Any]) -> VaultCheckpoint | DcpCheckpoint:
    """The checkpoint record ``doc`` describes, of whichever kind it is."""
    # weightvault.dcp commits records of kind "dcp": tensors kept as shard chunks.
    if doc.get("kind") == KIND:
        return DcpCheckpoint(store, name, doc)
    return VaultCheckpoint(store, name, doc)
