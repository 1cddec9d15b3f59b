"""``Vault.walk`` against one ``Vault.load`` per checkpoint, over a frozen-backbone run.

GPT-2 with 6 blocks of width 512 (vocabulary 50257, built from its config, no download),
fine-tuned with only the last block and ``ln_f`` trainable (AdamW at lr 1e-4, two steps
on random tokens between checkpoints), 10 checkpoints saved into a vault with its
defaults (background compaction: the older checkpoints become deltas on the newer ones),
settled with ``compact()`` as the end of training leaves it. Then, in one process,
alternating which goes first, ``--rounds`` times:

- ``loads``: ``vault.load(model, name)`` for each checkpoint, oldest first, into one model;
- ``walk``: ``for name, report in vault.walk(model)`` over the same checkpoints.

``--compression none`` makes every object raw (no deltas): the loads then copy bytes
only, and the walk's saving is the copies alone.

Both load into the same model and make the same checks (``verify=True``); the walk
copies, after the first checkpoint, only the tensors whose object changed. Each contender's
state is checked equal at the end of every round. Prints the medians and the ratio, and
the bytes each copies per checkpoint.

    python3 -c "bytearray(8 << 30)"      # touch memory first
    PYTHONPATH=src .venv/bin/python bench/bench_walk.py --rounds 5
    PYTHONPATH=src .venv/bin/python bench/bench_walk.py --rounds 5 --compression none
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

import weightvault

SHAPE = {"n_layer": 6, "n_embd": 512, "n_head": 8, "n_positions": 256}
CHECKPOINTS = 10


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**SHAPE))
    model.requires_grad_(False)
    model.transformer.h[-1].requires_grad_(True)
    model.transformer.ln_f.requires_grad_(True)
    return model


def fine_tune(vault: weightvault.Vault, steps: int) -> list[str]:
    model = gpt2().train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)
    names = []
    for _ in range(CHECKPOINTS):
        for _ in range(steps):
            batch = torch.randint(0, model.config.vocab_size, (4, 64), generator=g)
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        names.append(vault.save(model).name)
    vault.wait()
    vault.compact()
    return names


def copied_bytes(vault: weightvault.Vault, names: list[str]) -> list[int]:
    """Bytes the walk copies at each checkpoint: everything first, then what changed."""
    out, before = [], None
    for name in names:
        with vault.open(name) as ckpt:
            objects, sizes = ckpt.objects, {s: i.nbytes for s, i in ckpt.stored.items()}
        out.append(
            sum(sizes[s] for s, d in objects.items() if before is None or before.get(s) != d)
        )
        before = objects
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a tiny model, for a smoke run")
    parser.add_argument(
        "--compression", default="blosc2", help="the vault's compression ('none': raw objects)"
    )
    args = parser.parse_args()
    if args.quick:
        SHAPE.update(n_layer=2, n_embd=64, n_head=2, vocab_size=256)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="wv-walk-") as scratch:
        codec = None if args.compression == "none" else args.compression
        vault = weightvault.Vault(Path(scratch) / "run", compression=codec)
        names = fine_tune(vault, args.steps)
        model = gpt2().eval()
        times: dict[str, list[float]] = {"loads": [], "walk": []}

        def loads() -> None:
            for name in names:
                vault.load(model, name)

        def walk() -> None:
            for _ in vault.walk(model):
                pass

        runs = {"loads": loads, "walk": walk}
        with torch.no_grad():
            for r in range(args.rounds + 1):  # the first round warms the page cache
                order = ["loads", "walk"] if r % 2 == 0 else ["walk", "loads"]
                ends = {}
                for label in order:
                    t = time.perf_counter()
                    runs[label]()
                    took = time.perf_counter() - t
                    ends[label] = {k: v.clone() for k, v in model.state_dict().items()}
                    if r:
                        times[label].append(took)
                assert all(torch.equal(ends["loads"][k], v) for k, v in ends["walk"].items())
        per = copied_bytes(vault, names)
        med = {k: statistics.median(v) for k, v in times.items()}
        out = {
            "model_bytes": per[0],
            "copied_bytes_per_checkpoint_after_the_first": per[1],
            "loads_s": round(med["loads"], 4),
            "walk_s": round(med["walk"], 4),
            "walk_over_loads": round(med["walk"] / med["loads"], 3),
            "compression": args.compression,
            "rounds": {k: [round(x, 4) for x in v] for k, v in times.items()},
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        }
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
