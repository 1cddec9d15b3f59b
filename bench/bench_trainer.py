"""The Hugging Face Trainer's own checkpoint folders against ``VaultCallback``.

GPT-2 small (random weights, tied head) with its lowest 6 blocks frozen is fine-tuned for
a few steps with AdamW, saving every ``--save-steps`` steps: once with the Trainer's own
``checkpoint-N`` folders, once with ``VaultCallback`` (nothing else changes). Reported:
the disk bytes each leaves behind and the time each save takes inside the training loop
(the Trainer's ``_save_checkpoint``, the callback's ``on_step_end``), also with
``VaultCallback(background=True)``, where the step waits only for the snapshot. The runs'
final parameters are compared bitwise.

    .venv/bin/python bench/bench_trainer.py            # GPT-2 small, 6 steps, 3 saves
    .venv/bin/python bench/bench_trainer.py --quick    # a 2-layer GPT-2, for smoke runs
    .venv/bin/python bench/bench_trainer.py --steps 20 --save-steps 2 --training-state-last 1
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

import torch
from _common import build_model, machine
from transformers import Trainer, TrainingArguments

import weightvault
import weightvault.torch as wv
from weightvault.integrations.transformers import VaultCallback


def model(quick: bool) -> torch.nn.Module:
    m = build_model(quick).train()
    frozen = 1 if quick else 6
    wv.freeze(m, *(f"transformer.h.{i}.*" for i in range(frozen)))
    return m


def data(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 50257, (32,), generator=g) for _ in range(n)]
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class TimedCallback(VaultCallback):
    times: list[float]

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        saving = control.should_save
        t = time.perf_counter()
        out = super().on_step_end(args, state, control, **kwargs)
        if saving:
            self.times.append(time.perf_counter() - t)
        return out


def run(
    quick: bool,
    steps: int,
    save_steps: int,
    root: Path,
    vault: bool,
    background: bool = False,
    last: int | None = None,
) -> dict[str, Any]:
    m = model(quick)
    args = TrainingArguments(
        output_dir=str(root / "out"), max_steps=steps, save_steps=save_steps,
        per_device_train_batch_size=1, learning_rate=1e-4, weight_decay=0.1, warmup_steps=2,
        report_to=[], use_cpu=True, seed=0, logging_steps=1000, disable_tqdm=True,
    )  # fmt: skip
    times: list[float] = []
    callbacks = []
    if vault:
        store = weightvault.Vault(root / "vault", training_state_last=last)
        cb = TimedCallback(store, background=background)
        cb.times = times
        callbacks.append(cb)
    trainer = Trainer(model=m, args=args, train_dataset=data(steps), callbacks=callbacks)
    if not vault:
        original = trainer._save_checkpoint

        def timed(*a: Any, **k: Any) -> None:
            t = time.perf_counter()
            original(*a, **k)
            times.append(time.perf_counter() - t)

        trainer._save_checkpoint = timed  # type: ignore[method-assign]
    trainer.train()
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    return {
        "disk_bytes": disk(root),
        "saves": len(times),
        "save_s": times,
        "params": params,
        "trainable_bytes": sum(p.numel() * p.element_size() for p in wv.trainable(m)),
        "total_bytes": sum(p.numel() * p.element_size() for p in m.parameters()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-steps", type=int, default=2)
    ap.add_argument(
        "--training-state-last", type=int, default=None, metavar="N",
        help="keep the weights of every checkpoint, the full training state of the last N",
    )  # fmt: skip
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    last = a.training_state_last
    root = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    try:
        own = run(a.quick, a.steps, a.save_steps, root / "own", vault=False)
        ours = run(a.quick, a.steps, a.save_steps, root / "vault", vault=True, last=last)
        bg = run(
            a.quick, a.steps, a.save_steps, root / "bg", vault=True, background=True, last=last
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    same = all(
        torch.equal(v, ours["params"][k]) and torch.equal(v, bg["params"][k])
        for k, v in own["params"].items()
    )
    print(machine())
    print(f"GPT-2 {'2-layer' if a.quick else 'small'}: {own['total_bytes'] / 1e6:.0f} MB of "
          f"weights, {own['trainable_bytes'] / 1e6:.0f} MB trainable; {a.steps} steps, "
          f"a save every {a.save_steps}")  # fmt: skip
    print(f"{'':26}{'disk MB':>10}{'saves':>7}  save seconds each")
    rows = (("Trainer folders", own), ("VaultCallback", ours), ("VaultCallback background", bg))
    for label, r in rows:
        each = " ".join(f"{t:.2f}" for t in r["save_s"])
        print(f"{label:26}{r['disk_bytes'] / 1e6:10.0f}{r['saves']:7}  {each}")
    print(f"vault / Trainer folders: {ours['disk_bytes'] / own['disk_bytes']:.3f}; "
          f"training_state_last={last}")  # fmt: skip
    print(f"disk ratio {own['disk_bytes'] / ours['disk_bytes']:.2f}x; final parameters "
          f"bitwise equal: {same}")  # fmt: skip
    if a.json:
        keep = ("disk_bytes", "saves", "save_s", "trainable_bytes", "total_bytes")
        runs = (("trainer", own), ("vault", ours), ("background", bg))
        doc = {k: {f: r[f] for f in keep} for k, r in runs}
        Path(a.json).write_text(json.dumps({**doc, "equal": same, "machine": machine()}))


if __name__ == "__main__":
    main()
