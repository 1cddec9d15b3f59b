"""Leases: a file that says which process holds a piece of work, and whether it still does.

A lease file holds its owner document, ``{"created", "pid", "host", "started"}`` (JSON),
and is rewritten now and then as a heartbeat. A lease is dead when its heartbeat is old,
or when its owner ran on this host and has provably exited (pid gone, or reused by a
process that started later). Two kinds use it: the compactor's lease (``compact/lock``,
held by one compactor at a time) and each running gc's lease (``gc/<id>.json``), which
saves wait for (:func:`wait_for_gc`).

Example:
    >>> lease = Lease(store, "gc/abc.json", every=10.0)
    >>> lease.take()
    True
    >>> lease.beat()  # rewritten once ``every`` seconds have passed
    >>> lease.drop()
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time

from ..._base.errors import VaultBusyError
from .backend import Blob, Store

__all__ = [
    "GC_HEARTBEAT_SECONDS",
    "GC_STALE_SECONDS",
    "Lease",
    "gc_leases",
    "is_ours",
    "owner_document",
    "owner_gone",
    "process_start",
    "read_owner",
    "wait_for_gc",
]

#: A running gc rewrites its lease this often; one not rewritten for GC_STALE_SECONDS
#: belongs to a gc that died or stalls, and saves stop waiting for it. Neither number
#: matters for safety (gc re-reads what is live before it deletes anything), only for how
#: long a save may wait.
GC_HEARTBEAT_SECONDS = 10.0
GC_STALE_SECONDS = 60.0

log = logging.getLogger("weightvault")


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), to tell a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # Field 22, counted after the command name, which may itself hold spaces.
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def owner_document() -> bytes:
    """This process's owner document, created now.

    Example:
        >>> sorted(json.loads(owner_document()))
        ['created', 'host', 'pid', 'started']
    """
    pid = os.getpid()
    owner = {"pid": pid, "host": socket.gethostname(), "started": process_start(pid)}
    return json.dumps({"created": time.time(), **owner}).encode()


def read_owner(store: Store, key: str) -> object:
    """The owner document in lease file ``key``; ``None`` when it is being rewritten or
    damaged (then only its age can tell).

    Raises:
        FileNotFoundError: The lease is gone (its holder just finished).
    """
    try:
        return json.loads(store.get(key))
    except (ValueError, RecursionError):
        return None


def owner_gone(doc: object) -> bool:
    """Whether a lease's process has provably exited (same host, pid gone or reused)."""
    if not isinstance(doc, dict) or doc.get("host") != socket.gethostname():
        return False  # another machine's: only its heartbeat can tell
    pid = doc.get("pid")
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, owned by someone else
    started = doc.get("started")
    now_started = process_start(pid)
    return type(started) is int and now_started is not None and now_started != started


def is_ours(doc: object) -> bool:
    """Whether a lease is held by this process (on any of its threads)."""
    if not isinstance(doc, dict) or doc.get("host") != socket.gethostname():
        return False
    pid = os.getpid()
    return doc.get("pid") == pid and doc.get("started") == process_start(pid)


class Lease:
    """The lease file ``key`` of ``store``, held by this process.

    Args:
        store: Where the lease file lives.
        key: Its key.
        every: Seconds between two heartbeats (:meth:`beat`).
    """

    def __init__(self, store: Store, key: str, every: float) -> None:
        self.store, self.key, self.every = store, key, every
        self._last = 0.0

    def take(self, *, exclusive: bool = False) -> bool:
        """Write this process's owner document; with ``exclusive``, only if no lease file
        is there. Whether it was written."""
        if not self.store.put(self.key, owner_document(), exclusive=exclusive):
            return False
        self._last = time.monotonic()
        return True

    def beat(self) -> None:
        """Rewrite the owner document if ``every`` seconds have passed since the last."""
        if time.monotonic() - self._last >= self.every:
            self.take()

    def drop(self) -> None:
        """Delete the lease file."""
        self.store.delete(self.key)

    def stale(self, seconds: float) -> bool:
        """Whether the lease file there now (anyone's) is dead: gone, not rewritten for
        over ``seconds``, or its owner provably exited."""
        folder = self.key.rsplit("/", 1)[0] if "/" in self.key else ""
        blobs = [b for b in self.store.list(folder) if b.key == self.key]
        if not blobs:
            return True
        if time.time() - blobs[0].mtime > seconds:
            return True
        try:
            return owner_gone(read_owner(self.store, self.key))
        except FileNotFoundError:
            return False


def gc_leases(store: Store, *, others: bool = False) -> list[tuple[Blob, str | None]]:
    """Each gc's lease (``gc/<id>.json``), with why its gc is dead (None: it may be
    running); ``others`` leaves out this process's own gc."""
    out: list[tuple[Blob, str | None]] = []
    now = time.time()
    for blob in store.list("gc"):
        if blob.key.rsplit("/", 1)[-1].startswith("."):
            continue  # a lease still being written (a store's temporary file)
        age = now - blob.mtime
        if age >= GC_STALE_SECONDS:
            out.append((blob, f"its heartbeat is {age:.0f} s old"))
            continue
        try:
            doc = read_owner(store, blob.key)
        except FileNotFoundError:
            continue  # that gc just finished
        except OSError:
            doc = None  # damaged: only its age can tell
        if others and is_ours(doc):
            continue
        gone = owner_gone(doc)
        out.append((blob, "its process has exited" if gone else None))
    return out


def _say_waiting(store: Store, lease: Blob, gc_wait: float) -> None:
    age = max(0.0, time.time() - lease.mtime)
    log.warning(
        "%s: waiting for the gc that holds %s (heartbeat %.0f s old): up to %.0f s, until "
        "its heartbeat is %.0f s old or gc_wait=%.0f s runs out. If that gc was killed on "
        "another machine, 'weightvault vault ROOT gc --break-lock' ends the wait once the "
        "heartbeat is stale",
        store.url,
        lease.key,
        age,
        min(gc_wait, max(0.0, GC_STALE_SECONDS - age)),
        GC_STALE_SECONDS,
        gc_wait,
    )


def wait_for_gc(store: Store, gc_wait: float) -> None:
    """Return once no gc runs; give up after ``gc_wait`` seconds.

    Waiting is not what keeps objects safe (gc re-checks before it deletes anything); it
    only keeps a save from rewriting objects a running gc is about to free. So a gc of
    this very process is not waited for: it is the vault's own background gc (what
    ``training_state_last`` runs on the compactor's thread), which frees the training
    state a retain dropped, not what the next save writes. Waiting for it blocked a
    ``training_state_last=1`` loop's save for the whole gc (0.8 s after 300 saves of the lm
    run), with a warning about a gc on another machine.

    Raises:
        VaultBusyError: A gc's heartbeat stayed fresh for ``gc_wait`` seconds.
    """
    deadline = time.monotonic() + gc_wait
    delay = 0.01
    told = False
    while True:
        running = [b for b, dead in gc_leases(store, others=True) if dead is None]
        if not running:
            return
        if not told:
            _say_waiting(store, running[0], gc_wait)
            told = True
        if time.monotonic() > deadline:
            raise VaultBusyError(
                f"{store.url}: a gc has been running for over {gc_wait:.0f} s "
                f"({running[0].key}); retry later, or run 'weightvault vault ROOT gc "
                "--break-lock' if that gc died"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
