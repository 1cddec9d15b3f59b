"""Files that appear whole or not at all: write a temporary twin, fsync, then rename.

Both the single-file writer and the vault's local store use this, so there is one place
where durability and cleanup are decided.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


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
    path: str, *, exclusive: bool = False, sync_dir: bool = True
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
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    out = AtomicFile(fd)
    try:
        yield out
        os.fchmod(fd, 0o644 & ~_umask())
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


def write_temp(path: str, data: bytes | memoryview) -> str:
    """Write ``data`` to a new temporary file beside ``path``, NOT synced; return its name.

    The first half of a batched atomic write: many files are written this way, made
    durable at once by :func:`sync_files`, and only then renamed into place (see
    :meth:`weightvault._vault.store.LocalStore.publish`). On error nothing is left behind.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        write_all(fd, data)
        os.fchmod(fd, 0o644 & ~_umask())
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


def sync_files(root: str, paths: Iterable[str]) -> None:
    """Make the data of ``paths`` (and every earlier rename on ``root``'s disk) durable.

    One ``syncfs`` of the filesystem that holds ``root`` where Linux offers it: a disk
    then commits its journal once, where an fsync per file commits it once per file
    (measured: 157 small objects take 0.07 s this way against 0.18-0.4 s one fsync at a
    time). It also flushes whatever else is dirty on that filesystem, which the kernel
    would write within seconds anyway. Elsewhere, each file is fsynced.
    """
    if syncfs(root):
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
