"""What reading files with ``preadv`` instead of through a mapping costs (see
docs/benchmarks.md, section 31).

A file cut short while a mapping of it is read kills the process with ``SIGBUS``, so
weightvault reads tensor bytes with ``preadv`` (single files' ``raw()``, vault objects
and packs, foreign files, ``torch.load(mmap=False)`` for ``.pt``). This times the loads
that matter, the code before the change against the code after it, each in processes
of its own that alternate (a source tree per process: ``PYTHONPATH``):

- ``file``: GPT-2 small (``GPT2Config()``) loaded from a single file with
  ``weightvault.torch.load`` against ``safetensors.torch.load_model`` (which maps), and
  the same weights from a ``torch.save`` file through ``weightvault.torch.load``;
- ``resume``: GPT-2 6 x 512 + AdamW resumed from a vault (the newest, raw, as during a
  run; and settled, compressed), against plain files (``load_model`` + ``torch.load``),
  and ``vault.verify()`` (every object read whole and hashed).

Usage (touch memory first, so that page-cache and allocator state are alike):

    python3 -c "bytearray(8 << 30)"
    .venv/bin/python bench/bench_truncation.py --before /tmp/wv/truncation/base/src

``--before`` is a copy of ``src/`` with the reads through mappings put back.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
AFTER = str(HERE.parent / "src")


def _touch(model: Any, opt: Any = None) -> None:
    import torch

    values = list(model.state_dict().values())
    if opt is not None:
        values += [t for s in opt.state_dict()["state"].values() for t in s.values()]
    for t in values:
        if isinstance(t, torch.Tensor):
            t.sum()


def _alternate(contenders: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Each contender's times over ``rounds`` rounds, the order rotating, after one
    warm-up round."""
    import gc

    times: dict[str, list[float]] = {n: [] for n in contenders}
    order = list(contenders)
    for r in range(rounds + 1):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            gc.collect()
            t0 = time.perf_counter()
            contenders[name]()
            if r:
                times[name].append(time.perf_counter() - t0)
    return times


def prepare(scratch: Path, tiny: bool) -> None:
    """The files a code version reads, written by that version."""
    import torch
    from safetensors.torch import save_model
    from transformers import GPT2Config, GPT2LMHeadModel

    import weightvault.torch as wvt
    from weightvault import Vault

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2) if tiny else GPT2Config()).eval()
    wvt.save(model, scratch / "gpt2.safetensors")
    save_model(model, str(scratch / "gpt2-st.safetensors"))
    torch.save(model.state_dict(), scratch / "gpt2.pt")
    model, opt = _lm(tiny)
    batch = torch.randint(0, 1000, (2, 32))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    for name, settle in (("raw", False), ("settled", True)):
        vault = Vault(scratch / name, compaction=None)
        vault.save(model, optimizer=opt)
        if settle:
            vault.compact()
    os.mkdir(scratch / "files")
    save_model(model, str(scratch / "files" / "model.safetensors"))
    torch.save(opt.state_dict(), scratch / "files" / "optimizer.pt")


def _lm(tiny: bool) -> tuple[Any, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    shape = {"n_layer": 6, "n_embd": 512, "n_head": 8, "n_positions": 256}
    model = GPT2LMHeadModel(GPT2Config(**(shape | {"n_layer": 1} if tiny else shape))).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)


def child(kind: str, scratch: Path, rounds: int, tiny: bool) -> dict[str, list[float]]:
    """One process's alternating rounds, with whichever weightvault is on the path."""
    import torch
    from safetensors.torch import load_model
    from transformers import GPT2Config, GPT2LMHeadModel

    import weightvault.torch as wvt
    from weightvault import Vault

    if kind == "file":
        model = GPT2LMHeadModel(GPT2Config(n_layer=2) if tiny else GPT2Config()).eval()
        _touch(model)
        contenders = {
            "weightvault.torch.load": lambda: wvt.load(model, scratch / "gpt2.safetensors"),
            "safetensors load_model": lambda: load_model(
                model, str(scratch / "gpt2-st.safetensors")
            ),
            "weightvault.torch.load (.pt)": lambda: wvt.load(model, scratch / "gpt2.pt"),
        }
        return _alternate(contenders, rounds)
    model, opt = _lm(tiny)
    batch = torch.randint(0, 1000, (2, 32))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()  # the optimizer's state exists, as in a run that resumes
    _touch(model, opt)
    raw, settled = Vault(scratch / "raw"), Vault(scratch / "settled")

    def files() -> None:
        load_model(model, str(scratch / "files" / "model.safetensors"))
        opt.load_state_dict(torch.load(scratch / "files" / "optimizer.pt", weights_only=True))

    contenders = {
        "resume newest (raw)": lambda: raw.load(model, optimizer=opt),
        "resume settled": lambda: settled.load(model, optimizer=opt),
        "plain files": files,
        "vault.verify() (raw)": lambda: raw.verify(),
    }
    return _alternate(contenders, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="the src/ folder of the code before the change")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per process")
    ap.add_argument("--passes", type=int, default=3, help="processes per code version")
    ap.add_argument("--tiny", action="store_true", help="a smoke test of the script")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SCRATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.child[0] == "prepare":
            prepare(Path(args.child[1]), args.tiny)
            return
        out = child(args.child[0], Path(args.child[1]), args.rounds, args.tiny)
        print(json.dumps(out))
        return
    versions = {"after": AFTER} | ({"before": args.before} if args.before else {})

    def run(kind: str, version: str, scratch: Path) -> str:
        # Each version writes and reads its own files (the vault layout may differ).
        env = dict(os.environ, PYTHONPATH=versions[version], OMP_NUM_THREADS="2")
        cmd = [sys.executable, __file__, "--child", kind, str(scratch / version),
               "--rounds", str(args.rounds)] + (["--tiny"] if args.tiny else [])  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            sys.exit(proc.stderr[-4000:])
        return proc.stdout

    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        scratch = Path(tmp)
        for version in versions:
            os.mkdir(scratch / version)
            run("prepare", version, scratch)
        pooled: dict[tuple[str, str, str], list[float]] = {}
        for p in range(args.passes):
            for kind in ("file", "resume"):
                names = list(versions) if p % 2 == 0 else list(versions)[::-1]
                for version in names:
                    stdout = run(kind, version, scratch)
                    for name, ts in json.loads(stdout.strip().splitlines()[-1]).items():
                        pooled.setdefault((kind, name, version), []).extend(ts)
    print(f"{'kind':7} {'contender':32} " + " ".join(f"{v + ' ms':>22}" for v in versions))
    for kind, name in dict.fromkeys((k, n) for k, n, _ in pooled):
        cells = []
        for version in versions:
            ts = pooled[(kind, name, version)]
            med = statistics.median(ts) * 1e3
            cells.append(f"{med:8.1f} ({min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f})")
        print(f"{kind:7} {name:32} " + " ".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
