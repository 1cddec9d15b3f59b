"""Open a checkpoint for reading: validated header, manifest, and mmap-backed bytes."""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from typing import Literal

import xxhash

from ._dtypes import ITEMSIZE
from ._errors import ChecksumError, FormatError
from ._header import Header, TensorInfo, read_header
from ._manifest import INTERNAL_PREFIX, Manifest, View, read_manifest

Kind = Literal["stored", "alias", "copy", "view"]


@dataclass(frozen=True)
class Entry:
    """One name in a file, whatever way it is held."""

    name: str
    kind: Kind
    stored: str  # the stored tensor whose bytes this name reads
    dtype: str
    shape: tuple[int, ...]
    view: View | None = None

    @property
    def group(self) -> str:
        """Names with the same group are one tensor (tied); copies and views are their own."""
        return self.stored if self.kind in ("stored", "alias") else self.name

    @property
    def value_key(self) -> str | None:
        """Names with the same value key hold equal bytes; ``None`` means compare the bytes."""
        return self.stored if self.kind != "view" else None

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


class Checkpoint:
    """A validated, memory-mapped checkpoint file.

    Nothing is read beyond the header until bytes are asked for, and bytes come straight
    from the page cache through ``mmap``.

    Example:
        >>> with Checkpoint("model.safetensors") as ckpt:
        ...     ckpt.entry("lm_head.weight").kind
        'alias'
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            self.header: Header = read_header(f, self.path)
            self.manifest: Manifest = read_manifest(
                self.header.metadata, self.header.tensors, self.path
            )
            # MAP_PRIVATE: tensors built on this map may be written without touching the file.
            self._map = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                if self.header.file_size > self.header.data_start
                else None
            )
        self.entries = self._entries()

    def _entries(self) -> dict[str, Entry]:
        t, m = self.header.tensors, self.manifest
        out: dict[str, Entry] = {}
        for name in m.names:
            if name in t:
                out[name] = Entry(name, "stored", name, t[name].dtype, t[name].shape)
            elif name in m.aliases:
                s = t[m.aliases[name]]
                out[name] = Entry(name, "alias", s.name, s.dtype, s.shape)
            elif name in m.copies:
                s = t[m.copies[name]]
                out[name] = Entry(name, "copy", s.name, s.dtype, s.shape)
            else:
                v = m.views[name]
                out[name] = Entry(name, "view", v.base, v.dtype, v.shape, v)
        return out

    @property
    def names(self) -> list[str]:
        """Every name a model may ask for, in the order the model had them."""
        return list(self.entries)

    @property
    def stored(self) -> dict[str, TensorInfo]:
        return self.header.tensors

    def is_internal(self, name: str) -> bool:
        return name.startswith(INTERNAL_PREFIX)

    def entry(self, name: str) -> Entry:
        return self.entries[name]

    def raw(self, stored: str) -> memoryview:
        """The bytes of a stored tensor, as a view into the file mapping."""
        info = self.header.tensors[stored]
        if self._map is None or info.nbytes == 0:
            return memoryview(b"")
        start = self.header.data_start + info.start
        return memoryview(self._map)[start : start + info.nbytes]

    def check(self, stored: str) -> bool:
        """Whether ``stored``'s bytes match their checksum (``True`` if none was recorded)."""
        expected = self.manifest.sums.get(stored)
        if expected is None:
            return True
        return xxhash.xxh3_64(self.raw(stored)).hexdigest() == expected

    def verify(self, stored: list[str] | None = None) -> None:
        """Check the checksums of ``stored`` (default: all), before any byte is used.

        Raises:
            ChecksumError: Naming every tensor whose bytes changed since it was saved.
        """
        names = list(self.header.tensors) if stored is None else stored
        bad = [n for n in names if not self.check(n)]
        if bad:
            from ._errors import capped

            raise ChecksumError(
                f"{self.path}: checksum mismatch in {len(bad)} tensor(s): {capped(bad)}. "
                "The file was damaged after it was saved; restore it from a good copy.",
                bad,
            )

    def close(self) -> None:
        # Tensors built on the map keep their own export; closing then is refused, and the
        # map is released when the last of them goes.
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open ``path``, raising :class:`FormatError` for anything that is not a checkpoint."""
    try:
        return Checkpoint(path)
    except FormatError:
        raise
    except IsADirectoryError as e:
        raise FormatError(f"{os.fspath(path)}: is a directory, not a checkpoint file") from e
