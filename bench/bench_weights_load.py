"""A verified weights-only load of a vault's newest checkpoint against safetensors'
``load_model`` of the same weights.

GPT-2 6 x 512 from its config (``GPT2Config(n_layer=6, n_embd=512, n_head=8)``, seed 0,
no download), two AdamW steps on seeded random tokens so the weights are not their
initial values. The weights go into one safetensors file (``save_model``) and into two
vaults with ``Vault.save(model, optimizer=)``: one left raw (``compaction=None``) and one
settled with ``compact()`` (the newest then compressed). Timed in one process, the
contenders alternating in each round, into a second model (seed 1):

- ``load_model``: ``safetensors.torch.load_model(model, path)``;
- ``vault raw``: ``Vault(root).load(model, "latest")`` (``verify=True``, the default);
- ``vault settled``: the same, from the compacted vault.

Each load is checked bitwise against the saved weights. Printed: each contender's median
(min-max) in ms and its ratio to ``load_model``'s median.

    python3 -c "bytearray(8 << 30)"      # touch memory first
    PYTHONPATH=src .venv/bin/python bench/bench_weights_load.py --rounds 21
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from transformers import GPT2Config, GPT2LMHeadModel

import weightvault

CONFIG = {"n_layer": 6, "n_embd": 512, "n_head": 8}


def _model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--dir", help="scratch folder (default: a temporary one)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="wv-weights-"))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    try:
        model = _model(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(0)
        for _ in range(2):
            ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        save_model(model, str(root / "model.safetensors"))
        raw = weightvault.Vault(root / "raw", create=True, compaction=None)
        raw.save(model, optimizer=opt)
        settled = weightvault.Vault(root / "settled", create=True, compaction=None)
        settled.save(model, optimizer=opt)
        settled.compact()
        fresh = _model(1)
        want = {k: v.clone() for k, v in model.state_dict().items()}

        contenders: dict[str, Callable[[], object]] = {
            "load_model": lambda: load_model(fresh, str(root / "model.safetensors")),
            "vault raw": lambda: weightvault.Vault(root / "raw", compaction=None).load(fresh),
            "vault settled": lambda: weightvault.Vault(root / "settled", compaction=None).load(
                fresh
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in contenders}
        for fn in contenders.values():
            fn()  # warm: page cache, threads, imports
        names = list(contenders)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                fresh.load_state_dict(_model(1).state_dict())  # not the answer already
                t0 = time.perf_counter()
                contenders[name]()
                times[name].append(time.perf_counter() - t0)
                got = fresh.state_dict()
                if not all(torch.equal(got[k], v) for k, v in want.items()):
                    raise SystemExit(f"{name}: the weights differ from the saved ones")
        base = statistics.median(times["load_model"])
        print(
            f"GPT-2 6 x 512, {sum(p.numel() for p in model.parameters()):,} parameters; "
            f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
            f"torch threads {torch.get_num_threads()}; {args.rounds} rounds"
        )
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"  {name:14} {med * 1e3:7.1f} ms ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})"
                f"  {med / base:.2f}x"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
