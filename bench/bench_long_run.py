"""A long run: does a save or a resume cost more after 300 checkpoints than after 10?

The other vault benchmarks stop at 10 checkpoints, where reading every record is cheap.
Here issue 20's trained byte-level GPT-2 goes on as a frozen-backbone fine-tune (only
its last block and final norm train, AdamW at lr ``--lr``, ``--steps`` steps on the
standard library's source between checkpoints) for as many checkpoints as ``--at``'s
largest, saved each time three ways, in an order that rotates:

- ``files``: ``save_model`` + ``torch.save(optimizer.state_dict())``, both fsynced, into
  a new folder, the previous one deleted (a Trainer's ``save_total_limit=1``);
- ``vault``: a default ``Vault``;
- ``vault, training_state_last=1``: every checkpoint's weights, one optimizer state.

Each vault save is timed alone (the call), then ``wait()`` is timed apart (the background
compactor, and for ``training_state_last`` the gc it runs). At each checkpoint count of
``--at``, the newest is resumed (model + optimizer) by every contender, alternating:
in this process (``--rounds``) and as the first load of a new process (``--cold``
samples; bytecode cached, as for an installed package). At the largest count the
vaults are then settled (``compact()``, as the end of training does) and resumed again
(rows ``N, settled``). Medians; the saves are the medians of the 10 before each count.

    python3 -c "bytearray(8 << 30)"      # touch memory first
    PYTHONPATH=src .venv/bin/python bench/bench_compress.py train --dir /tmp/wv-lm  # once
    PYTHONPATH=src .venv/bin/python bench/bench_long_run.py --dir /tmp/wv-lm --at 10,100,300

Everything is written under one temporary folder, deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import machine, med, quiesce, save_plain_files, table

from weightvault import Vault

#: A child that takes longer than this is a hang, not a sample.
CHILD_TIMEOUT = 300
NAMES = ["files", "vault", "vault, training_state_last=1"]


def child(what: str, where: Path) -> None:
    """One resume of the newest in this (new) process; prints its milliseconds."""
    import _train_lm as T
    from safetensors.torch import load_model

    vault = Vault(where) if what == "vault" else None
    model = T.build()
    opt = T.optimizer(model, 1e-3)
    t0 = time.perf_counter()
    if vault is None:
        load_model(model, str(where / "model.safetensors"))
        opt.load_state_dict(torch.load(where / "optimizer.pt", weights_only=True))
    else:
        vault.load(model, "latest", optimizer=opt)
    print(json.dumps({"ms": (time.perf_counter() - t0) * 1000}))


def _cold(args: list[str], env: dict[str, str]) -> float:
    cmd = [sys.executable, __file__, "--child", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["ms"])


def _alternate(contenders: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each contender's median over ``rounds`` rounds in a rotating order, after one
    warm-up round; a contender returns its own milliseconds."""
    times: dict[str, list[float]] = {n: [] for n in contenders}
    order = list(contenders)
    for r in range(rounds + 1):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            quiesce()
            ms = contenders[name]()
            if r:
                times[name].append(ms)
    return {n: med(ts) for n, ts in times.items()}


def _timed(fn: Callable[[], Any]) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000

    return run


