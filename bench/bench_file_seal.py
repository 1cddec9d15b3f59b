"""What a single file's header checksum costs a save and a load: GPT-2 small.

Two contenders in one process, alternating (the order rotates each round, after one
warm-up round):

- ``sealed``: the code as it is: ``weightvault.torch.save`` writes the header with its
  ``weightvault.header_sum`` (manifest version 2) and ``load`` checks it before anything;
- ``unsealed``: the code as it was, by a patch: the writer encodes the header without a
  sum at manifest version 1, byte for byte what weightvault wrote before, and a load of
  such a file has no sum to check.

Per round and contender: a timed ``save(model, path)`` of GPT-2 small (transformers
``GPT2Config()``, random weights, no download; about 500 MB), then a timed
``load(fresh, path)`` into a second model (``verify=False``, the default, and then
``verify=True``). The sum's own work is timed apart, in microseconds, on the headers of
GPT-2, GPT-2 with AdamW state and RNG (``rng=True``), and 20,000 small tensors, against
the parse the reader does anyway.

Usage::

    python3 -c "bytearray(8 << 30)"     # touch memory first
    .venv/bin/python bench/bench_file_seal.py --rounds 7
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np
import torch
from _common import build_model, quiesce

import weightvault.numpy as wvn
import weightvault.torch as wvt
from weightvault._file import header as _header, writer as _writer
from weightvault._file.manifest import read_manifest


@contextlib.contextmanager
def sealed(on: bool) -> Iterator[None]:
    """With ``on`` false, the writer as it was: no sum, manifest version 1."""
    encode, version = _writer.encode_header, _writer.FORMAT_VERSION

    def unsealed_encode(*args: Any, **kwargs: Any) -> bytes:
        return encode(*args, **{**kwargs, "seal": False})

    try:
        if not on:
            _writer.encode_header = unsealed_encode  # type: ignore[assignment]
            _writer.FORMAT_VERSION = 1  # type: ignore[misc]
        yield
    finally:
        _writer.encode_header = encode  # type: ignore[assignment]
        _writer.FORMAT_VERSION = version  # type: ignore[misc]


def _one(model: Any, fresh: Any, path: Path, on: bool) -> tuple[float, float, float]:
    with sealed(on):
        quiesce()
        t0 = time.perf_counter()
        wvt.save(model, path)
        saved = time.perf_counter() - t0
        assert path.read_bytes()[8:].startswith(_header.SEAL_PREFIX) == on
        quiesce()
        t0 = time.perf_counter()
        wvt.load(fresh, path)
        loaded = time.perf_counter() - t0
        quiesce()
        t0 = time.perf_counter()
        wvt.load(fresh, path, verify=True)
        verified = time.perf_counter() - t0
    return saved, loaded, verified


def _header_of(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


def _median_us(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _micro(scratch: Path, model: Any) -> list[tuple[str, int, float, float, float]]:
    """Per header: its bytes, sealing it, checking its sum, and the whole read of the
    header and manifest that a load does (the check included), in microseconds."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    files = {
        "GPT-2 small": lambda p: wvt.save(model, p),
        "GPT-2 small + AdamW + rng": lambda p: wvt.save(model, p, optimizer=opt, rng=True),
        "20,000 small tensors": lambda p: wvn.save(
            {
                f"layer{i // 10}.block{i % 10}.weight": np.full(3, i, np.float32)
                for i in range(20000)
            },
            p,
        ),
    }
    out = []
    for what, save in files.items():
        path = scratch / "micro.safetensors"
        save(path)
        raw = _header_of(path)
        size = path.stat().st_size
        encoded = struct.pack("<Q", len(raw)) + raw
        zeroed = encoded[: 8 + len(_header.SEAL_PREFIX)] + b"0" * 32
        zeroed += encoded[8 + len(_header.SEAL_PREFIX) + 32 :]

        def parse(raw: bytes = raw, size: int = size) -> None:
            h = _header.parse_header(raw, size, "x")
            read_manifest(h.metadata, h.tensors, "x", sealed=h.sealed)

        repeat = 200 if len(raw) < 1 << 20 else 20
        seal = _median_us(lambda z=zeroed: _header.seal_header(z), repeat)
        check = _median_us(lambda r=raw: _header.check_header_sum(r, "x"), repeat)
        out.append((what, len(raw), seal, check, _median_us(parse, repeat)))
        path.unlink()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    model, fresh = build_model(False, seed=0), build_model(False, seed=1)
    names = ["sealed", "unsealed"]
    kinds = ["save", "load", "load verify=True"]
    times: dict[str, dict[str, list[float]]] = {n: {k: [] for k in kinds} for n in names}
    scratch = Path(tempfile.mkdtemp(prefix="bench_file_seal.", dir=args.dir))
    try:
        for r in range(args.rounds + 1):
            for name in names[r % 2 :] + names[: r % 2]:
                path = scratch / f"{name}.safetensors"
                got = _one(model, fresh, path, name == "sealed")
                if r:  # the first round warms up
                    for kind, seconds in zip(kinds, got, strict=True):
                        times[name][kind].append(seconds)
                path.unlink()
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
            assert torch.equal(a, b)
        micro = _micro(scratch, model)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"GPT-2 small (GPT2Config()), {args.rounds} rounds alternating (medians, seconds)")
    for kind in kinds:
        on, off = (statistics.median(times[n][kind]) for n in names)
        spread = {n: (min(times[n][kind]), max(times[n][kind])) for n in names}
        print(
            f"  {kind:17} sealed {on:.4f} ({spread['sealed'][0]:.4f}-{spread['sealed'][1]:.4f})"
            f"  unsealed {off:.4f} ({spread['unsealed'][0]:.4f}-{spread['unsealed'][1]:.4f})"
            f"  ratio {on / off:.4f}"
        )
    print("the sum's own work (medians, microseconds):")
    print(f"  {'header':28} {'bytes':>10} {'seal':>8} {'check':>8} {'read':>10}")
    for what, nbytes, seal, check, parse in micro:
        print(f"  {what:28} {nbytes:10d} {seal:8.1f} {check:8.1f} {parse:10.1f}")


if __name__ == "__main__":
    main()
