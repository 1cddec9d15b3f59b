"""Files that appear whole or not at all: write a temporary twin, fsync, then rename.

Both the single-file writer and the vault's local store use this, so there is one place
where durability and cleanup are decided.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .pools import LazyPool


@dataclass
class AtomicFile:
    """The open temporary file; ``created`` says whether it took the target's name."""

    fd: int
    created: bool = False


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte is written (one call may write fewer)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[os.write(fd, view) :]


def fsync_dir(folder: str) -> None:
    """Make renames inside ``folder`` durable; a folder that cannot be opened is skipped."""
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


@contextlib.contextmanager
def atomic_file(
    path: str, *, exclusive: bool = False, sync_dir: bool = True, durable: bool = True
) -> Iterator[AtomicFile]:
    """Yield a temporary file beside ``path``; on success it becomes ``path``.

    The temporary file is fsynced, given ordinary permissions and renamed over ``path``,
    so a crash at any moment leaves the previous ``path`` as it was. With ``exclusive``,
    it is linked to ``path`` only if nothing is there (an atomic "create if absent") and
    ``created`` is False otherwise. On any error the temporary file is removed.

    Args:
        path: The final name.
        exclusive: Never replace an existing ``path``.
        sync_dir: Fsync the folder after the rename; callers that commit many files at
            once pass False and sync the folders themselves, once.
        durable: Fsync the file before the rename. False still makes it appear whole or
            not at all, to every process, but a power loss may take it: for files that
            only need to be seen (a save's intent), never for a commit.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = _temp_beside(path)
    out = AtomicFile(fd)
    try:
        yield out
        if durable:
            os.fsync(fd)
        os.close(fd)
        out.fd = -1
        if exclusive:
            try:
                os.link(tmp, path)
                out.created = True
            except FileExistsError:
                pass
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
            out.created = True
    except BaseException:
        if out.fd >= 0:
            os.close(out.fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if out.created and sync_dir:
        fsync_dir(folder)


def write_temp(path: str, data: bytes | memoryview | Sequence[bytes | memoryview]) -> str:
    """Write ``data`` to a new temporary file beside ``path``, NOT synced; return its name.

    The first half of a batched atomic write: many files are written this way, made
    durable at once by :func:`sync_paths`, and only then renamed into place (see
    :meth:`weightvault._vault.store.backend.LocalStore.publish`). On error nothing is left behind.
    """
    fd, tmp = _temp_beside(path)
    try:
        at = flushed = 0
        for part in [data] if isinstance(data, bytes | memoryview) else data:
            view = memoryview(part).cast("B")
            while view.nbytes:
                chunk = view[:WRITEBACK_BYTES]
                write_all(fd, chunk)
                at += chunk.nbytes
                view = view[chunk.nbytes :]
                if at - flushed >= WRITEBACK_BYTES:
                    # A large file (a save's pack) starts going to disk while the rest
                    # is still written: the sync that follows then waits for less.
                    start_writeback(fd, flushed, at - flushed)
                    flushed = at
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


#: A temporary file's pages are handed to the disk every this many bytes written.
WRITEBACK_BYTES = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``[offset, offset + nbytes)`` of ``fd`` to disk, without waiting
    (Linux ``sync_file_range``; nothing elsewhere). Durability still comes from the
    fsync or syncfs that follows: this only lets the disk begin sooner."""
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


@functools.cache
def _sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def batch_sync_ok(own_bytes: int) -> bool:
    """Whether one ``syncfs`` should make a batch of ``own_bytes`` durable.

    One ``syncfs`` of the filesystem commits the disk's journal once, where an fsync per
    file commits it once per file (measured on a quiet disk: 157 small objects take
    0.07 s this way against 0.18-0.4 s one fsync at a time). But ``syncfs`` also writes
    whatever else is dirty on that filesystem, so while the machine holds much more dirty
    data than ``own_bytes`` (another job writing gigabytes), the batch is fsynced file by
    file instead, and a save never waits for someone else's writes.
    """
    return _others_dirty(own_bytes) <= _DIRTY_SLACK


