"""Optimizer steps wait for a background vault save's copies.

A background save must save the values of the moment it was called. Copying them before
the call returns is what used to make it block (10 ms for a 39 MB checkpoint on two
cores, a quarter of a synchronous save). A parameter that requires grad and its
optimizer state change only when an optimizer steps, so their copies are queued
(:meth:`~.._base.background.SnapshotPool.later`) and made in the save's thread, and every
``torch.optim.Optimizer.step`` in the process waits for them first, through one global
step pre-hook registered on the first such save. The forward and backward passes that
come before that step run while the copies are made.

Everything else a training loop may change in place, such as buffers a forward pass
updates (batch norm statistics), is still copied before the call returns.
"""

from __future__ import annotations

import threading
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._base.snapshots import SnapshotPool

__all__ = ["guard", "wait_staged"]

_lock = threading.Lock()
_pending: list[SnapshotPool] = []
_hook: Any = None


def guard(pool: SnapshotPool) -> None:
    """Make every optimizer step wait until ``pool``'s queued copies are made."""
    global _hook
    if pool.staged(0):
        return
    with _lock:
        if _hook is None:
            _hook = register_optimizer_step_pre_hook(_before_step)
        if all(p is not pool for p in _pending):
            _pending.append(pool)


def wait_staged() -> None:
    """Wait for every background save's queued copies in this process.

    Call it before changing a trainable parameter in place other than by an optimizer
    step (which waits by itself) while a background save may still be copying it.
    """
    with _lock:
        pools = list(_pending)
    for pool in pools:
        pool.staged()
    with _lock:
        _pending[:] = [p for p in _pending if not p.staged(0)]


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if _pending:  # a list read without the lock: empty is the common case
        wait_staged()
