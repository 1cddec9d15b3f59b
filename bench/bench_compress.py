"""Compressed and delta vault objects on really trained weights (issue 20).

A byte-level GPT-2 (4 blocks x 256, vocabulary 256) is trained on the Python standard
library's source for 300 steps with AdamW: 200 steps at lr 1e-3 with a checkpoint every
20, then 100 at lr 3e-5 with one every 10 (``bench/_train_lm.py``). Each checkpoint is
written Trainer-style (``model.safetensors`` + ``torch.save`` of optimizer, scheduler and
RNG state, fsynced). Then, from those checkpoints:

- ``codecs``: numpy byte planes + ``zstandard`` against blosc2's shuffle + zstd, one core,
  on weights, AdamW moments, bf16 weights and XOR deltas between checkpoints;
- ``sizes``: each phase's 10 checkpoints saved into a vault that keeps the weights of
  every checkpoint and the full training state of the last (``training_state_last=1``),
  against the 10 Trainer-style folders; also with bf16 weights (fp32 master weights and
  moments as the optimizer state), and for several delta chain lengths K;
- ``bound``: how few bytes any coder that codes weights one by one could reach on the
  same run (``bench/_delta_bound.py``), and the 10-checkpoint ratio that implies;
- ``time``: a synchronous ``vault.save`` of model + optimizer + scheduler + RNG against
  ``save_model`` + ``torch.save(optimizer.state_dict())`` (both fsynced), the background
  save's blocking time, and a load against ``load_model``.

    PYTHONPATH=src .venv/bin/python bench/bench_compress.py all     # ~35 min on 2 cores

``all`` trains into a temporary folder and deletes it at the end; ``--dir`` keeps a
trained run between the other subcommands.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import _codec_compare as codecs
import _delta_bound as bound
import _train_lm as T
import numpy as np
import torch
from _common import machine, save_plain_files, table

from weightvault import Vault
from weightvault._vault.objects.encoding import DELTA_CHAIN
from weightvault._vault.objects.transforms import DIFFERENCE, XOR, make_delta


def disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _flat(tensors: list[torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def buffers(folder: Path) -> dict[str, tuple[bytes, int]]:
    """The checkpoint's weights (tie once), AdamW moments and bf16 weights, as bytes."""
    model, opt, _ = T.restore(folder)
    params = list(model.parameters())  # unique: the tied head is the embedding
    state = [opt.state[p] for p in params]
    return {
        "fp32 weights": (_flat([p.detach() for p in params]), 4),
        "fp32 exp_avg": (_flat([s["exp_avg"] for s in state]), 4),
        "fp32 exp_avg_sq": (_flat([s["exp_avg_sq"] for s in state]), 4),
        "bf16 weights": (_flat([p.detach().bfloat16() for p in params]), 2),
    }


def cmd_codecs(root: Path, rounds: int) -> list[dict[str, Any]]:
    a = T.checkpoints(root, "a")
    b = T.checkpoints(root, "b")
    last_a, prev_a = buffers(a[-1]), buffers(a[-2])
    last_b, prev_b = buffers(b[-1]), buffers(b[-2])
    data = dict(last_a)
    for label in ("fp32 weights", "fp32 exp_avg_sq", "bf16 weights"):
        k = last_a[label][1]
        for lr, new, old in (("1e-3", last_a, prev_a), ("3e-5", last_b, prev_b)):
            for kind, how in ((XOR, "XOR"), (DIFFERENCE, "difference")):
                delta = make_delta(memoryview(new[label][0]), old[label][0], kind, k)
                data[f"{label} {how} prev, lr {lr}"] = (bytes(delta), k)
    return codecs.compare(data, rounds)


def trainer_bytes(folders: list[Path], bf16: bool, scratch: Path) -> int:
    """What the Trainer's own folders take (written again in bf16 for that variant)."""
    if not bf16:
        return sum(disk(f) for f in folders)
    total = 0
    for f in folders:
        model, opt, sched = T.restore(f)
        half, master = T.as_bf16(model, opt)
        out = scratch / f"bf16-{f.name}"
        T.save_trainer_style(out, half, master, sched)
        total += disk(out)
        shutil.rmtree(out)
    return total