def sync_paths(root: str, paths: Iterable[str], *, batch: bool) -> None:
    """Make ``paths`` (files, or folders holding renames) durable: with ``batch``, by one
    ``syncfs`` of ``root``'s filesystem where Linux offers it, else (and where it does
    not) by an fsync of each, concurrently."""
    if batch and syncfs(root):
        return
    fsync_all(paths)


#: How many bytes of other writers' dirty data a ``syncfs`` may also flush.
_DIRTY_SLACK = 64 << 20


def _others_dirty(own_bytes: int) -> int:
    """Dirty and in-writeback bytes on this machine beyond ``own_bytes`` (Linux); 0 where
    unknown, since ``syncfs`` is then only tried where it exists."""
    try:
        with open("/proc/meminfo", "rb") as f:
            text = f.read()
    except OSError:
        return 0
    total = 0
    for line in text.splitlines():
        if line.startswith((b"Dirty:", b"Writeback:")):
            total += int(line.split()[1]) * 1024
    return max(0, total - own_bytes)


def fsync_file(path: str) -> None:
    """fsync ``path`` (a file, or a folder for the renames inside it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(paths: Iterable[str]) -> None:
    """fsync each of ``paths`` (files or folders), several at a time: concurrent fsyncs
    share the disk's journal commits."""
    paths = list(paths)
    if len(paths) <= 1:
        for path in paths:
            fsync_file(path)
        return
    # Threads kept for the process: a new pool of 16 per call cost more than the fsyncs
    # of a small save (a thread start is about 1.7 ms here, see _base.pools).
    list(_fsyncers().map(fsync_file, paths))


#: Threads that wait in fsync; they use no CPU, so there are more than cores.
_fsyncers = LazyPool(16, "weightvault-fsync")


def syncfs(root: str) -> bool:
    """``syncfs(2)`` on ``root``'s filesystem; False where it is unavailable or failed."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(root, os.O_RDONLY)
    except OSError:
        return False
    try:
        return bool(libc.syncfs(fd) == 0)
    except AttributeError:
        return False
    finally:
        os.close(fd)


def open_temp(path: str) -> tuple[int, str]:
    """A new temporary file beside ``path`` (created exclusively, not synced), for a
    writer that fills it by offset; ``(descriptor, name)``. The caller closes it, and
    makes it durable and renames it as :func:`write_temp`'s files are."""
    return _temp_beside(path)


def _temp_beside(path: str) -> tuple[int, str]:
    """A new temporary file in ``path``'s folder, named so that gc knows it as one.

    Opened for reading too, as ``mkstemp`` did (the Keras writers hand it to h5py, which
    reads back what it wrote), with ``O_EXCL`` under a name no other writer picks (this
    process's random tag and a counter; a name taken anyway is skipped), with the ordinary
    mode ``0o644``
    less the umask, which the kernel applies. ``tempfile.mkstemp`` made it ``0o600`` and
    a ``chmod`` (and two ``umask`` calls, to read the mask) followed: three system calls
    and a moment of umask 0 for every thread of the process, per object a save writes.
    """
    folder = os.path.dirname(os.path.abspath(path))
    stem = os.path.join(folder, f".{os.path.basename(path)}.")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    flags |= getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = f"{stem}{_TAG[0]}{os.getpid():x}-{next(_COUNTER):x}.tmp"
        try:
            return os.open(tmp, flags, 0o644), tmp
        except FileExistsError:
            _TAG[0] = os.urandom(4).hex()  # someone holds this tag: take another
    raise FileExistsError(f"{folder}: could not create a temporary file beside {path}")


#: This process's part of temporary names (renewed if it ever collides), and a counter.
_TAG = [os.urandom(4).hex()]
_COUNTER = itertools.count()
