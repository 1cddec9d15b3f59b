"""What reading a vault's records costs as it grows: "latest", and a compaction's order.

A vault of ``--records`` checkpoints of issue 20's byte-level GPT-2 with its AdamW state
(records of 85 KB: 70 tensors and their moments), written fast (``compression=None``,
``compaction=None``: only the records matter here). Timed, alternating, medians:

- ``list_records``: every record read whole and parsed (what ``vault.list()`` does, and
  what each compaction pass did to order the checkpoints before section 26);
- ``creation_order``: the first 512 bytes of each record (what ``"latest"`` reads);
- ``compaction's order``: ``_Records(store)``, the view a compaction pass starts from;
- ``resolve("latest")``: the starts, and the newest record whole.

    PYTHONPATH=src .venv/bin/python bench/bench_records.py --records 300   # ~30 s

Everything is written under one temporary folder, deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

from _common import machine, med, table

from weightvault import Vault
from weightvault._vault.records.names import record_key
from weightvault._vault.records.order import creation_order, resolve
from weightvault._vault.records.reading import list_records
from weightvault._vault.upkeep.records_cache import Records as _Records


def fill(root: str, records: int) -> Vault:
    """``records`` checkpoints of the lm model and its AdamW state, one step apart."""
    import _train_lm as T

    model = T.build()
    opt = T.optimizer(model, 1e-4)
    batch = next(T.batches(T.text(), 0))
    vault = Vault(root, compression=None, compaction=None)
    for _ in range(records):
        model(batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        vault.save(model, optimizer=opt)
    return vault


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--records", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    print(machine())
    folder = tempfile.mkdtemp(prefix="wv-bench-records-")
    try:
        vault = fill(os.path.join(folder, "vault"), args.records)
        store = vault.store
        size = store.size(record_key(vault.list()[0].name))
        steps: dict[str, Callable[[], Any]] = {
            "list_records (every record whole)": lambda: list_records(store),
            "creation_order (512 bytes of each)": lambda: creation_order(store),
            "a compaction pass's order (_Records)": lambda: _Records(store),
            'resolve("latest")': lambda: resolve(store, "latest"),
        }
        # The oracle: the same order either way.
        assert [r.name for r in list_records(store)] == _Records(store).names
        times: dict[str, list[float]] = {k: [] for k in steps}
        for r in range(args.rounds):
            for name in steps if r % 2 == 0 else reversed(steps):
                t = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - t)
        print(f"{args.records} records of {size / 1e3:.1f} KB each, medians of {args.rounds}")
        rows = [[k, f"{med(v) * 1e3:.2f}"] for k, v in times.items()]
        print(table(rows, ["what", "ms"]))
    finally:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
