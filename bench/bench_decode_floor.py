"""How fast this machine can decode a compressed checkpoint, against copying it raw.

What bounds "a settled vault's compressed newest loads within 1.5x of a raw one" (issue
27): a raw load copies each tensor's bytes once, a compressed one decodes them, and both
spread the work over the load's threads. This times the two kernels alone, without any
of weightvault's own code: blosc2 (byte planes + zstd 1, the vault's full objects)
decoding the newest lm checkpoint (weights and AdamW moments), and numpy copying the same
bytes, each on one thread and on two, alternating, medians.

    PYTHONPATH=src .venv/bin/python bench/bench_compress.py train --dir /tmp/wv-lm   # once
    PYTHONPATH=src .venv/bin/python bench/bench_decode_floor.py --dir /tmp/wv-lm
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import blosc2
import numpy as np
import torch
from safetensors.numpy import load_file


def tensors(folder: Path) -> list[np.ndarray]:
    """The checkpoint's fp32 weights and AdamW moments, as bytes."""
    weights = load_file(str(folder / "model.safetensors"))
    opt = torch.load(folder / "optimizer.pt", weights_only=True)
    out = [np.ascontiguousarray(w).view(np.uint8).ravel() for w in weights.values()]
    for state in opt["state"].values():
        out += [v.numpy().view(np.uint8).ravel() for k, v in state.items() if k != "step"]
    return [t for t in out if t.nbytes]


def on_threads(n: int, work: Callable[[list[int]], None], items: int) -> float:
    """Seconds for ``work`` over ``items`` indices split across ``n`` threads."""
    parts = [list(range(items))[k::n] for k in range(n)]
    threads = [threading.Thread(target=work, args=(p,)) for p in parts]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="bench_compress.py train's run")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    folders = args.dir.glob("a-checkpoint-*")
    folder = sorted(folders, key=lambda p: int(p.name.rsplit("-", 1)[1]))[-1]
    raw = tensors(folder)
    zstd, planes = blosc2.Codec.ZSTD, [blosc2.Filter.SHUFFLE]
    packed = [blosc2.compress2(t, typesize=4, clevel=1, codec=zstd, filters=planes) for t in raw]
    outs = [np.empty_like(t) for t in raw]
    blosc2.set_releasegil(True)

    def decode(idx: list[int]) -> None:
        for i in idx:
            blosc2.decompress2(packed[i], dst=outs[i], nthreads=1)

    def copy(idx: list[int]) -> None:
        for i in idx:
            np.copyto(outs[i], raw[i])

    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, work in (("decode", decode), ("copy", copy)):
            for n in (1, 2):
                times.setdefault(f"{name}, {n} thread(s)", []).append(on_threads(n, work, len(raw)))
    total = sum(t.nbytes for t in raw)
    print(f"{folder.name}: {len(raw)} tensors, {total / 1e6:.1f} MB, compressed to "
          f"{sum(map(len, packed)) / total:.4f}")  # fmt: skip
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"{name:22s} {ms:6.1f} ms  {total / ms / 1e6:5.2f} GB/s")


if __name__ == "__main__":
    main()