def vault_run(
    folders: list[Path], root: Path, bf16: bool, retain: bool = False, **options: Any
) -> dict[str, Any]:
    """Save every checkpoint into a new vault, with ``training_state_last=1`` (or, with
    ``retain``, a default vault and ``retain(training_state_last=1)`` after the saves);
    return its size once compaction settled, and the newest load time."""
    vault = Vault(root, training_state_last=None if retain else 1, **options)
    for f in folders:
        model, opt, sched = T.restore(f)
        if bf16:
            model, opt = T.as_bf16(model, opt)
        vault.save(model, optimizer=opt, scheduler=sched, rng=True)
    if retain:
        vault.retain(training_state_last=1)
    vault.gc()  # compacts, then frees the training state dropped from all but the newest
    size = vault.disk_bytes()
    model = T.build()
    if bf16:
        model = model.to(torch.bfloat16)
    loads = []
    for _ in range(3):
        t0 = time.perf_counter()
        vault.load(model, "latest")
        loads.append(time.perf_counter() - t0)
    # The oldest checkpoint's weights: a delta chain when it holds weights only (its
    # training state dropped), against load_model of the same checkpoint's own file.
    from safetensors.torch import load_model

    oldest = vault.list()[0].name
    old_vault: list[float] = []
    old_file: list[float] = []
    for _ in range(5):  # alternating, medians
        t0 = time.perf_counter()
        vault.load(model, oldest)
        old_vault.append(time.perf_counter() - t0)
        if not bf16:
            t0 = time.perf_counter()
            load_model(model, str(folders[0] / "model.safetensors"))
            old_file.append(time.perf_counter() - t0)
    return {
        "vault_bytes": size,
        "load_s": min(loads),
        "oldest_weights_load_s": sorted(old_vault)[2],
        "file_oldest_weights_load_s": sorted(old_file)[2] if old_file else None,
    }


def cmd_sizes(root: Path, scratch: Path, chains: list[int]) -> list[dict[str, Any]]:
    rows = []
    for phase, lr in (("a", "1e-3"), ("b", "3e-5")):
        folders = T.checkpoints(root, phase)
        for bf16 in (False, True):
            trainer = trainer_bytes(folders, bf16, scratch)
            runs = [(k, False) for k in (chains if not bf16 else [DELTA_CHAIN])]
            for k, retain in [*runs, (DELTA_CHAIN, True)]:
                target = scratch / f"vault-{phase}-{bf16}-{k}-{retain}"
                run = vault_run(folders, target, bf16, retain, delta_chain=k)
                shutil.rmtree(target)
                rows.append({
                    "lr": lr, "weights": "bf16" if bf16 else "fp32", "K": k,
                    "how": "retain afterwards" if retain else "training_state_last=1",
                    "checkpoints": len(folders), "trainer_bytes": trainer, **run,
                    "ratio": run["vault_bytes"] / trainer,
                })  # fmt: skip
                print(rows[-1], flush=True)
    return rows


def _fold(data: bytes) -> tuple[bytes, float]:
    """fp32 words as magnitudes (the estimator's input) and the sign's entropy in bits."""
    w = np.frombuffer(data, "<u4")
    p = float((w >> 31).mean())
    sign = 0.0 if p in (0.0, 1.0) else -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
    return (w & np.uint32(0x7FFFFFFF)).tobytes(), sign


def _full_floor(data: bytes) -> float:
    mag, sign = _fold(data)
    return bound.analyse(mag, wide=32)["fraction"] + sign / 32


def _pcodec(words: np.ndarray) -> float:
    """What pcodec (a second coder, independent of the estimator and of blosc2; level 8,
    its strongest) makes of ``words``, as a fraction of their bytes."""
    from pcodec import ChunkConfig, standalone

    return len(standalone.simple_compress(words, ChunkConfig(compression_level=8))) / words.nbytes


