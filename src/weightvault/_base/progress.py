"""A dependency-free progress bar on stderr, drawn only when stderr is a terminal.

Long work reports bytes as it goes (``bar(n)``). Some of it goes quiet for a while: a
vault save reports bytes as it hashes, then compresses and writes without a word. So
that a quiet phase never looks like a hang, a bar on a terminal redraws its elapsed
seconds every :data:`TICK` seconds from a small thread until it is closed. On anything
but a terminal (a pipe, a CI log) it draws nothing and starts no thread.

Example:
    >>> with Progress(total, "saving") as bar:
    ...     vault.save(model, progress=bar)
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO


def human(n: float) -> str:
    """Bytes as ``12.3 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


#: Seconds between redraws: of bytes as they come, and of the elapsed time when none do.
TICK = 0.5
#: The widest line a bar draws (it is cleared with as many spaces): an 80-column
#: terminal's line, less the cursor's column.
WIDTH = 79
#: The bar's own width in characters.
BAR = 20


class Progress:
    """Counts bytes and redraws ``label [#####.....]  45%  1.2 GiB / 2.5 GiB  310.0 MiB/s  3 s``.

    Call it with each chunk's byte count, from any thread; call :meth:`close` at the end
    (or use it as a context manager). A total of 0 means "unknown": then it draws the
    bytes and the rate without a bar. Past its total it keeps counting, shown as 100%.

    Args:
        total: The bytes to expect (0: unknown).
        label: What the work is, first on the line.
        stream: Where to draw; stderr by default.
        tick: Seconds between redraws.
        then: What the work does, silently, once the total is reached (a save
            compresses and writes after hashing). The line then names it with the
            seconds spent on it, instead of a full bar whose rate would seem to fall.
    """

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        *,
        tick: float = TICK,
        then: str | None = None,
    ) -> None:
        self.total, self.label, self.done, self.then = max(total, 0), label, 0, then
        self._reached = 0.0  # when the total was reached (for ``then``)
        self.stream = stream or sys.stderr
        self.on = _is_terminal(self.stream)
        self.start = time.monotonic()
        self.tick = tick
        self._last = 0.0
        self._full = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._ticker: threading.Thread | None = None
        if self.on:
            self._ticker = threading.Thread(target=self._tick, name="weightvault-progress")
            self._ticker.daemon = True  # never keeps a finished program alive
            self._ticker.start()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            full = bool(self.total) and self.done >= self.total
            reached, self._full = full and not self._full, full
            if reached:
                self._reached = now
            # Throttled, but reaching the total is always shown, once.
            if (
                self.on
                and not self._closed.is_set()
                and (reached or now - self._last >= self.tick / 5)
            ):
                self._draw(now)

    def phase(self, label: str, total: int) -> None:
        """Start counting another phase of the same work (``writing`` after ``hashing``)
        from zero, with its own total."""
        with self._lock:
            self.label, self.total, self.done, self.then = label, max(total, 0), 0, None
            self.start, self._full = time.monotonic(), False
            if self.on and not self._closed.is_set():
                self._draw(self.start)

    def line(self, now: float) -> str:
        """What the bar shows at ``now``, at most :data:`WIDTH` characters: a long label
        is cut, the figures never are."""
        elapsed = now - self.start
        rate = f"{human(self.done / max(elapsed, 1e-9))}/s"
        if self.then is not None and self._full:
            done = self._reached - self.start
            figures = (
                f": {self.then}  {now - self._reached:.0f} s  (after {human(self.done)} in "
                f"{done:.0f} s)"
            )
        elif not self.total:
            figures = f"  {human(self.done)}  {rate}  {elapsed:.0f} s"
        else:
            frac = min(self.done / self.total, 1.0)
            figures = (
                f" [{'#' * int(frac * BAR):<{BAR}}] {frac:4.0%}  {human(self.done)} / "
                f"{human(self.total)}  {rate}  {elapsed:.0f} s"
            )
        room = max(WIDTH - len(figures), 8)
        label = self.label if len(self.label) <= room else self.label[: room - 3] + "..."
        return label + figures

    def _draw(self, now: float) -> None:
        self._last = now
        self._write("\r" + self.line(now).ljust(WIDTH))

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            # A terminal that went away (closed, hung up) must not fail the work drawn.
            self.on = False

    def _tick(self) -> None:
        while not self._closed.wait(self.tick):
            with self._lock:
                if self.on and not self._closed.is_set():
                    self._draw(time.monotonic())

    def close(self) -> None:
        """Stop redrawing and clear the line (on a terminal); calling it again does nothing."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self.on:
                self._write("\r" + " " * WIDTH + "\r")
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
