"""A ``training_state_last=1`` run: what its saves wait for, and what one gc costs.

With ``Vault(training_state_last=1)`` every save drops the training state of the
checkpoint before, and a gc frees it on the vault's background thread (paced to a tenth
of the run's time). Issue 20's byte-level GPT-2 goes on as a frozen-backbone fine-tune
(its last block and final norm train, AdamW at lr 1e-4, one step on the standard
library's source between saves, as ``bench_long_run.py``) for ``--saves`` checkpoints.
Printed: each save's call (median, 90th percentile, the slowest, and how many printed
that they wait for a gc), then one ``gc()`` of the finished vault, ``--rounds`` times
(the vault is in the page cache; nothing is left to free after the first).

    python3 -c "bytearray(8 << 30)"      # touch memory first
    PYTHONPATH=src .venv/bin/python bench/bench_gc.py --saves 300   # 2 min

To compare two versions of the code, run it with each one's ``src`` on ``PYTHONPATH``,
one after the other. Everything is written under one temporary folder, deleted at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import machine, med

from weightvault import Vault


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.waits = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.waits += "waiting for the gc" in record.getMessage()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--saves", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import _train_lm as T

    print(machine())
    count = _Count()
    logging.getLogger("weightvault").addHandler(count)
    folder = tempfile.mkdtemp(prefix="wv-bench-gc-")
    try:
        model = T.build()
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(("transformer.h.3.", "transformer.ln_f.")))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        batches = T.batches(T.text(), 0)
        vault = Vault(os.path.join(folder, "vault"), training_state_last=1)
        saves = []
        for _ in range(args.saves):
            batch = next(batches)
            model(batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
            t = time.perf_counter()
            vault.save(model, optimizer=opt)
            saves.append(time.perf_counter() - t)
        vault.wait()
        gcs = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            vault.gc()
            gcs.append(time.perf_counter() - t)
        ms = sorted(s * 1e3 for s in saves)
        print(f"optimizer lr {[g['lr'] for g in opt.param_groups]}")
        print(
            f"{args.saves} saves: median {statistics.median(ms):.1f} ms, 90th percentile "
            f"{ms[int(0.9 * len(ms))]:.1f} ms, slowest {ms[-1]:.1f} ms, all {sum(ms) / 1e3:.1f} s; "
            f"{count.waits} said they wait for a gc"
        )
        print(f"one gc of {args.saves} checkpoints: median {med(gcs) * 1e3:.0f} ms of {len(gcs)}")
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
