"""Helpers shared by the benchmark scripts (not part of the package)."""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from weightvault._base.atomic import fsync_file

GB = 1e9
MiB = 1 << 20


def build_model(quick: bool, seed: int = 0) -> torch.nn.Module:
    """GPT-2 small (or a 2-layer one with ``quick``), random weights, tied, no downloads."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2) if quick else GPT2Config()
    return GPT2LMHeadModel(cfg).eval()


def unique_buffers(model: torch.nn.Module) -> list[memoryview]:
    """The bytes weightvault stores for ``model`` (ties and equal copies removed), in order."""
    from weightvault._file import writer as _writer
    from weightvault._file.sharing import plan
    from weightvault.torch import sources as model_sources

    sources, _ = model_sources(model)
    return [s.data().cast("B") for s, _ in _writer.layout(plan(sources).stored)]


def fsync_path(path: str) -> None:
    fsync_file(path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def save_plain_files(folder: Any, model: torch.nn.Module, opt: Any) -> None:
    """What a user saves without weightvault: ``save_model`` + ``torch.save`` of the
    optimizer's state, into the new folder ``folder``, both files fsynced with it."""
    from safetensors.torch import save_model

    os.mkdir(folder)
    save_model(model, os.path.join(folder, "model.safetensors"))
    torch.save(opt.state_dict(), os.path.join(folder, "optimizer.pt"))
    for name in ("model.safetensors", "optimizer.pt"):
        fsync_path(os.path.join(folder, name))


def fsync_dir(folder: str) -> None:
    fsync_file(folder)  # a folder's fsync makes the renames in it durable


def drop_file_cache(path: str) -> None:
    """Evict ``path``'s (clean) pages from the page cache, so the next read goes to disk."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextlib.contextmanager
def no_fsync() -> Iterator[None]:
    """Make ``os.fsync`` a no-op (for every caller, weightvault included)."""
    real = os.fsync
    os.fsync = lambda fd: None  # type: ignore[assignment]
    try:
        yield
    finally:
        os.fsync = real


def quiesce() -> None:
    """Flush other dirty data and garbage before a timed step, so steps do not overlap."""
    gc.collect()
    os.sync()


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_rounds(
    contenders: dict[str, Callable[[], Any]],
    *,
    rounds: int,
    warmup: int,
    before: Callable[[str], None] | None = None,
    after: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Time each contender once per round, rotating who goes first, and keep all samples."""
    names = list(contenders)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if before is not None:
                before(name)
            quiesce()
            t = timed(contenders[name])
            if after is not None:
                after(name)
            if r >= warmup:
                out[name].append(t)
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}"


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) if m else -1


def reset_peak_rss() -> None:
    """Reset VmHWM (Linux >= 4.0), so the next peak is measured from now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def machine() -> dict[str, Any]:
    import psutil

    cpu = platform.processor() or ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        m = re.search(r"model name\s*:\s*(.*)", f.read())
        cpu = m.group(1) if m else cpu
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    for mod in ("safetensors", "transformers", "xxhash", "blake3"):
        with contextlib.suppress(Exception):
            info[mod] = getattr(__import__(mod), "__version__", None) or getattr(
                __import__(mod), "VERSION", "?"
            )
    return info


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


class AnonSampler:
    """Track the peak ``RssAnon`` (private memory) from a thread sampling every ``interval`` s.

    File pages mapped by ``mmap`` count in RSS but are page cache, reclaimable and shared;
    anonymous memory is what a save or load really allocates.
    """

    def __init__(self, interval: float = 0.001) -> None:
        import threading

        self.interval = interval
        self.peak_kb = status_kb("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, status_kb("RssAnon"))
            time.sleep(self.interval)

    def __enter__(self) -> AnonSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kb = max(self.peak_kb, status_kb("RssAnon"))
