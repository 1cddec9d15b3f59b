"""A resume as users run it: the first load of a new process (issue 27's resumes, cold).

``bench_vault_speed.py`` times loads over and over in one warm process. A resume is the
first load of a new process, so it also pays for the first use of every code path and
thread pool, and for the codec libraries a load imports on demand. This saves the 10
checkpoints of a run once (the plain files, a default vault settled as at the end of
training, and a ``compression=None`` vault), then, for each sample, starts a new Python
that imports torch and weightvault, opens the vault, builds the model and its AdamW from
the config (all untimed, as a training script does before it resumes), and times the
load alone. Contenders alternate in an order that rotates; medians.

- ``files newest`` / ``files oldest``: ``load_model`` + ``opt.load_state_dict(torch.load(...))``;
- ``vault newest, compression=None``;
- ``vault newest, settled``: the compressed newest, as a user runs it;
- ``vault newest, settled, codecs imported``: the same with blosc2 and pcodec imported
  before the clock starts, which tells the import's share apart;
- ``vault newest, settled, through python-blosc2``: the same decoded by python-blosc2
  (``WEIGHTVAULT_BLOSC2_CTYPES=0``), imported on first use, as before the C library was
  called directly;
- ``vault oldest`` (whole) and ``vault 2nd oldest`` (the deepest chain).

The page cache is warm (as right after the saves); bytecode is cached, as for an
installed package (under the scratch folder: nothing is written beside the sources).

    python3 -c "bytearray(8 << 30)"      # touch memory first
    PYTHONPATH=src .venv/bin/python bench/bench_cold_resume.py lm --dir /tmp/wv-lm --rounds 7
    PYTHONPATH=src .venv/bin/python bench/bench_cold_resume.py gpt2 --rounds 5

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
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

#: A child that takes longer than this is a hang, not a sample.
CHILD_TIMEOUT = 300


def _build(run: str) -> tuple[Any, Any]:
    """The run's model and a fresh AdamW, from the config (no weights read)."""
    import _train_lm as T

    if run == "lm":
        model = T.build()
        return model, T.optimizer(model, 1e-3)
    from bench_vault_speed import gpt2_model

    return gpt2_model()


def child(run: str, what: str, where: Path, name: str, imports: str) -> None:
    """One resume in this (new) process; prints its milliseconds. ``imports``: "1"
    imports the codecs first, "py" decodes through python-blosc2."""
    if imports == "py":
        os.environ["WEIGHTVAULT_BLOSC2_CTYPES"] = "0"
    import torch
    from safetensors.torch import load_model

    from weightvault import Vault

    if imports == "1":
        import blosc2  # noqa: F401
        import pcodec  # noqa: F401
    vault = Vault(where) if what == "vault" else None
    model, opt = _build(run)
    t0 = time.perf_counter()
    if vault is None:
        load_model(model, str(where / "model.safetensors"))
        opt.load_state_dict(torch.load(where / "optimizer.pt", weights_only=True))
    else:
        vault.load(model, name, optimizer=opt)
    print(json.dumps({"ms": (time.perf_counter() - t0) * 1000}))


def prepare(run: str, root: Path | None, scratch: Path, steps: int) -> dict[str, list[str]]:
    """The 10 checkpoints saved three ways; ``{contender: child arguments}``."""
    from _common import save_plain_files
    from bench_vault_speed import gpt2_states, lm_states

    from weightvault import Vault

    states = lm_states(root) if run == "lm" and root else gpt2_states(steps)
    settled = Vault(scratch / "vault")
    raw = Vault(scratch / "vault-raw", compression=None)
    lr: set[float] = set()
    for k, (model, opt) in enumerate(states):
        lr |= {g["lr"] for g in opt.param_groups}
        if k in (0, 9):
            save_plain_files(scratch / f"files-{k}", model, opt)
        for vault in (settled, raw):
            vault.save(model, optimizer=opt)
            vault.wait()
    settled.compact()
    settled.wait()
    names = [r.name for r in settled.list()]
    print(f"optimizer lr {sorted(lr)}; {len(names)} checkpoints", flush=True)
    v, r = str(scratch / "vault"), str(scratch / "vault-raw")
    return {
        "files newest": ["files", str(scratch / "files-9"), "-", "0"],
        "vault newest, compression=None": ["vault", r, names[-1], "0"],
        "vault newest, settled": ["vault", v, names[-1], "0"],
        "vault newest, settled, codecs imported": ["vault", v, names[-1], "1"],
        "vault newest, settled, through python-blosc2": ["vault", v, names[-1], "py"],
        "files oldest": ["files", str(scratch / "files-0"), "-", "0"],
        "vault oldest": ["vault", v, names[0], "0"],
        "vault 2nd oldest (deepest chain)": ["vault", v, names[1], "0"],
    }


def sample(run: str, args: list[str], env: dict[str, str]) -> float:
    cmd = [sys.executable, __file__, run, "--child", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["ms"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", choices=["gpt2", "lm"])
    ap.add_argument("--dir", type=Path, help="the trained run of bench_compress.py (lm)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="training steps between checkpoints")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, where, name, imports = args.child
        child(args.run, what, Path(where), name, imports)
        return
    if args.run == "lm" and args.dir is None:
        ap.error("lm needs --dir (bench_compress.py train --dir DIR makes it)")
    from _common import machine, med, table

    scratch = Path(tempfile.mkdtemp(prefix="wv-bench-cold-"))
    try:
        contenders = prepare(args.run, args.dir, scratch, args.steps)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(scratch / "pycache")
        here = os.path.dirname(os.path.abspath(__file__))
        env["PYTHONPATH"] = os.pathsep.join([here, env.get("PYTHONPATH", "")])
        times: dict[str, list[float]] = {n: [] for n in contenders}
        order = list(contenders)
        for r in range(args.rounds + 1):  # the first round fills the bytecode cache
            for n in order[r % len(order) :] + order[: r % len(order)]:
                ms = sample(args.run, contenders[n], env)
                if r:
                    times[n].append(ms)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = med(times["files newest"])
    rows = [
        [n, f"{med(ts):.0f}", f"{min(ts):.0f}-{max(ts):.0f}", f"{med(ts) / base:.2f}x"]
        for n, ts in times.items()
    ]
    print(f"{args.run}: the first load of a new process, {args.rounds} samples each")
    print(table(rows, ["resume (model + optimizer)", "median ms", "spread ms", "vs files newest"]))
    print(json.dumps({"machine": machine(), "ms": {n: med(ts) for n, ts in times.items()}}))


if __name__ == "__main__":
    main()
