"""Opening a ``torch.save`` file: weightvault's reader against torch and safetensors.

GPT-2 small (``GPT2Config()``, random weights, no download) is written once as a
``torch.save`` state dict and once as a safetensors file; then, alternating in this one
process (the order rotating each round, after a warm-up round), each contender reads
every tensor of it:

- ``open_any + raw``: weightvault's reader of the ``.pt`` (``formats.open_any``), every
  stored tensor's bytes asked for (:meth:`Checkpoint.raw`);
- ``weightvault.torch.load_file``: the same file to a dict of torch tensors;
- ``torch.load(mmap=True)`` and ``torch.load(mmap=False)``, ``weights_only=True``;
- ``safetensors load_file``: ``safetensors.torch.load_file`` of the safetensors file;

and, filling a model in place, ``weightvault.torch.load`` of the ``.pt`` against
``safetensors.torch.load_model``. Every contender touches one byte of every page of
what it returns, so a mapping's lazily read pages are counted too.

Usage (touch memory first, so that page-cache and allocator state are alike):

    python3 -c "bytearray(8 << 30)"
    .venv/bin/python bench/bench_pt_open.py --rounds 9
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _common import build_model, machine, table

PAGE = 4096


def touch(values: Any) -> None:
    """Read one byte of every page of each tensor or buffer in ``values``."""
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.numel():
                flat = v.detach().reshape(-1).view(torch.uint8)
                int(flat[::PAGE].sum())
        else:
            view = memoryview(v).cast("B")
            sum(view[::PAGE])


def contenders(pt: str, st: str, model: torch.nn.Module) -> dict[str, Callable[[], None]]:
    from safetensors.torch import load_file, load_model

    import weightvault.torch as wvt
    from weightvault.formats import open_any

    def ours() -> None:
        with open_any(pt) as ckpt:
            touch([ckpt.raw(name) for name in ckpt.stored])

    def torch_load(mmap: bool) -> Callable[[], None]:
        return lambda: touch(torch.load(pt, weights_only=True, mmap=mmap).values())

    def wv_into() -> None:
        wvt.load(model, pt)
        touch(model.state_dict().values())

    def st_into() -> None:
        load_model(model, st)
        touch(model.state_dict().values())

    return {
        "open_any + raw (.pt)": ours,
        "weightvault.torch.load_file (.pt)": lambda: touch(wvt.load_file(pt).values()),
        "torch.load(mmap=True)": torch_load(True),
        "torch.load(mmap=False)": torch_load(False),
        "safetensors load_file": lambda: touch(load_file(st).values()),
        "weightvault.torch.load into a model (.pt)": wv_into,
        "safetensors load_model": st_into,
    }


def alternate(runs: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            gc.collect()
            t0 = time.perf_counter()
            runs[name]()
            if r:  # round 0 warms the page cache and the allocator
                times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="2 layers instead of 12")
    args = ap.parse_args()
    from safetensors.torch import save_model

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        model = build_model(args.quick)
        pt, st = os.path.join(tmp, "gpt2.pt"), os.path.join(tmp, "gpt2.safetensors")
        torch.save(model.state_dict(), pt)
        save_model(model, st)
        size = os.path.getsize(pt)
        touch(model.state_dict().values())
        load = os.getloadavg()
        times = alternate(contenders(pt, st, model), args.rounds)
    ref = statistics.median(times["safetensors load_file"])
    ref_model = statistics.median(times["safetensors load_model"])
    rows = []
    for name, ts in times.items():
        m = statistics.median(ts)
        into = "into a model" in name or "load_model" in name
        rows.append(
            [
                name,
                f"{m * 1e3:.1f}",
                f"{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}",
                f"{m / (ref_model if into else ref):.2f}x",
            ]
        )
    info = machine()
    print(f"GPT-2 {'2-layer' if args.quick else 'small'}, .pt of {size / 1e6:.0f} MB")
    print(f"{info['nproc']} cores, {info['cpu']}, torch {info['torch']}, rounds {args.rounds}")
    print(f"load average before {load}, after {os.getloadavg()}")
    print(table(rows, ["contender", "median ms", "range ms", "ratio"]))
    print("ratio: to safetensors load_file, or to load_model for the loads into a model")


if __name__ == "__main__":
    main()
