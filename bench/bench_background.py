"""Background vault saves: how long ``Vault.save(..., background=True)`` blocks the caller.

GPT-2 small with AdamW state (the weights plus ``exp_avg`` and ``exp_avg_sq``) is saved
with ``optimizer=``, ``scheduler=`` and ``rng=True``, synchronously and in the background,
in alternating rounds. Before every save the weights and optimizer state change (one AdamW
step on a tiny batch, untimed), so every save writes new objects. The background time is
only until the call returns (the snapshot copy of everything training can change); the
save then finishes in its thread, which the script waits for, untimed, before the next
round. Two workloads: everything trainable (the snapshot copies all 1.5 GB), and the
fine-tuning case with only the last block trainable (frozen tensors are not copied).

    .venv/bin/python bench/bench_background.py            # GPT-2 small
    .venv/bin/python bench/bench_background.py --quick    # a 2-layer GPT-2, for smoke runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import build_model, machine, med, run_rounds, spread

import weightvault
import weightvault.torch as wv


def workload(
    quick: bool, fine_tune: bool
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Any]:
    model = build_model(quick)
    if fine_tune:
        last = model.config.n_layer - 1  # type: ignore[union-attr]
        wv.freeze(model)
        wv.unfreeze(model, f"transformer.h.{last}.*", "transformer.ln_f.*")
    opt = torch.optim.AdamW(wv.trainable(model), lr=1e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    batch = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()

    return model, opt, sched, step


def measure(quick: bool, fine_tune: bool, rounds: int, root: str) -> dict[str, Any]:
    model, opt, sched, step = workload(quick, fine_tune)
    step()
    vault = weightvault.Vault(root)
    handles: list[Any] = []

    def sync() -> None:
        vault.save(model, optimizer=opt, scheduler=sched, rng=True)

    def background() -> None:
        handles.append(vault.save(model, optimizer=opt, scheduler=sched, rng=True, background=True))

    def after(name: str) -> None:
        while handles:
            handles.pop().wait()
        vault.retain(keep_last=1)
        vault.gc()
        step()  # new values, so the next save writes new objects

    times = run_rounds(
        {"sync": sync, "background": background}, rounds=rounds, warmup=1, after=after
    )
    trainable = sum(p.numel() * p.element_size() for p in wv.trainable(model))
    return {
        "workload": "last block trainable" if fine_tune else "all trainable",
        "trainable_MB": round(trainable / 1e6, 1),
        "snapshot_MB": round(3 * trainable / 1e6, 1),
        "sync_s": round(med(times["sync"]), 3),
        "sync_spread": spread(times["sync"]),
        "blocking_s": round(med(times["background"]), 3),
        "blocking_spread": spread(times["background"]),
        "ratio": round(med(times["background"]) / med(times["sync"]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = []
    for fine_tune in (False, True):
        root = tempfile.mkdtemp(prefix="wv-bg-")
        try:
            results.append(measure(args.quick, fine_tune, args.rounds, os.path.join(root, "v")))
        finally:
            shutil.rmtree(root)
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"machine": machine(), "rounds": args.rounds}))


if __name__ == "__main__":
    main()
