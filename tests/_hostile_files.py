"""Hostile files built by hand, byte by byte, for the ``test_hostile*`` modules.

Each builder writes exactly the bytes a case names, so each case exercises exactly one
check. The marks and ``time_limit`` are shared too: a hang or a quadratic blow-up fails a
test instead of blocking the run.
"""

from __future__ import annotations

import contextlib
import json
import signal
import struct
from pathlib import Path
from typing import Any

import pytest

try:
    import torch

    import weightvault.torch as wvt
except ImportError:  # pragma: no cover - the framework-free cases still run
    torch = None  # type: ignore[assignment]
    wvt = None  # type: ignore[assignment]

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


# ---------------------------------------------------------------------------------------
# Building files by hand
# ---------------------------------------------------------------------------------------


def blob(header: dict[str, Any] | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """An 8-byte little-endian length, the header bytes, then ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode("utf-8")
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + data


def entry(dtype: str, shape: list[Any], start: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def with_manifest(manifest: dict[str, Any] | str, tensors: dict[str, Any], **extra: str):
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    return {"__metadata__": {"weightvault": text, **extra}, **tensors}


#: One stored F32[2] tensor "a" and one U8[4] tensor "b": 12 data bytes.
TWO = {"a": entry("F32", [2], 0, 8), "b": entry("U8", [4], 8, 12)}
TWO_DATA = bytes(range(12))


def _write(tmp_path: Path, data: bytes, name: str = "hostile.safetensors") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _stride0_view(n: int) -> bytes:
    """One stored F32 and a view that repeats it ``n`` times (stride 0): 4 data bytes."""
    manifest = {"version": 1, "views": {"v": ["a", "F32", [n], [0], 0]}}
    return blob(with_manifest(manifest, {"a": entry("F32", [1], 0, 4)}), b"\0\0\x80?")


def _copies(n: int, nbytes: int) -> bytes:
    """One stored U8 tensor of ``nbytes`` and ``n`` copies of it."""
    manifest = {"version": 1, "copies": {f"c{i}": "a" for i in range(n)}}
    return blob(with_manifest(manifest, {"a": entry("U8", [nbytes], 0, nbytes)}), bytes(nbytes))


# ---------------------------------------------------------------------------------------
# Time limits: a hang or a quadratic blow-up fails, not blocks
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def time_limit(seconds: float):  # type: ignore[no-untyped-def]
    """Interrupt the block with TimeoutError after ``seconds`` of CPU time, or ten times
    that of wall time (a hang fails, not blocks). CPU time, because a loaded CI machine
    stretches wall time several-fold while the work itself stays the same."""

    def alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s of CPU time (or {10 * seconds} s)")

    old_real = signal.signal(signal.SIGALRM, alarm)
    old_prof = signal.signal(signal.SIGPROF, alarm)
    signal.setitimer(signal.ITIMER_REAL, 10 * seconds)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGALRM, old_real)
        signal.signal(signal.SIGPROF, old_prof)


needs_alarm = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
