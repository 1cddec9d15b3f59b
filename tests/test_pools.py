"""Process-wide thread pools: one per purpose, started on first use, new after a fork."""

from __future__ import annotations

import os
import sys

import pytest

from weightvault._base.pools import LazyPool


def test_a_pool_starts_once_and_is_shared() -> None:
    pool = LazyPool(2, "wv-test")
    first = pool()
    assert pool() is first
    assert first.submit(lambda: 6 * 7).result() == 42


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs fork")
def test_a_forked_child_starts_its_own_pool() -> None:
    pool = LazyPool(2, "wv-test-fork")
    parent = pool()
    parent.submit(lambda: None).result()  # the parent's threads exist
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool has no threads here; a new one must run
        try:
            ok = pool() is not parent and pool().submit(lambda: 1).result(timeout=10) == 1
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 1)
    os.waitpid(pid, 0)
    os.close(read)
    assert got == b"1"
    assert pool() is parent  # the parent keeps its own
