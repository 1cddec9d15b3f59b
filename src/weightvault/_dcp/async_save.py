"""Saves that finish in the background: one thread per process, a gloo group of their own.

:func:`weightvault.dcp.async_save` returns once this rank's state is staged and runs the
rest of DCP's save (its collectives included) on a thread. Those collectives must not
interleave with the training loop's on the default group, so they run on a separate gloo
group of every rank, made once (creating it is itself collective: every rank's first
``async_save`` makes it, in the same order).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["async_group", "start"]

T = TypeVar("T")

_thread: ThreadPoolExecutor | None = None
_groups: dict[int, Any] = {}
_lock = threading.Lock()


def _forget() -> None:
    # A forked child has none of the parent's threads nor its process groups.
    global _thread, _lock
    _thread, _lock = None, threading.Lock()
    _groups.clear()


os.register_at_fork(after_in_child=_forget)


def async_group() -> Any:
    """The background saves' gloo group (every rank), or ``None`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = id(dist.group.WORLD)
    if key not in _groups:
        _groups[key] = dist.new_group(backend="gloo")
    return _groups[key]


def start(run: Callable[[], T], staged: threading.Event) -> Future[T]:
    """Run ``run`` on the background thread; return once ``staged`` is set (or it ended).

    Saves run one after another: a second one starts staging when the first is done.
    """
    global _thread
    with _lock:
        if _thread is None:
            _thread = ThreadPoolExecutor(1, "weightvault-dcp-async")
        future = _thread.submit(run)
    future.add_done_callback(lambda _: staged.set())
    staged.wait()
    return future
