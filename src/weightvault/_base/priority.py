"""Background threads that give way to the training loop on a busy CPU.

A mirror's uploads are work nobody waits for, yet on a machine whose cores training
already fills they would take an equal share of them. On Linux a thread has a nice value
of its own, so the thread doing that work raises it; elsewhere, or when the system
refuses, nothing changes (this never fails the work).

Example:
    >>> import threading
    >>> t = threading.Thread(target=lower_priority)
    >>> t.start(); t.join()
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

__all__ = ["lower_priority"]

#: How much nicer than the process a background thread makes itself.
STEP = 10


def lower_priority() -> None:
    """Make the calling thread (only it, on Linux) nicer by :data:`STEP`, at most 19."""
    if not sys.platform.startswith("linux"):
        return  # there the call would renice the whole process
    tid = threading.get_native_id()
    with contextlib.suppress(OSError, AttributeError):
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + STEP))
