"""Why a default vault's save of GPT-2 6 x 512 is slower in bench_vault_speed.py than one
with ``compaction=None``: the same save, timed right after the vault's compactor, 3 s
after it, and in a vault whose compactor never runs. In one process, alternating, medians.

Each round nudges every weight and moment a little (so every tensor is new, as after a
training step) and saves into each vault; after each save its compactor is waited for,
untimed (for the second contender, 3 s more pass before its next save).

    python3 -c "bytearray(8 << 30)"      # touch memory first
    PYTHONPATH=src .venv/bin/python bench/bench_save_after_compaction.py --rounds 6

Everything is written under one temporary folder, deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import med, quiesce, spread, table

from weightvault import Vault


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=256)
    model = GPT2LMHeadModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    model(ids, labels=ids).loss.backward()
    opt.step()
    print("optimizer lr:", sorted({g["lr"] for g in opt.param_groups}))
    root = Path(tempfile.mkdtemp(prefix="wv-bench-after-"))
    try:
        vaults = {
            "right after its compactor": Vault(root / "a"),
            "3 s after its compactor": Vault(root / "b"),
            "compaction=None (no compactor)": Vault(root / "c", compaction=None),
        }
        times: dict[str, list[float]] = {k: [] for k in vaults}
        names = list(vaults)
        for r in range(args.rounds + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-6)
                for state in opt.state.values():
                    state["exp_avg"].add_(1e-7)
            for name in names[r % 3 :] + names[: r % 3]:
                quiesce()
                t0 = time.perf_counter()
                vaults[name].save(model, optimizer=opt)
                if r:  # the first save fills an empty vault
                    times[name].append(time.perf_counter() - t0)
                vaults[name].wait()
                if name.startswith("3 s"):
                    time.sleep(3)
        base = med(times["compaction=None (no compactor)"])
        rows = [
            [n, f"{med(ts) * 1e3:.0f}", spread(ts), f"{med(ts) / base:.2f}x"]
            for n, ts in times.items()
        ]
        print(table(rows, ["save (model + optimizer)", "median ms", "spread s", "vs no compactor"]))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