def run(
    root: Path, scratch: Path, at: list[int], steps: int, lr: float, rounds: int, cold: int
) -> dict[int, dict[str, Any]]:
    import _train_lm as T

    model, opt, _ = T.restore(T.checkpoints(root, "a")[-1])
    trainable = ("transformer.h.3.", "transformer.ln_f.")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(trainable))
    for g in opt.param_groups:
        g["lr"] = lr  # no scheduler here: it stays (printed below, per checkpoint)
    data = T.batches(T.text(), seed=1)
    vaults = {
        "vault": Vault(scratch / "vault"),
        "vault, training_state_last=1": Vault(scratch / "vault-tsl", training_state_last=1),
    }
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
    saves: dict[str, list[float]] = {n: [] for n in NAMES}
    waits: dict[str, list[float]] = {n: [] for n in NAMES[1:]}
    lrs: set[float] = set()
    out: dict[int, dict[str, Any]] = {}
    folder: Path | None = None
    for k in range(1, max(at) + 1):
        for _ in range(steps):
            batch = next(data)
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        lrs |= {g["lr"] for g in opt.param_groups}
        for name in NAMES[k % 3 :] + NAMES[: k % 3]:
            quiesce()
            t0 = time.perf_counter()
            if name == "files":
                new = scratch / f"files-{k:04d}"
                save_plain_files(new, model, opt)
                saves[name].append(time.perf_counter() - t0)
                if folder is not None:
                    shutil.rmtree(folder)
                folder = new
                continue
            vaults[name].save(model, optimizer=opt)
            saves[name].append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            vaults[name].wait()
            waits[name].append(time.perf_counter() - t1)
        if k not in at:
            continue
        assert folder is not None
        newest = folder
        warm = _alternate(
            {
                "files": _timed(lambda f=newest: _files_load(f, model, opt)),
                **{n: _timed(lambda v=v: v.load(model, optimizer=opt)) for n, v in vaults.items()},
            },
            rounds,
        )
        where = {"files": ["files", str(newest)], "vault": ["vault", str(scratch / "vault")]}
        where["vault, training_state_last=1"] = ["vault", str(scratch / "vault-tsl")]
        cold_ms = _alternate({n: (lambda a=a: _cold(a, env)) for n, a in where.items()}, cold)
        out[k] = {
            "save ms": {n: med(ts[-10:]) * 1000 for n, ts in saves.items()},
            "wait ms": {n: med(ts[-10:]) * 1000 for n, ts in waits.items()},
            "resume warm ms": warm,
            "resume cold ms": cold_ms,
            "records": {n: len(v.list()) for n, v in vaults.items()},
            "disk MB": {n: v.disk_bytes() / 1e6 for n, v in vaults.items()},
        }
        print(f"{k} checkpoints (optimizer lr {sorted(lrs)}): {json.dumps(out[k])}", flush=True)
        if k != max(at):
            continue
        # The end of training settles each vault (compact(), as the integrations do): the
        # newest's own objects are compressed, and a later resume decodes them.
        for v in vaults.values():
            v.compact()
        warm = _alternate(
            {
                "files": _timed(lambda f=newest: _files_load(f, model, opt)),
                **{n: _timed(lambda v=v: v.load(model, optimizer=opt)) for n, v in vaults.items()},
            },
            rounds,
        )
        cold_ms = _alternate({n: (lambda a=a: _cold(a, env)) for n, a in where.items()}, cold)
        out[-k] = {
            **out[k],
            "resume warm ms": warm,
            "resume cold ms": cold_ms,
            "disk MB": {n: v.disk_bytes() / 1e6 for n, v in vaults.items()},
        }
        print(f"{k} checkpoints, settled: {json.dumps(out[-k])}", flush=True)
    return out


def _files_load(folder: Path, model: Any, opt: Any) -> None:
    from safetensors.torch import load_model

    load_model(model, str(folder / "model.safetensors"))
    opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))


def report(out: dict[int, dict[str, Any]]) -> None:
    rows = []
    for k, o in out.items():
        for n in NAMES:
            rows.append(
                [
                    f"{-k}, settled" if k < 0 else str(k),
                    n,
                    f"{o['save ms'][n]:.0f}",
                    f"{o['wait ms'][n]:.0f}" if n in o["wait ms"] else "-",
                    f"{o['resume warm ms'][n]:.0f}",
                    f"{o['resume cold ms'][n]:.0f}",
                    f"{o['resume cold ms'][n] / o['resume cold ms']['files']:.2f}x",
                    f"{o['disk MB'][n]:.1f}" if n in o["disk MB"] else "-",
                ]
            )
    head = [
        "checkpoints",
        "contender",
        "save ms",
        "wait() ms",
        "resume ms",
        "cold ms",
        "cold/files",
        "disk MB",
    ]
    print(table(rows, head))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, help="the trained run of bench_compress.py")
    ap.add_argument("--at", default="10,100,300", help="checkpoint counts to resume at")
    ap.add_argument("--steps", type=int, default=1, help="training steps between checkpoints")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cold", type=int, default=3)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return
    if args.dir is None:
        ap.error("--dir is needed (bench_compress.py train --dir DIR makes it)")
    at = sorted({int(x) for x in args.at.split(",")})
    scratch = Path(tempfile.mkdtemp(prefix="wv-bench-long-"))
    try:
        out = run(args.dir, scratch, at, args.steps, args.lr, args.rounds, args.cold)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(out)
    print(json.dumps({"machine": machine(), "results": {str(k): v for k, v in out.items()}}))


if __name__ == "__main__":
    main()
