"""A frozen-backbone fine-tune's incremental vault save against a full ``save_model``.

GPT-2 with 6 blocks of width 512 (``bench_vault_speed.py``'s shape: vocabulary 50257,
256 positions, 172 MB of fp32 weights, the embedding tied to the head), only the last
block and ``ln_f`` trainable, AdamW at lr 1e-4, trained on the Python standard library's
source read as bytes (``--steps`` steps between checkpoints). At each of the 10
checkpoints of a round the two contenders save the same weights, in an order that
rotates, each after ``gc.collect()`` and ``os.sync()``:

- ``save_model + fsync``: ``safetensors.torch.save_model(model, path)``, then an fsync of
  the file and of its folder (what makes it survive a crash);
- ``vault.save``: ``Vault.save(model)``, synchronous: every tensor hashed, the new objects
  written and made durable, the record committed. After the save returns a crash never
  loses the checkpoint, as after the fsync of the file. Its compactor then runs and is
  waited for, untimed.

Each round starts a new vault and a new model (the same seed); its first checkpoint is
the vault's full save and is reported apart, checkpoints 2 to 10 are the incremental
saves. ``--phases`` also times the parts of each vault save (hash, the store's syncs,
the record), which slows nothing measurable but adds a line per part.

    python3 -c "bytearray(8 << 30)"      # touch memory first
    PYTHONPATH=src .venv/bin/python bench/bench_frozen_save.py --rounds 5
    PYTHONPATH=src .venv/bin/python bench/bench_frozen_save.py --rounds 2 --phases

Everything is written under one temporary folder (``--scratch``), deleted at the end.
The machine may be shared: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, os.path.dirname(__file__))

from _common import fsync_path, machine
from bench_vault_speed import CHECKPOINTS, SHAPE, gpt2_model, gpt2_states

from weightvault import Vault

# The model, its shape (``--tiny`` makes a smoke test of the script) and its training
# are bench_vault_speed.py's GPT-2 run, with the final norm trainable too.
FULL, VAULT = "save_model + fsync", "vault.save"


def build() -> tuple[Any, Any]:
    """The model, frozen but for its last block and ``ln_f``, and its AdamW."""
    return gpt2_model(frozen=True, ln_f=True)


def states(steps: int) -> Iterator[tuple[int, Any]]:
    """The model after each of the 10 checkpoints' ``steps`` training steps."""
    for k, (model, _) in enumerate(gpt2_states(steps, frozen=True, ln_f=True)):
        yield k, model


def settings(steps: int, rounds: int) -> dict[str, Any]:
    model, _ = build()
    unique = {id(p): p for p in model.parameters()}.values()
    trainable = [p for p in unique if p.requires_grad]
    return {
        "shape": dict(SHAPE),
        "parameters": sum(p.numel() for p in unique),
        "trainable parameters": sum(p.numel() for p in trainable),
        "trainable bytes": sum(p.numel() * p.element_size() for p in trainable),
        "dtypes": sorted({str(t.dtype) for t in model.state_dict().values()}),
        "state_dict bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
        "checkpoints per round": CHECKPOINTS,
        "rounds": rounds,
        "training steps between checkpoints": steps,
        "optimizer": "AdamW lr 1e-4 (optimizer state not saved: weights only)",
    }


class Phases:
    """Wall time of named functions, summed per vault save (``--phases``)."""

    NAMES: ClassVar[dict[str, list[str]]] = {
        "weightvault._vault.writing.save": ["_address", "_store", "_checksum_rest", "_record_doc"],
        "weightvault._vault.writing.commit": ["begin", "commit_record", "release"],
        "weightvault._base.atomic": ["syncfs", "fsync_all", "fsync_file", "fsync_dir"],
        "weightvault._vault.store.backend": ["fsync_dir", "sync_paths"],
        "os": ["fsync"],
    }

    def __init__(self) -> None:
        import importlib

        self.now: dict[str, float] = {}
        self.active = False
        self.saves: list[dict[str, float]] = []
        for module, names in self.NAMES.items():
            mod = importlib.import_module(module)
            for name in names:
                self._wrap(mod, name)
        # save.py imported some of these by name: wrap its copies too.
        import weightvault._vault.writing.save as save_mod

        for name in ("begin", "commit_record", "release", "plan"):
            self._wrap(save_mod, name)
        from weightvault._vault.store.backend import LocalStore

        self._wrap(LocalStore, "publish")

    def _wrap(self, mod: Any, name: str) -> None:
        fn = getattr(mod, name)
        if getattr(fn, "_timed", False):
            return
        label = name if mod.__name__ != "os" else "os.fsync"

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.active:
                    self.now[label] = self.now.get(label, 0.0) + time.perf_counter() - t0

        timed._timed = True  # type: ignore[attr-defined]
        setattr(mod, name, timed)

    def start(self) -> None:
        self.now = {}
        self.active = True

    def stop(self) -> None:
        self.active = False
        self.saves.append(self.now)
        self.now = {}

    def medians(self) -> dict[str, float]:
        names = sorted({n for s in self.saves for n in s})
        return {n: statistics.median(s.get(n, 0.0) for s in self.saves) for n in names}


