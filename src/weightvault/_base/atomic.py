"""Files that appear whole or not at all: write a temporary twin, fsync, then rename.

Both the single-file writer and the vault's local store use this, so there is one place
where durability and cleanup are decided.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
