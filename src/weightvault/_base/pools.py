"""Thread pools started once per process, on first use, and forgotten by a forked child.

The vault's save workers, its codec threads and the torch adapter's copy threads each
keep one pool for the life of the process: starting threads costs about 1.7 ms each,
more than a small model's whole load. A child forked from a process that holds a pool
inherits the pool object but none of its threads (nor a lock state that means anything),
so each :class:`LazyPool` starts afresh there.

Example:
    >>> saves = LazyPool(4, "weightvault-save")
    >>> saves().submit(sum, [1, 2]).result()
    3
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

__all__ = ["LazyPool"]

_every: weakref.WeakSet[LazyPool] = weakref.WeakSet()


class LazyPool:
    """A :class:`~concurrent.futures.ThreadPoolExecutor` made on the first call.

    Args:
        size: Threads in the pool.
        name: The threads' name prefix (seen in profilers and ``threading.enumerate``).
    """

    def __init__(self, size: int, name: str) -> None:
        self.size, self.name = max(1, size), name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _every.add(self)

    def __call__(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.size, self.name)
            return self._pool

    def _forget(self) -> None:
        self._pool, self._lock = None, threading.Lock()


def _forget_all() -> None:
    for pool in list(_every):
        pool._forget()


os.register_at_fork(after_in_child=_forget_all)
