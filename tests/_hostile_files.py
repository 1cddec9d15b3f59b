"""Hostile files built by hand, byte by byte, for the ``test_hostile*`` modules.

Each builder writes exactly the bytes a case names, so each case exercises exactly one
check. The marks and ``time_limit`` are shared too: a hang or a quadratic blow-up fails a
test instead of blocking the run.
"""

from __future__ import annotations

import contextlib
import json
import re
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


def reseal(data: bytes) -> bytes:
    """``data`` with its header's sum recomputed, for a case that tests a check past it.

    A file weightvault writes carries the sum of its header (``weightvault.header_sum``,
    see docs/format.md), so any hand edit of the header fails that check first. A case
    that edits a saved file's header to reach a later check reseals it. A header
    re-encoded with other whitespace (``json.dumps`` defaults) has its first entry
    written compactly again, where the reader looks for the sum. Bytes whose header does
    not start with the sum's entry, or runs past the end, are returned as they are.
    """
    from weightvault._file.header import SEAL_PREFIX, SUM_DIGITS, header_sum

    (n,) = struct.unpack("<Q", data[:8]) if len(data) >= 8 else (0,)
    raw, rest = data[8 : 8 + n], data[8 + n :]
    first = _SUM_ENTRY.match(raw)
    if len(raw) != n or first is None:
        return data
    raw = SEAL_PREFIX + first.group(1) + raw[first.end() :]
    digits = header_sum(raw).encode()
    raw = SEAL_PREFIX + digits + raw[len(SEAL_PREFIX) + SUM_DIGITS :]
    return struct.pack("<Q", len(raw)) + raw + rest


#: The sum's entry opening a header, with any JSON whitespace: group 1 is the sum's 32
#: bytes (whatever a case did to them: they are recomputed) and the closing quote.
_SUM_ENTRY = re.compile(
    rb'\{[ \t\n\r]*"__metadata__"[ \t\n\r]*:[ \t\n\r]*\{[ \t\n\r]*'
    rb'"weightvault\.header_sum"[ \t\n\r]*:[ \t\n\r]*"((?s:.){32}")'
)


def rewrite_header(path: Path, edit: Any) -> None:
    """Replace the header of the file at ``path`` by ``edit(header_doc)``, resealed.

    ``edit`` gets the parsed header (``__metadata__`` included) and returns the new one;
    the data section is kept, the header re-padded to 8 bytes, and the file replaced
    through a temporary name.
    """
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    doc = edit(json.loads(data[8 : 8 + n]))
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(8 + len(body)) % 8)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(reseal(struct.pack("<Q", len(body)) + body + data[8 + n :]))
    tmp.replace(path)


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
