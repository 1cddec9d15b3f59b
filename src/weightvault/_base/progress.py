"""A dependency-free progress bar on stderr, drawn only when stderr is a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def human(n: float) -> str:
    """Bytes as ``12.3 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


class Progress:
    """Counts bytes and redraws ``label [#####.....]  45%  1.2 GiB / 2.5 GiB  310 MiB/s``.

    Call it with each chunk's byte count; call :meth:`close` at the end. On anything but a
    terminal (a pipe, CI's log) it draws nothing, so logs stay clean.
    """

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total, self.label, self.done = max(total, 1), label, 0
        self.stream = stream or sys.stderr
        self.on = self.stream.isatty()
        self.start = time.monotonic()
        self._last = 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.on and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 24)
            rate = self.done / max(now - self.start, 1e-9)
            self.stream.write(
                f"\r{self.label} [{bar:<24}] {frac:4.0%}  {human(self.done)} / "
                f"{human(self.total)}  {human(rate)}/s "
            )
            self.stream.flush()

    def close(self) -> None:
        if self.on:
            self.stream.write("\r" + " " * 78 + "\r")
            self.stream.flush()
