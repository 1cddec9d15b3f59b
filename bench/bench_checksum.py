"""Checksum candidates on GPT-2 small's unique bytes, against the cost of a save.

Every candidate hashes each stored tensor separately (as weightvault does, one digest per
tensor), straight from the tensor's memory. In the same process and alternating with the
hashes, ``weightvault.torch.save(..., checksum=False)`` is timed with fsync (as shipped)
and with ``os.fsync`` patched to a no-op (page cache only, the stricter baseline), and
``checksum=True`` too, so the real in-save cost of xxh3_64 is measured directly.

Usage:
    python bench/bench_checksum.py [--quick] [--rounds 5] [--warmup 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zlib
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C
import blake3
import xxhash

import weightvault.torch as wv

ALGORITHMS: dict[str, Callable[[memoryview], object]] = {
    "zlib.crc32": zlib.crc32,
    "xxhash.xxh3_64": lambda b: xxhash.xxh3_64(b).digest(),
    "xxhash.xxh3_128": lambda b: xxhash.xxh3_128(b).digest(),
    "blake3 (1 thread)": lambda b: blake3.blake3(b).digest(),
    "blake3 (max_threads=AUTO)": lambda b: blake3.blake3(
        b, max_threads=blake3.blake3.AUTO
    ).digest(),
    "hashlib.sha256": lambda b: hashlib.sha256(b).digest(),
}
SAVES = (
    "save checksum=False, fsync",
    "save checksum=True, fsync",
    "save checksum=False, no fsync",
    "save checksum=True, no fsync",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT-2 with n_layer=2 (smoke run)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--dir", help="where to write the saves (default: a temp dir in /tmp)")
    args = ap.parse_args()

    model = C.build_model(args.quick)
    uniq = C.unique_buffers(model)
    total = sum(mv.nbytes for mv in uniq)
    folder = tempfile.mkdtemp(prefix="wv-bench-ck-", dir=args.dir)
    path = os.path.join(folder, "m.safetensors")

    def hasher(fn: Callable[[memoryview], object]) -> Callable[[], None]:
        def run() -> None:
            for mv in uniq:
                fn(mv)

        return run

    def saver(checksum: bool, fsync: bool) -> Callable[[], Any]:
        if fsync:
            return lambda: wv.save(model, path, checksum=checksum)

        def run() -> None:
            with C.no_fsync():
                wv.save(model, path, checksum=checksum)

        return run

    contenders: dict[str, Callable[[], Any]] = {n: hasher(f) for n, f in ALGORITHMS.items()}
    contenders[SAVES[0]] = saver(False, True)
    contenders[SAVES[1]] = saver(True, True)
    contenders[SAVES[2]] = saver(False, False)
    contenders[SAVES[3]] = saver(True, False)

    def unlink(_: str) -> None:
        if os.path.exists(path):
            os.unlink(path)

    try:
        samples = C.run_rounds(contenders, rounds=args.rounds, warmup=args.warmup, before=unlink)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    save_f = C.med(samples[SAVES[0]])
    save_n = C.med(samples[SAVES[2]])
    m = C.machine()
    print(
        f"machine: {m['nproc']} CPUs ({m['cpu']}), {m['ram_gib']} GiB RAM, python {m['python']}, "
        f"torch {m['torch']}, xxhash {m.get('xxhash')}, blake3 {m.get('blake3')}"
    )
    print(
        f"model: {'gpt2 n_layer=2' if args.quick else 'gpt2 (124M)'}, {len(uniq)} unique "
        f"tensors, {total / C.GB:.3f} GB; {args.rounds} rounds after {args.warmup} warm-up"
    )
    rows = []
    for name in ALGORITHMS:
        t = C.med(samples[name])
        rows.append(
            [
                name,
                f"{t * 1000:.1f}",
                f"{total / t / C.GB:.2f}",
                f"{t / save_f * 100:.1f}%",
                f"{t / save_n * 100:.1f}%",
            ]
        )
    print()
    print(
        C.table(
            rows,
            [
                "algorithm",
                "median ms",
                "GB/s",
                "% of save (fsync)",
                "% of save (no fsync)",
            ],
        )
    )
    print()
    rows = [[n, f"{C.med(samples[n]) * 1000:.1f}", C.spread(samples[n])] for n in SAVES]
    print(C.table(rows, ["weightvault.torch.save", "median ms", "min-max s"]))
    for tag, a, b in (("fsync", 0, 1), ("no fsync", 2, 3)):
        off, on = C.med(samples[SAVES[a]]), C.med(samples[SAVES[b]])
        print(
            f"measured in-save cost of xxh3_64 ({tag}): {(on - off) * 1000:+.1f} ms "
            f"= {(on - off) / off * 100:+.1f}% of checksum=False"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": m, "unique_bytes": total, "samples": samples}, f, indent=1)


if __name__ == "__main__":
    main()
