"""Where a vault keeps its bytes: a local folder, or any fsspec filesystem.

A store offers the few operations the vault's commit protocol needs: put a blob (durably,
and optionally only if absent), get it, list a prefix with sizes and times, delete. The
local store gets durability from fsync and exclusivity from ``link``; an object store gets
both from the service (S3's conditional ``If-None-Match`` through fsspec's ``mode="create"``).
"""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._base.atomic import atomic_file, batch_sync_ok, fsync_dir, sync_paths, write_all, write_temp
from ..._base.errors import BackendNotInstalled, FormatError

#: A blob's bytes: one buffer, or parts written one after another.
Payload = bytes | memoryview | Sequence[bytes | memoryview]


@dataclass(frozen=True)
class Blob:
    key: str
    size: int
    mtime: float


class Store:
    """The interface; keys are ``/``-separated paths relative to the vault root."""

    url: str
    local: bool = False

    def put(
        self, key: str, data: bytes | memoryview, *, exclusive: bool = False, durable: bool = True
    ) -> bool:
        """Write ``data`` at ``key`` durably; with ``exclusive``, return False if it exists.

        ``durable=False`` is for files that other processes only need to see, whole (a
        save's intent, the compactor's to-do marker): a local store then skips the
        fsync, so a power loss may take them. Object stores are durable anyway.
        """
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        return {k: self.get(k) for k in keys}

    def view(self, key: str) -> memoryview:
        """The bytes at ``key``, mapped where the store allows it (always writable)."""
        return memoryview(bytearray(self.get(key)))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` at ``key``, reading only those where the store can."""
        return self.get(key)[start:end]

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def size(self, key: str) -> int | None:
        raise NotImplementedError

    def list(self, prefix: str) -> list[Blob]:
        raise NotImplementedError

    def children(self, prefix: str) -> builtins.list[str]:
        """The keys :meth:`list` gives directly under ``prefix`` (not in a folder of it),
        sorted: what ``"latest"`` and every save list, where sizes and times go unread."""
        depth = prefix.strip("/").count("/") + 1
        return [b.key for b in self.list(prefix) if b.key.count("/") == depth]

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def rename(self, src: str, dst: str) -> bool:
        """Move ``src`` to ``dst``, replacing it; False if ``src`` is gone.

        Only content-addressed keys are moved (gc's trash), to a ``dst`` that is new.
        """
        raise NotImplementedError

    def put_back(self, src: str, dst: str) -> bool:
        """Move ``src`` to ``dst`` unless ``dst`` exists, then drop ``src``; False if
        ``src`` is gone.

        How gc puts an object back from its trash. A save may have written the object
        again meanwhile, in another form (compressed, or a delta on another base) that
        stands for the same raw bytes: that one stays, since what gc knows to keep alive
        is its delta chain, not the trashed one's.
        """
        if not self.exists(src):
            return False
        if not self.exists(dst) and self.put(dst, self.get(src), exclusive=True):
            self.delete(src)
            return True
        self.delete(src)
        return True

    def sync(self, keys: Iterable[str]) -> None:
        """Make the directory entries of ``keys`` durable (local stores only)."""

    def stage(self, key: str, data: Payload) -> str:
        """Begin writing ``data`` (bytes, or parts written one after another) at ``key``:
        :meth:`publish` makes every staged blob durable and visible at once. Returns a
        token for :meth:`publish`/:meth:`discard`.

        Object stores write the blob now (each PUT is durable and whole on its own).
        """
        self.put(key, data if isinstance(data, bytes | memoryview) else b"".join(data))
        return key

    def publish(self, staged: Mapping[str, str], nbytes: int = 0) -> None:
        """Make the staged ``{key: token}`` blobs (``nbytes`` in all) durable and visible
        under their keys."""

    def discard(self, staged: Mapping[str, str]) -> None:
        """Drop what :meth:`stage` wrote and was never published (a failed save)."""

    def local_path(self, key: str) -> str | None:
        """The file behind ``key`` on a local disk, or ``None`` for remote stores."""
        return None

    def root_is_file(self) -> bool:
        """Whether the root is a file (so it can never hold a vault)."""
        raise NotImplementedError


class LocalStore(Store):
    """A folder on a local filesystem."""

    local = True

    def __init__(self, root: str) -> None:
        # Nothing is created here: the folder appears with the first write (see put).
        self.root = os.path.abspath(root)
        self.url = self.root
        self._folders: set[str] = set()  # folders this store made or found, for stage()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def local_path(self, key: str) -> str | None:
        return self._path(key)

    def put(
        self, key: str, data: bytes | memoryview, *, exclusive: bool = False, durable: bool = True
    ) -> bool:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # The vault syncs the folders of a commit once (see sync), not per object.
        with atomic_file(path, exclusive=exclusive, sync_dir=False, durable=durable) as out:
            write_all(out.fd, data)
        return out.created

    def get(self, key: str) -> bytes:
        with open(self._path(key), "rb") as f:
            return f.read()

    def view(self, key: str) -> memoryview:
        with open(self._path(key), "rb") as f:
            # Read, never mapped: a file cut short meanwhile must not kill with SIGBUS.
            data = bytearray(os.fstat(f.fileno()).st_size)
            if f.readinto(data) != len(data):
                raise FormatError(f"{self._path(key)}: the file was cut short while read")
            return memoryview(data)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with open(self._path(key), "rb") as f:
            return os.pread(f.fileno(), end - start, start)

    def root_is_file(self) -> bool:
        return os.path.isfile(self.root)

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[Blob]:
        base = self._path(prefix)
        out: list[Blob] = []
        # Every path os.walk gives starts with the root and a separator: a slice, where
        # relpath took a third of listing a vault's 300 records.
        start = len(os.path.join(self.root, ""))
        for folder, _, files in os.walk(base):
            for f in files:
                path = os.path.join(folder, f)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                key = path[start:].replace(os.sep, "/")
                out.append(Blob(key, st.st_size, st.st_mtime))
        return sorted(out, key=lambda b: b.key)

    def children(self, prefix: str) -> builtins.list[str]:
        # One scandir without a stat per file: listing a vault's 300 records took 2.9 ms
        # through list() (a walk, and a stat each), every save and every resume.
        prefix = prefix.strip("/")
        out = []
        try:
            entries = list(os.scandir(self._path(prefix)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        for entry in entries:
            try:
                if entry.is_dir():
                    continue  # what list() walks into, not a child
                if entry.is_symlink() and not os.path.exists(entry.path):
                    continue  # list() cannot stat it either
            except OSError:
                continue
            out.append(f"{prefix}/{entry.name}")
        return sorted(out)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))

    def rename(self, src: str, dst: str) -> bool:
        target = self._path(dst)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.replace(self._path(src), target)
        except FileNotFoundError:
            return False
        return True

    def put_back(self, src: str, dst: str) -> bool:
        target = self._path(dst)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            os.link(self._path(src), target)  # never replaces: fails if dst exists
        except FileExistsError:
            pass
        except FileNotFoundError:
            return False
        self.delete(src)
        return True

    def sync(self, keys: Iterable[str]) -> None:
        for folder in {os.path.dirname(self._path(k)) for k in keys}:
            fsync_dir(folder)

    def stage(self, key: str, data: Payload) -> str:
        path = self._path(key)
        folder = os.path.dirname(path)
        if folder not in self._folders:
            # An mkdir that finds the folder there still costs a system call per object.
            os.makedirs(folder, exist_ok=True)
            self._folders.add(folder)
        try:
            return write_temp(path, data)
        except FileNotFoundError:
            # The folder went away (a vault removed and made again): make it once more.
            self._folders.discard(folder)
            os.makedirs(folder, exist_ok=True)
            return write_temp(path, data)

    def publish(self, staged: Mapping[str, str], nbytes: int = 0) -> None:
        # Data durable first, then the renames: a crash never leaves a final name whose
        # bytes were not on disk (some filesystems would show it empty or zero-filled).
        # A crash before the renames leaves temporary files, which gc removes.
        if not staged:
            return
        batch = batch_sync_ok(nbytes)  # decided once, for the data and the renames
        try:
            sync_paths(self.root, staged.values(), batch=batch)
            for key, tmp in staged.items():
                os.replace(tmp, self._path(key))
        except BaseException:
            self.discard(staged)
            raise
        folders = {os.path.dirname(self._path(k)) for k in staged}
        # One folder's fsync costs less than a syncfs.
        sync_paths(self.root, folders, batch=batch and len(folders) > 1)

    def discard(self, staged: Mapping[str, str]) -> None:
        for tmp in staged.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


class FsspecStore(Store):
    """Any fsspec filesystem, such as ``s3://bucket/prefix``."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        try:
            import fsspec
        except ImportError:
            raise BackendNotInstalled(
                f"{url}: remote vaults need fsspec: pip install 'weightvault[remote]'"
            ) from None
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = self.root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def put(
        self, key: str, data: bytes | memoryview, *, exclusive: bool = False, durable: bool = True
    ) -> bool:
        payload = bytes(data) if isinstance(data, memoryview) else data
        try:
            self.fs.pipe_file(self._path(key), payload, mode="create" if exclusive else "overwrite")
        except FileExistsError:
            return False
        return True

    def get(self, key: str) -> bytes:
        data: bytes = self.fs.cat_file(self._path(key))
        return data

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        # One call lets async filesystems such as s3fs fetch every object concurrently.
        paths = [self._path(k) for k in keys]
        got = self.fs.cat(paths, on_error="return")
        out: dict[str, bytes] = {}
        for k, p in zip(keys, paths, strict=True):
            value = got.get(p)
            if isinstance(value, BaseException):
                raise FileNotFoundError(p) from value
            out[k] = value
        return out

    def get_range(self, key: str, start: int, end: int) -> bytes:
        # A ranged GET: a rank resharding a DCP checkpoint reads only its boxes.
        return bytes(self.fs.cat_file(self._path(key), start=start, end=end))

    def root_is_file(self) -> bool:
        return bool(self.fs.isfile(self.root))

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._path(key)))

    def size(self, key: str) -> int | None:
        try:
            return int(self.fs.size(self._path(key)))
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> list[Blob]:
        base = self._path(prefix).rstrip("/")
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for path, info in found.items():
            modified = info.get("LastModified") or info.get("mtime") or info.get("created")
            mtime = modified.timestamp() if hasattr(modified, "timestamp") else float(modified or 0)
            out.append(Blob(path[len(self.root) + 1 :], int(info.get("size", 0)), mtime))
        return sorted(out, key=lambda b: b.key)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(key))

    def rename(self, src: str, dst: str) -> bool:
        # Object stores have no rename: copy, then delete. In between both keys hold the
        # same bytes, which is all gc's trash protocol needs (see _vault.gc).
        try:
            self.fs.copy(self._path(src), self._path(dst))
        except FileNotFoundError:
            return False
        self.delete(src)
        return True


def check_key(key: str) -> str:
    """``key`` itself, if every ``/``-separated part is a plain name inside the root.

    The vault builds keys from validated names and hex digests only; this is the last
    guard that no key ever reaches outside the vault's root (``..``, ``/``, ``\\``, NUL).

    Raises:
        ValueError: A part is empty, ``.`` or ``..``, or holds a NUL or backslash.
    """
    parts = key.split("/")
    if key and any(p in ("", ".", "..") or "\x00" in p or "\\" in p for p in parts):
        raise ValueError(f"refusing vault key {key!r}: it would leave the vault's root")
    return key


def open_store(root: str | os.PathLike[str], **storage_options: Any) -> Store:
    """A local folder for plain paths and ``file://``, fsspec for any other URL."""
    text = os.fspath(root)
    if "://" not in text:
        return LocalStore(text)
    if text.startswith("file://"):
        return LocalStore(text[len("file://") :])
    return FsspecStore(text, **storage_options)
