"""How fast this machine can decode a compressed checkpoint, against copying it raw.

What bounds "a settled vault's compressed newest loads within 1.5x of a raw one" (issue
27): a raw load copies each tensor's bytes once, a compressed one decodes them, and both
spread the work over the load's threads. This times the kernels alone, without any of
weightvault's own code: blosc2 (byte planes + zstd 1, the vault's full objects) decoding
the newest lm checkpoint (weights and AdamW moments), pcodec (a second, independent
coder) decoding the same bytes as 32-bit words, and numpy copying them, each on one
thread and on two, alternating, medians. ``--gpt2`` does the same for GPT-2 6 x 512 and
its AdamW after ``--steps`` training steps (``bench_vault_speed.py``'s run), in the
vault's 4 MiB blocks.

    PYTHONPATH=src .venv/bin/python bench/bench_compress.py train --dir /tmp/wv-lm   # once
    PYTHONPATH=src .venv/bin/python bench/bench_decode_floor.py --dir /tmp/wv-lm
    PYTHONPATH=src .venv/bin/python bench/bench_decode_floor.py --gpt2               # 1 min
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
    return [t for t in out + moments(opt) if t.nbytes]


def moments(state_dict: dict) -> list[np.ndarray]:
    """An optimizer state dict's tensors other than its step counts, as bytes."""
    return [
        v.numpy().view(np.uint8).ravel()
        for state in state_dict["state"].values()
        for k, v in state.items()
        if k != "step"
    ]


def gpt2_tensors(steps: int) -> list[np.ndarray]:
    """GPT-2 6 x 512's fp32 weights and AdamW moments after ``steps`` steps, as bytes."""
    from bench_vault_speed import gpt2_states

    model, opt = next(gpt2_states(steps))
    # Parameters, not the state dict: the tied head is one tensor, stored once.
    out = [p.detach().numpy().view(np.uint8).ravel() for p in model.parameters()]
    return [t for t in out + moments(opt.state_dict()) if t.nbytes]


def blocks(arrays: list[np.ndarray], size: int) -> list[np.ndarray]:
    """``arrays`` cut into blocks of ``size`` bytes, as the vault compresses them."""
    return [a[lo : lo + size] for a in arrays for lo in range(0, a.nbytes, size)]


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
    ap.add_argument("--dir", type=Path, help="bench_compress.py train's run")
    ap.add_argument("--gpt2", action="store_true", help="GPT-2 6 x 512 instead of --dir's run")
    ap.add_argument("--steps", type=int, default=2, help="--gpt2's training steps")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    if args.gpt2:
        what, raw = "GPT-2 6 x 512", blocks(gpt2_tensors(args.steps), 4 << 20)
    elif args.dir is not None:
        folders = args.dir.glob("a-checkpoint-*")
        folder = sorted(folders, key=lambda p: int(p.name.rsplit("-", 1)[1]))[-1]
        what, raw = folder.name, tensors(folder)
    else:
        ap.error("give --dir (the lm run) or --gpt2")
    zstd, planes = blosc2.Codec.ZSTD, [blosc2.Filter.SHUFFLE]
    packed = [blosc2.compress2(t, typesize=4, clevel=1, codec=zstd, filters=planes) for t in raw]
    outs = [np.empty_like(t) for t in raw]
    blosc2.set_releasegil(True)
    # A second, independent coder: pcodec on the same bytes as 32-bit words (it codes the
    # vault's deltas; here whole objects, as a full object on it would be).
    from pcodec import ChunkConfig, standalone

    words = [standalone.simple_compress(t.view(np.uint32), ChunkConfig()) for t in raw]

    def decode(idx: list[int]) -> None:
        for i in idx:
            blosc2.decompress2(packed[i], dst=outs[i], nthreads=1)

    def decode_pcodec(idx: list[int]) -> None:
        for i in idx:
            standalone.simple_decompress_into(words[i], outs[i].view(np.uint32))

    def copy(idx: list[int]) -> None:
        for i in idx:
            np.copyto(outs[i], raw[i])

    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, work in (("decode", decode), ("pcodec decode", decode_pcodec), ("copy", copy)):
            for n in (1, 2):
                times.setdefault(f"{name}, {n} thread(s)", []).append(on_threads(n, work, len(raw)))
    total = sum(t.nbytes for t in raw)
    print(f"{what}: {len(raw)} tensors or blocks, {total / 1e6:.1f} MB, compressed to "
          f"{sum(map(len, packed)) / total:.4f} (blosc2), "
          f"{sum(map(len, words)) / total:.4f} (pcodec)")  # fmt: skip
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"{name:29s} {ms:6.1f} ms  {total / ms / 1e6:5.2f} GB/s")


if __name__ == "__main__":
    main()