def cmd_bound(root: Path, scratch: Path) -> list[dict[str, Any]]:
    """Per phase: the estimate for each delta between consecutive fp32 checkpoints, and
    the least a 10-checkpoint vault (one full set of weights, nine deltas, the newest
    AdamW moments) could take against the Trainer-style folders; and what pcodec, a second
    coder, reaches on the same deltas and moments (a floor checked twice)."""
    rows = []
    for phase, lr in (("a", "1e-3"), ("b", "3e-5")):
        folders = T.checkpoints(root, phase)
        bufs = [buffers(f) for f in folders]
        weights = [b["fp32 weights"][0] for b in bufs]
        n = len(weights[0])
        deltas = []
        for i in range(1, len(weights)):
            d = bytes(make_delta(memoryview(weights[i]), weights[i - 1], DIFFERENCE, 4))
            before = (
                bytes(make_delta(memoryview(weights[i - 1]), weights[i - 2], DIFFERENCE, 4))
                if i > 1
                else None
            )
            deltas.append(bound.analyse(d, context=bound.context_of(weights[i - 1], before)))
        full = _full_floor(weights[0]) * n
        moments = sum(_full_floor(bufs[-1][k][0]) for k in ("fp32 exp_avg", "fp32 exp_avg_sq"))
        trainer = trainer_bytes(folders, False, scratch)
        # pcodec on the zigzag differences as integers, and on the floats themselves.
        pco_deltas = [
            _pcodec(
                np.frombuffer(
                    make_delta(memoryview(weights[i]), weights[i - 1], DIFFERENCE, 4), "<u4"
                )
            )
            for i in range(1, len(weights))
        ]
        pco_full = _pcodec(np.frombuffer(weights[0], "<f4"))
        pco_moments = sum(
            _pcodec(np.frombuffer(bufs[-1][k][0], "<f4"))
            for k in ("fp32 exp_avg", "fp32 exp_avg_sq")
        )

        fixed = full + moments * n  # the first weights and the newest moments

        def least(key: str) -> float:
            return (fixed + sum(d[key] for d in deltas) * n) / trainer  # noqa: B023

        rows.append({
            "lr": lr, "checkpoints": len(folders),
            "delta_fraction": [round(d["fraction"], 4) for d in deltas],
            "mean_bit_length": [round(d["mean_bit_length"], 2) for d in deltas],
            "low_bits_min_entropy": min(d["low_bits_min_entropy"] for d in deltas),
            "wide_share": max(d["wide_share"] for d in deltas),
            "full_weights_fraction": full / n, "moments_fraction": moments / 2,
            "least_ratio": least("fraction"),
            "least_ratio_with_context": least("fraction_with_context"),
            "least_ratio_length_free": least("fraction_length_free"),
            "pcodec_delta_fraction": [round(f, 4) for f in pco_deltas],
            "pcodec_ratio": (pco_full * n + pco_moments * n + sum(pco_deltas) * n) / trainer,
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def cmd_time(root: Path, scratch: Path, rounds: int) -> dict[str, Any]:
    """Sync save, background blocking and load, against save_model + torch.save.

    Each contender keeps one vault (or folder) for the whole run, as a training run does,
    and saves the checkpoints of the lr 1e-3 phase in order, so every save holds new
    values and a vault saves deltas against the one before; the first save is untimed.
    """
    states = [T.restore(f) for f in T.checkpoints(root, "a")[: rounds + 1]]
    names = ["save_model + torch.save", "vault", "vault, compression=None", "vault bg"]
    vaults = {
        n: Vault(scratch / f"time-{i}", compression=None if "None" in n else "blosc2")
        for i, n in enumerate(names[1:])
    }
    for vault in vaults.values():
        model, opt, sched = states[0]
        vault.save(model, optimizer=opt, scheduler=sched, rng=True)
    times: dict[str, list[float]] = {}
    for r in range(1, len(states)):
        model, opt, sched = states[r]
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            if name == "save_model + torch.save":
                save_plain_files(scratch / f"plain-{r}", model, opt)
            else:
                bg = name == "vault bg"
                handle = vaults[name].save(
                    model, optimizer=opt, scheduler=sched, rng=True, background=bg
                )
                if bg:
                    times.setdefault("vault bg, blocking", []).append(time.perf_counter() - t0)
                    handle.wait()
            times.setdefault(name, []).append(time.perf_counter() - t0)
            if name != "save_model + torch.save":
                vaults[name].wait()  # its compactor, untimed, before the next contender
    out = {name: min(ts) for name, ts in times.items()}
    out.update(_cpu_floor(*states[-1][:2], states[-2][0]))
    out.update(_load_times(states[-1][0], scratch, rounds))
    return out


def _cpu_floor(model: Any, opt: Any, parent: Any) -> dict[str, float]:
    """The CPU seconds any vault save of this checkpoint spends before it writes a byte:
    naming every tensor by its blake3 (content addressing) and compressing it (the
    weights as differences to the checkpoint before, the moments in full). CPU seconds of
    the whole process (blake3 and blosc2 use threads of their own), minimum of 3;
    divided by the cores, the least wall time a save can take."""
    from weightvault._vault.objects.address import content_hash
    from weightvault._vault.objects.codec import BLOCK, CODECS, DEFAULT, compress_block

    weights = [p.detach().contiguous().view(torch.uint8).numpy() for p in model.parameters()]
    old = [p.detach().contiguous().view(torch.uint8).numpy() for p in parent.parameters()]
    moments = [
        t.contiguous().view(torch.uint8).numpy()
        for st in opt.state.values()
        for t in st.values()
        if isinstance(t, torch.Tensor) and t.ndim > 0
    ]
    deltas = [
        memoryview(make_delta(memoryview(w), o.tobytes(), DIFFERENCE, 4))
        for w, o in zip(weights, old, strict=True)
    ]
    codec = CODECS[DEFAULT]

    def hashing() -> None:
        for a in [*weights, *moments]:
            content_hash(memoryview(a))

    def compressing() -> None:
        for buf in [*deltas, *(memoryview(m) for m in moments)]:
            for lo in range(0, buf.nbytes, BLOCK):
                compress_block(codec, buf[lo : lo + BLOCK], 4)

    spent = {}
    for name, fn in (("hash", hashing), ("compress", compressing)):
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            fn()
            best = min(best, time.process_time() - t0)
        spent[name] = best
    cores = os.cpu_count() or 1
    return {
        "cpu hash s": spent["hash"],
        "cpu compress s": spent["compress"],
        "cpu floor s (both, over all cores)": (spent["hash"] + spent["compress"]) / cores,
    }


def _load_times(model: Any, scratch: Path, rounds: int) -> dict[str, float]:
    """``vault.load`` (compressed, and raw objects) against safetensors' ``load_model``."""
    from safetensors.torch import load_model, save_model

    plain = scratch / "load.safetensors"
    save_model(model, str(plain))
    packed, raw = Vault(scratch / "load-vault"), Vault(scratch / "load-raw", compression=None)
    packed.save(model)
    raw.save(model)
    packed.wait()
    fresh = T.build()
    contenders = {
        "load_model": lambda: load_model(fresh, str(plain)),
        "vault.load": lambda: packed.load(fresh, "latest"),
        "vault.load, compression=None": lambda: raw.load(fresh, "latest"),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        order = list(contenders)[r % 3 :] + list(contenders)[: r % 3]
        for name in order:
            t0 = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - t0)
    out = {name: min(ts) for name, ts in times.items()}
    out["cpu decode s (over all cores)"] = _decode_floor(model)
    return out


def _decode_floor(model: Any) -> float:
    """The CPU seconds that decompressing and checksumming this model's compressed
    objects takes (minimum of 3), over the cores: the least a verified load of them can
    take before it copies a byte."""
    from weightvault._vault.objects.address import checksum
    from weightvault._vault.objects.codec import (
        BLOCK,
        CODECS,
        DEFAULT,
        compress_block,
        decompress_block,
    )

    codec = CODECS[DEFAULT]
    blocks = []
    for p in model.state_dict().values():
        raw = memoryview(p.contiguous().view(torch.uint8).numpy()).cast("B")
        for lo in range(0, raw.nbytes, BLOCK):
            part = raw[lo : lo + BLOCK]
            blocks.append((bytes(compress_block(codec, part, 4)), bytearray(part.nbytes)))
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for packed, out in blocks:
            decompress_block(codec.id, packed, memoryview(out), 4)
            checksum(out)
        best = min(best, time.process_time() - t0)
    return best / (os.cpu_count() or 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["train", "codecs", "sizes", "bound", "time", "all"])
    ap.add_argument("--dir", type=Path, help="the trained run (made by 'train')")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chains", default="0,1,2,4,8,16", help="delta chain lengths K to size")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    _ = bytearray(2 << 30)  # touch memory first: the VM's first touch of fresh pages is slow
    del _
    temp = args.dir is None
    root = args.dir or Path(tempfile.mkdtemp(prefix="wv-bench-compress-"))
    scratch = Path(tempfile.mkdtemp(prefix="wv-bench-scratch-"))
    results: dict[str, Any] = {"machine": machine()}
    try:
        if args.what in ("train", "all") and not T.checkpoints_exist(root):
            T.train(root, 200, 20, 100, 10)
        if args.what in ("codecs", "all"):
            results["codecs"] = cmd_codecs(root, args.rounds)
            rows = results["codecs"]
            print(table(
                [[r["tensors"], r["codec"], f"{r['ratio']:.3f}", f"{r['plane_bound']:.3f}",
                  f"{r['compress_gbs']:.2f}", f"{r['decompress_gbs']:.2f}",
                  f"{r['compress_gbs_wall']:.2f}", f"{r['decompress_gbs_wall']:.2f}"]
                 for r in rows],
                ["tensors", "codec", "ratio", "plane entropy", "compress GB/s (CPU)",
                 "decompress GB/s (CPU)", "compress (wall)", "decompress (wall)"],
            ), flush=True)  # fmt: skip
        if args.what in ("sizes", "all"):
            chains = [int(k) for k in args.chains.split(",")]
            results["sizes"] = cmd_sizes(root, scratch, chains)
        if args.what in ("bound", "all"):
            results["bound"] = cmd_bound(root, scratch)
        if args.what in ("time", "all"):
            results["time"] = cmd_time(root, scratch, args.rounds)
            print(json.dumps(results["time"], indent=1), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if temp:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