def one_round(scratch: Path, steps: int, r: int, phases: Phases | None) -> dict[str, list[float]]:
    from safetensors.torch import save_model

    times: dict[str, list[float]] = {FULL: [], VAULT: []}
    vault = Vault(scratch / f"vault-{r}")
    path = scratch / "full.safetensors"

    def full(model: Any) -> None:
        save_model(model, str(path))
        fsync_path(str(path))

    def incremental(model: Any) -> None:
        vault.save(model)

    run: dict[str, Callable[[Any], None]] = {FULL: full, VAULT: incremental}
    for k, model in states(steps):
        for name in [*times][(k + r) % 2 :] + [*times][: (k + r) % 2]:
            gc.collect()
            os.sync()
            timing = phases is not None and name == VAULT and k > 0
            if timing:
                phases.start()  # type: ignore[union-attr]
            t0 = time.perf_counter()
            run[name](model)
            times[name].append(time.perf_counter() - t0)
            if timing:
                phases.stop()  # type: ignore[union-attr]
            if name == FULL:
                os.unlink(path)
        vault.wait()  # the compactor, untimed
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of 10 checkpoints")
    ap.add_argument("--steps", type=int, default=1, help="training steps between checkpoints")
    ap.add_argument("--phases", action="store_true", help="time the parts of each vault save")
    ap.add_argument("--scratch", type=Path, help="folder to write in (a new temporary one)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--tiny", action="store_true", help="a 1 x 64 GPT-2: checks the script")
    args = ap.parse_args()
    if args.tiny:
        SHAPE.update(n_layer=1, n_embd=64, n_head=2, vocab_size=256)
    load_before = os.getloadavg()
    out: dict[str, Any] = {"settings": settings(args.steps, args.rounds)}
    print("settings:", json.dumps(out["settings"]))
    print(f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    scratch = Path(tempfile.mkdtemp(prefix="wv-bench-frozen-", dir=args.scratch))
    phases = Phases() if args.phases else None
    pooled: dict[str, list[float]] = {FULL: [], VAULT: []}
    firsts: list[float] = []
    try:
        for r in range(args.rounds):
            times = one_round(scratch, args.steps, r, phases)
            firsts.append(times[VAULT][0])
            ratio = statistics.median(times[VAULT][1:]) / statistics.median(times[FULL][1:])
            print(
                f"round {r + 1}: {FULL} {statistics.median(times[FULL][1:]) * 1000:.1f} ms, "
                f"{VAULT} {statistics.median(times[VAULT][1:]) * 1000:.1f} ms, {ratio:.3f}x"
            )
            for name in pooled:
                pooled[name] += times[name][1:]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    load_after = os.getloadavg()
    full_med, vault_med = (statistics.median(pooled[n]) for n in (FULL, VAULT))
    out.update(
        {
            "samples per contender": len(pooled[FULL]),
            FULL: {"median_s": full_med, "min_s": min(pooled[FULL]), "max_s": max(pooled[FULL])},
            VAULT: {
                "median_s": vault_med,
                "min_s": min(pooled[VAULT]),
                "max_s": max(pooled[VAULT]),
            },
            "vault first save median_s": statistics.median(firsts),
            "ratio of medians": vault_med / full_med,
            "load average": {"before": load_before, "after": load_after},
            "machine": machine(),
        }
    )
    for name in pooled:
        ts = pooled[name]
        print(
            f"{name}: median {statistics.median(ts) * 1000:.1f} ms "
            f"({min(ts) * 1000:.0f}-{max(ts) * 1000:.0f}), {len(ts)} saves"
        )
    print(f"first save of a vault: median {statistics.median(firsts) * 1000:.0f} ms")
    print(f"incremental / full = {vault_med / full_med:.3f}x")
    if phases is not None:
        out["phases_ms"] = {n: v * 1000 for n, v in phases.medians().items()}
        print("vault.save parts (median ms per save):", json.dumps(out["phases_ms"]))
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
