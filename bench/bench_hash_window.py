"""How large a window a verified read should hash at a time (section 28).

A verified load reads each object through a window (``preadv`` into a buffer), hashes the
window, and only copies into the model once every object matched. If a window is larger
than the cache, the hash reads it back from memory: on an AMD EPYC VM with 1 MiB of L2
per core and 8 MiB of L3 in all, two threads with 4 MiB windows did.

- ``kernel``: 497 MB of random floats, read and hashed (xxh3) from the page cache with
  windows of 128 KiB to 4 MiB on one and two threads; a mapping hashed in place beside them.
- ``demo``: ``make demo``'s setup (GPT-2 small, only its last block trainable, AdamW),
  three checkpoints; the newest resumed (model + optimizer) with the windows of before this
  section (4 MiB) and after (1 MiB), against ``load_model`` + ``torch.load``.
- ``file``: GPT-2 small in one file: ``weightvault.torch.load(verify=True)`` with 16 MiB
  windows (before this section) and 1 MiB, a load without ``verify``, and
  ``safetensors.torch.load_model``.
- ``gpt2``: GPT-2 6 x 512 + AdamW, every weight trainable, three checkpoints into a
  default vault (settled with ``compact()``) and a ``compression=None`` one; the settled
  newest, the raw newest and the oldest, both windows, against the plain files.

Each window is set by patching the three module constants the reads use, so both run in
one process, alternating, medians. Everything is written under one temporary folder,
deleted at the end.

    python3 -c "bytearray(8 << 30)"
    PYTHONPATH=src .venv/bin/python bench/bench_hash_window.py kernel       # ~30 s
    PYTHONPATH=src .venv/bin/python bench/bench_hash_window.py file         # ~1 min
    PYTHONPATH=src .venv/bin/python bench/bench_hash_window.py demo         # ~1 min
    PYTHONPATH=src .venv/bin/python bench/bench_hash_window.py gpt2         # ~2 min
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import numpy as np
import torch
import xxhash
from _common import machine, med, run_rounds, table

import weightvault
import weightvault._file.checkpoint as file_checkpoint
import weightvault._vault.objects.frame as frame
import weightvault._vault.objects.read as objects

OLD, NEW = 4 << 20, file_checkpoint.HASH_WINDOW


def use(window: int) -> None:
    """Read and hash raw objects, single files and compressed blocks in ``window`` pieces."""
    objects._RAW_WINDOW = file_checkpoint.HASH_WINDOW = frame.HASH_WINDOW = window


def kernel(folder: Path, rounds: int) -> None:
    n = 497_000_000
    path = folder / "blob"
    np.random.default_rng(0).standard_normal(n // 4, dtype=np.float32).tofile(path)
    fd = os.open(path, os.O_RDONLY)

    def pread(window: int, threads: int) -> Callable[[], None]:
        def work(lo: int, hi: int) -> None:
            buf, h = memoryview(bytearray(window)), xxhash.xxh3_64()
            while lo < hi:
                got = os.preadv(fd, [buf[: min(window, hi - lo)]], lo)
                h.update(buf[:got])
                lo += got

        return lambda: _threads(work, n, threads)

    def mapped(threads: int) -> Callable[[], None]:
        def run() -> None:
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m, memoryview(m) as view:
                _threads(lambda lo, hi: xxhash.xxh3_64(view[lo:hi]).digest(), n, threads)

        return run

    contenders: dict[str, Callable[[], Any]] = {
        f"preadv + xxh3, {w >> 10} KiB windows, {t} thread(s)": pread(w, t)
        for w, t in itertools.product((128 << 10, 256 << 10, 1 << 20, 4 << 20), (1, 2))
    }
    contenders |= {f"xxh3 of a mapping, {t} thread(s)": mapped(t) for t in (1, 2)}
    try:
        times = run_rounds(contenders, rounds=rounds, warmup=1)
    finally:
        os.close(fd)
    rows = [[k, f"{med(v) * 1000:.1f}"] for k, v in times.items()]
    print(table(rows, ["497 MB from the page cache", "median ms"]))


def _threads(work: Callable[[int, int], Any], n: int, threads: int) -> None:
    cut = [n * i // threads for i in range(threads + 1)]
    ts = [threading.Thread(target=work, args=(cut[i], cut[i + 1])) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def single_file(folder: Path, rounds: int) -> None:
    from _common import build_model
    from safetensors.torch import load_model, save_model

    import weightvault.torch as wvt

    model, target = build_model(False), build_model(False, seed=1)
    ours, theirs = str(folder / "ours.safetensors"), str(folder / "theirs.safetensors")
    wvt.save(model, ours)
    save_model(model, theirs)

    def verified(window: int) -> Callable[[], None]:
        def run() -> None:
            use(window)
            wvt.load(target, ours, verify=True)

        return run

    contenders: dict[str, Callable[[], Any]] = {
        "safetensors.torch.load_model": lambda: load_model(target, theirs),
        "load(verify=True), 16384 KiB windows": verified(16 << 20),
        "load(verify=True), 1024 KiB windows": verified(NEW),
        "load()": lambda: wvt.load(target, ours),
    }
    compare(contenders, rounds, ["GPT-2 small, one file, warm", "median ms", "vs safetensors"])


def compare(contenders: dict[str, Callable[[], Any]], rounds: int, header: list[str]) -> None:
    """Run ``contenders`` alternating and print each against the first."""
    try:
        times = run_rounds(contenders, rounds=rounds, warmup=1)
    finally:
        use(NEW)
    base = med(next(iter(times.values())))
    rows = [[k, f"{med(v) * 1000:.0f}", f"{med(v) / base:.2f}x"] for k, v in times.items()]
    print(table(rows, header))


def demo(folder: Path) -> tuple[Any, Any, dict[str, weightvault.Vault]]:
    import finetune

    model, opt, sched, _ = finetune.setup(0, False)
    batch = torch.randint(0, model.config.vocab_size, (2, 64))
    vault = weightvault.Vault(folder / "vault")
    for _ in range(3):
        finetune.train_step(model, opt, sched, batch)
        vault.save(model, optimizer=opt)
        vault.wait()
    return model, opt, {"newest": vault}


def gpt2(folder: Path) -> tuple[Any, Any, dict[str, weightvault.Vault]]:
    import bench_vault_speed

    vault = weightvault.Vault(folder / "vault")
    raw = weightvault.Vault(folder / "raw", compression=None)
    for model, opt in itertools.islice(bench_vault_speed.gpt2_states(1), 3):
        vault.save(model, optimizer=opt)
        raw.save(model, optimizer=opt)
    vault.compact()  # settled: the newest compressed
    raw.wait()
    return model, opt, {"settled newest": vault, "compression=None newest": raw}


def resumes(which: str, folder: Path, rounds: int) -> None:
    from safetensors.torch import load_model, save_model

    model, opt, vaults = (demo if which == "demo" else gpt2)(folder)
    save_model(model, str(folder / "model.safetensors"))
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    print(f"optimizer lr: {[g['lr'] for g in opt.param_groups]}")

    def load(vault: weightvault.Vault, name: str, window: int) -> Callable[[], None]:
        def run() -> None:
            use(window)
            vault.load(model, name, optimizer=opt)

        return run

    def files() -> None:
        load_model(model, str(folder / "model.safetensors"))
        opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))

    contenders: dict[str, Callable[[], Any]] = {"files": files}
    if which == "gpt2":
        vaults["settled oldest"] = vaults["settled newest"]
    for label, vault in vaults.items():
        name = vault.list()[0].name if "oldest" in label else "latest"
        for window in (OLD, NEW):
            contenders[f"{label}, {window >> 10} KiB windows"] = load(vault, name, window)
    compare(contenders, rounds, ["resume (model + optimizer)", "median ms", "vs files"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("which", choices=["kernel", "file", "demo", "gpt2"])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    print(machine())
    folder = Path(tempfile.mkdtemp(prefix="wv-bench-window-"))
    try:
        if args.which == "kernel":
            kernel(folder, args.rounds)
        elif args.which == "file":
            single_file(folder, args.rounds)
        else:
            resumes(args.which, folder, args.rounds)
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
