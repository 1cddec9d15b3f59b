"""Parts of a synchronous vault save, measured apart (issue 20, docs/benchmarks.md 11).

On the trained run of ``bench_compress.py`` (``--dir``, made by ``bench_compress.py
train``):

- ``compress``: delta + compression of one checkpoint's objects (the model's weights and
  AdamW moments against the checkpoint before) on a pool of N threads, with python-blosc2
  holding the GIL and releasing it;
- ``gil``: whole ``vault.save`` calls in one process, alternating between the two, so both
  see the same machine (a fresh vault per round, its first save untimed);
- ``create``: what creating the 157 files of a save costs on this disk, apart from
  writing them.

    PYTHONPATH=src .venv/bin/python bench/bench_save_parts.py compress --dir /tmp/wv-lm
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import _train_lm as T
import blosc2
import torch

import weightvault._vault.objects.codec as codec_module
import weightvault._vault.objects.encoding as delta_module
import weightvault._vault.objects.frame as frame_module
from weightvault import Vault
from weightvault._vault.objects.codec import CODECS, STORED, Codec
from weightvault._vault.objects.frame import encode_frame
from weightvault._vault.objects.transforms import DIFFERENCE, make_delta


def _minimum(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _buffers(folder: Path) -> list[memoryview]:
    model, opt, _ = T.restore(folder)
    out = [p.detach().contiguous().view(torch.uint8).numpy() for p in model.parameters()]
    for state in opt.state.values():
        out += [state[k].contiguous().view(torch.uint8).numpy() for k in ("exp_avg", "exp_avg_sq")]
    return [memoryview(b).cast("B") for b in out]


def held(codec: Codec, data: memoryview, itemsize: int) -> bytes | memoryview:
    """``compress_block`` as it was: python-blosc2 holding the GIL."""
    if codec.id == STORED.id:
        return data
    blosc2.set_releasegil(False)
    return bytes(
        blosc2.compress2(
            data,
            typesize=itemsize,
            clevel=codec.level,
            codec=blosc2.Codec.ZSTD,
            filters=[blosc2.Filter.SHUFFLE],
            nthreads=codec_module._threads(data.nbytes),
        )
    )


def cmd_compress(root: Path, rounds: int) -> None:
    folders = T.checkpoints(root, "a")
    old, new = _buffers(folders[1]), _buffers(folders[2])
    codec = CODECS["blosc2"]

    def one(i: int) -> int:
        delta = memoryview(make_delta(new[i], old[i], DIFFERENCE, 4))
        return sum(len(p) for p in encode_frame(delta, 4, codec))

    print(f"{len(new)} objects, {sum(b.nbytes for b in new) / 1e6:.1f} MB")
    for threads in (1, 2, 3, 6):
        for release in (False, True):
            fn = codec_module.compress_block if release else held
            frame_module.compress_block = fn  # type: ignore[assignment]
            with ThreadPoolExecutor(threads) as pool:
                best = _minimum(lambda: list(pool.map(one, range(len(new)))), rounds)
            gil = "released" if release else "held"
            print(f"{threads} threads, GIL {gil:8s} {best * 1e3:6.1f} ms", flush=True)


def cmd_gil(root: Path, rounds: int, scratch: Path) -> None:
    states = [T.restore(f) for f in T.checkpoints(root, "a")]
    fns = {"GIL held": held, "GIL released": codec_module.compress_block}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        vault = Vault(scratch / f"gil-{r}")
        model, opt, sched = states[0]
        vault.save(model, optimizer=opt, scheduler=sched, rng=True)
        for i, (model, opt, sched) in enumerate(states[1:]):
            label = list(fns)[(i + r) % 2]
            frame_module.compress_block = delta_module.compress_block = fns[label]  # type: ignore[assignment]
            t0 = time.perf_counter()
            vault.save(model, optimizer=opt, scheduler=sched, rng=True)
            times[label].append(time.perf_counter() - t0)
    for label, ts in times.items():
        mid = sorted(ts)[len(ts) // 2]
        print(f"{label:12s} {len(ts)} saves: min {min(ts) * 1e3:.1f} ms, median {mid * 1e3:.1f} ms")


def cmd_create(rounds: int, scratch: Path) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL

    def make(folder: Path) -> None:
        for i in range(157):
            os.close(os.open(folder / f"{i % 100:02x}" / f".{i}.tmp", flags, 0o644))

    times = []
    for r in range(rounds):
        folder = scratch / f"create-{r}"
        for i in range(100):
            (folder / f"{i:02x}").mkdir(parents=True)
        t0 = time.perf_counter()
        make(folder)
        times.append(time.perf_counter() - t0)
    mid = sorted(times)[len(times) // 2]
    print(
        f"157 empty files in 100 folders: min {min(times) * 1e3:.1f} ms, median {mid * 1e3:.1f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["compress", "gil", "create"])
    ap.add_argument("--dir", type=Path, help="the trained run of bench_compress.py")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="wv-parts-"))
    try:
        if args.what == "compress":
            cmd_compress(args.dir, args.rounds)
        elif args.what == "gil":
            cmd_gil(args.dir, args.rounds, scratch)
        else:
            cmd_create(args.rounds, scratch)
    finally:
        shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
