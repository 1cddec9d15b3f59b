"""Thread pools started once per process, on first use, and forgotten by a forked child.

The vault's save workers, its codec threads and the torch adapter's copy threads each
keep one pool for the life of the process: starting threads costs about 1.7 ms each,
more than a small model's whole load. A child forked from a process that holds a pool
inherits the pool object but none of its threads (nor a lock state that means anything),
so each :class:`LazyPool` starts afresh there.

:func:`each` and :func:`each_grouped` run a function over items on such a pool, results
in order; :data:`workers` is the pool a save, a commit and a transfer hash and write on.

Example:
    >>> saves = LazyPool(4, "weightvault-save")
    >>> saves().submit(sum, [1, 2]).result()
    3
    >>> each(saves(), abs, [-1, 2])
    [1, 2]
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = ["GROUP_BYTES", "WORKERS", "LazyPool", "each", "each_grouped", "workers"]

T = TypeVar("T")
U = TypeVar("U")

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


#: Threads a save hashes and writes with. blake3 and xxhash release the GIL, so hashing
#: uses every core; the extra threads overlap fsyncs (and object-store round trips).
WORKERS = min(32, (os.cpu_count() or 1) + 4)

#: This process's save threads, started once (a thread start costs milliseconds).
workers = LazyPool(WORKERS, "weightvault-save")


def each(
    pool: ThreadPoolExecutor,
    fn: Callable[[U], T],
    items: Sequence[U],
    done: Callable[[U], object] | None = None,
) -> list[T]:
    """``fn`` over ``items`` on ``pool``, results in order, ``done(item)`` as each arrives.

    On any error it still waits for every call to finish, so a failed save leaves nothing
    running behind it.
    """
    futures = [pool.submit(fn, item) for item in items]
    try:
        out = []
        for item, future in zip(items, futures, strict=True):
            out.append(future.result())
            if done is not None:
                done(item)
        return out
    finally:
        wait(futures)


#: Small items are handed to the threads in groups of about this many bytes: a future
#: costs tens of microseconds, as much as hashing a 100 KB tensor.
GROUP_BYTES = 4 << 20


def each_grouped(
    pool: ThreadPoolExecutor,
    fn: Callable[[U], T],
    items: Sequence[U],
    size: Callable[[U], int],
    done: Callable[[U], object] | None = None,
) -> list[T]:
    """:func:`each`, with consecutive items of under :data:`GROUP_BYTES` together run as
    one call (results in order, ``done`` for each item once its group has run)."""
    groups: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i, item in enumerate(items):
        current.append(i)
        held += size(item)
        if held >= GROUP_BYTES:
            groups.append(current)
            current, held = [], 0
    if current:
        groups.append(current)

    def run(group: list[int]) -> list[T]:
        return [fn(items[i]) for i in group]

    def finished(group: list[int]) -> None:
        if done is not None:
            for i in group:
                done(items[i])

    out: list[T] = []
    for result in each(pool, run, groups, finished):
        out.extend(result)
    return out
