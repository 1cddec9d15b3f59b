"""The compactor's lease: one compactor per vault at a time.

Example:
    >>> lease = CompactLease(vault.store)
    >>> if lease.acquire():
    ...     try:
    ...         lease.beat()  # now and then, while it works
    ...     finally:
    ...         lease.release()
"""

from __future__ import annotations

import os

from ..records.todo import TODO
from ..store.backend import Store
from ..store.lease import Lease

__all__ = ["LEASE", "LEASE_STALE_SECONDS", "CompactLease"]

#: Where the lease lives, beside the to-do markers (:mod:`..records.todo`); the file name
#: on disk is ``compact/lock``.
LEASE = f"{TODO}/lock"
#: A lease on an object store not rewritten for this long belongs to a dead compactor
#: (its heartbeat is rewritten every tenth of it).
LEASE_STALE_SECONDS = 60.0


class CompactLease:
    """One compactor per vault at a time.

    On a local disk, ``flock`` on ``compact/lock``: the kernel drops it when the holder's
    process dies, SIGKILL included, so no stale lease is ever left. On object stores, an
    exclusive ``compact/lock`` lease file holding the owner and rewritten as a heartbeat
    (:class:`~..store.lease.Lease`); one older than :data:`LEASE_STALE_SECONDS`, or
    written on this host by a process that has exited, is taken over.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._fd = -1
        self._lease = Lease(store, LEASE, every=LEASE_STALE_SECONDS / 10)

    def acquire(self) -> bool:
        """Take the lease if it is free; whether it was taken."""
        path = self.store.local_path(LEASE)
        if path is not None:
            import fcntl

            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            self._fd = fd
            return True
        for attempt in range(2):  # a stale lease is removed once, then tried again
            if self._lease.take(exclusive=True):
                return True
            if attempt or not self._lease.stale(LEASE_STALE_SECONDS):
                return False
            self._lease.drop()
        return False

    def beat(self) -> None:
        """Refresh an object store's lease file (a no-op for ``flock``)."""
        if self._fd < 0:
            self._lease.beat()

    def release(self) -> None:
        """Give the lease up."""
        if self._fd >= 0:
            os.close(self._fd)  # drops the flock; the file stays for the next holder
            self._fd = -1
        else:
            self._lease.drop()
