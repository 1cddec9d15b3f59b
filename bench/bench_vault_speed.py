"""The vault at the speed of plain files (issue 27): the saves and resumes users run, timed
beside what they would run otherwise, in one process, alternating, medians.

Two runs of 10 checkpoints each, model + AdamW state:

- ``gpt2``: GPT-2 with 6 blocks of width 512 (vocabulary 50257, 172 MB of fp32 weights,
  every weight trainable), trained between checkpoints on the Python standard library's
  source read as bytes (``--steps`` steps of AdamW at lr 1e-4 each);
- ``lm``: issue 20's byte-level GPT-2 (13 MB), its lr 1e-3 phase's 10 checkpoints as
  ``bench/_train_lm.py`` trained them (``--dir``, made by ``bench_compress.py train``).

At every checkpoint each contender saves the same state, in an order that rotates:

- ``files``: ``save_model`` + ``torch.save(optimizer.state_dict())``, both fsynced (the
  Trainer's way);
- ``vault``: ``Vault.save(model, optimizer=opt)``, synchronous (hash, raw objects made
  durable by one syncfs, the record committed); its compactor then runs and is waited for
  untimed, its process CPU seconds counted;
- ``vault bg``: the same with ``background=True``: the time the call blocks, and apart
  from it the time an optimizer step taken at once would then wait (``handle.copied()``:
  the save's thread copies trainable weights and optimizer state after the call returns);
- ``vault, compression=None``.

Then resumes, from the page cache as a resume after a save reads them: ``load_model`` +
``opt.load_state_dict(torch.load(...))`` against ``Vault.load(model, name, optimizer=opt)``
from the newest checkpoint (one object per tensor), the oldest (whole too) and the one
after it (the deepest chain, K + 1 objects per tensor), and the newest of the ``vault bg``
vault once settled (``compact()``, as at the end of training: the newest compressed; its
disk figure is then the settled one), and the newest and the oldest of the
``compression=None`` vault (raw, its small objects in the saves' packs). And
for ``gpt2`` a frozen-backbone fine-tune (only the last block trainable): an incremental
vault save against a full ``save_model`` + fsync. Sizes on disk at the end.

    python3 -c "bytearray(8 << 30)"      # touch memory first
    PYTHONPATH=src .venv/bin/python bench/bench_vault_speed.py gpt2 --rounds 5
    PYTHONPATH=src .venv/bin/python bench/bench_vault_speed.py lm --dir /tmp/wv-lm --rounds 7

``--chains 0,1,2,4,8`` measures instead what ``delta_chain`` (K) trades: one vault per K
fed the same 10 checkpoints (each compacted before the next save), then a resume of every
checkpoint, the plain files' newest resume alternating with them; it prints each K's
oldest and slowest resume against the plain files' and its disk against the folders'.

Everything is written under one temporary folder, deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import fsync_path, machine, med, quiesce, save_plain_files, spread, table

from weightvault import Vault

CHECKPOINTS = 10


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


#: The GPT-2 run's shape (``--tiny`` makes a smoke test of the script).
SHAPE = {"n_layer": 6, "n_embd": 512, "n_head": 8, "n_positions": 256}


def gpt2_model(
    frozen: bool = False,
    ln_f: bool = False,
    *,
    lr: float = 1e-4,
    shape: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """GPT-2 6 x 512 (seeded, from the config, ``shape`` or :data:`SHAPE`) and its AdamW
    at ``lr``; ``frozen`` leaves only the last block trainable (and the final norm, with
    ``ln_f``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**(SHAPE if shape is None else shape))).train()
    if frozen:
        model.requires_grad_(False)
        model.transformer.h[-1].requires_grad_(True)
        model.transformer.ln_f.requires_grad_(ln_f)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def gpt2_states(
    steps: int, frozen: bool = False, ln_f: bool = False, **options: Any
) -> Iterator[tuple[Any, Any]]:
    """GPT-2 6 x 512 and its AdamW (``options``: :func:`gpt2_model`'s ``lr`` and ``shape``)
    after each of 10 rounds of ``steps`` training steps."""
    import _train_lm as T

    model, opt = gpt2_model(frozen, ln_f, **options)
    data = T.batches(T.text(), 0)
    for _ in range(CHECKPOINTS):
        for _ in range(steps):
            batch = next(data)[:4]
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        yield model, opt


def lm_states(root: Path) -> Iterator[tuple[Any, Any]]:
    """Issue 20's trained byte-level GPT-2: its lr 1e-3 phase's checkpoints, in order."""
    import _train_lm as T

    for folder in T.checkpoints(root, "a")[:CHECKPOINTS]:
        model, opt, _ = T.restore(folder)
        yield model, opt


def _files_load(folder: Path, model: Any, opt: Any) -> None:
    from safetensors.torch import load_model

    load_model(model, str(folder / "model.safetensors"))
    opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))


def _touch(model: Any, opt: Any) -> None:
    """Read every tensor of the state once, untimed: the first contender in a round
    would otherwise pay for what the state's first use costs (page faults, and PyTorch
    building the optimizer's state_dict the first time; 0.2 s once on the lm run)."""
    for value in [*model.state_dict().values(), *opt.state_dict()["state"].values()]:
        for t in value.values() if isinstance(value, dict) else [value]:
            if isinstance(t, torch.Tensor):
                t.sum()


def _disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _alternate(contenders: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Each contender's times over ``rounds`` rounds in an order that rotates, after one
    warm-up round."""
    times: dict[str, list[float]] = {n: [] for n in contenders}
    order = list(contenders)
    for r in range(rounds + 1):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            quiesce()
            t0 = time.perf_counter()
            contenders[name]()
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    return times


def run(
    make_states: Callable[[], Iterator[tuple[Any, Any]]],
    scratch: Path,
    rounds: int,
    passes: int = 1,
) -> dict[str, Any]:
    """Saves of the 10 checkpoints ``passes`` times (each pass into new vaults and
    folders, the samples pooled: a median of 9 saves moved with the disk's mood), then
    the resumes and the disk of the last pass."""
    names = ["files", "vault", "vault bg", "vault, compression=None"]
    saves: dict[str, list[float]] = {n: [] for n in names}
    save_cpu: dict[str, list[float]] = {"files": [], "vault": []}
    step_waits: list[float] = []
    step_totals: list[float] = []
    compactor_cpu: list[float] = []
    compactor_wall: list[float] = []
    lr: set[float] = set()
    model = opt = None
    for p in range(passes):
        if p:
            shutil.rmtree(scratch / f"pass-{p - 1}")
        here = scratch / f"pass-{p}"
        here.mkdir()
        vaults = {
            "vault": Vault(here / "vault"),
            "vault bg": Vault(here / "vault-bg"),
            "vault, compression=None": Vault(here / "vault-raw", compression=None),
        }
        for k, (model, opt) in enumerate(make_states()):
            lr |= {g["lr"] for g in opt.param_groups}
            _touch(model, opt)
            for name in names[k % len(names) :] + names[: k % len(names)]:
                quiesce()
                c0, t0 = _cpu(), time.perf_counter()
                if name == "files":
                    save_plain_files(here / f"files-{k:02d}", model, opt)
                else:
                    handle = vaults[name].save(model, optimizer=opt, background=name == "vault bg")
                took = time.perf_counter() - t0
                if k and name in ("files", "vault"):
                    save_cpu[name].append(_cpu() - c0)
                if k:  # the first save writes everything into an empty vault
                    saves[name].append(took)
                if name == "vault bg":
                    # What an optimizer step taken at once would wait for: the copies
                    # the save's thread makes after the call returned.
                    t1 = time.perf_counter()
                    handle.copied()
                    if k:
                        step_waits.append(time.perf_counter() - t1)
                        step_totals.append(time.perf_counter() - t0)
                    handle.wait()
                if name != "files":
                    c0, w0 = _cpu(), time.perf_counter()
                    vaults[name].wait()  # the compactor, untimed above, measured here alone
                    if name == "vault" and k:
                        compactor_cpu.append(_cpu() - c0)
                        compactor_wall.append(time.perf_counter() - w0)
    scratch = here
    assert model is not None and opt is not None
    out: dict[str, Any] = {"optimizer lr": sorted(lr)}
    out["save"] = {n: {"median": med(ts), "spread": spread(ts)} for n, ts in saves.items()}
    out["save samples"] = len(saves["vault"])
    out["save"]["vault bg: then a step at once waits"] = {
        "median": med(step_waits),
        "spread": spread(step_waits),
    }
    out["save"]["vault bg: the call + that wait"] = {
        "median": med(step_totals),
        "spread": spread(step_totals),
    }
    out["compactor"] = {
        "cpu s per checkpoint": med(compactor_cpu),
        "wall s per checkpoint": med(compactor_wall),
        "the sync save's own cpu s": med(save_cpu["vault"]),
        "the plain files' save cpu s": med(save_cpu["files"]),
    }
    # The same checkpoints settled (as at the end of training): the newest compressed.
    vaults["vault bg"].compact()
    newest = vaults["vault"].resolve("latest")
    # The oldest stays whole; the one after it reads the deepest chain (K + 1 objects).
    oldest, deepest = (r.name for r in vaults["vault"].list()[:2])
    files = sorted(scratch.glob("files-*"))
    contenders: dict[str, Callable[[], Any]] = {
        "files newest": lambda: _files_load(files[-1], model, opt),
        "vault newest": lambda: vaults["vault"].load(model, newest, optimizer=opt),
        "vault oldest": lambda: vaults["vault"].load(model, oldest, optimizer=opt),
        "vault 2nd oldest (deepest chain)": lambda: vaults["vault"].load(
            model, deepest, optimizer=opt
        ),
        "vault newest, compression=None": lambda: vaults["vault, compression=None"].load(
            model, newest, optimizer=opt
        ),
        "vault oldest, compression=None": lambda: vaults["vault, compression=None"].load(
            model, oldest, optimizer=opt
        ),
        "vault newest, settled (compressed)": lambda: vaults["vault bg"].load(
            model, newest, optimizer=opt
        ),
        "files oldest": lambda: _files_load(files[0], model, opt),
    }
    loads = _alternate(contenders, rounds)
    out["load"] = {n: {"median": med(ts), "spread": spread(ts)} for n, ts in loads.items()}
    out["disk"] = {
        "files": sum(_disk(f) for f in files),
        **{n: v.disk_bytes() for n, v in vaults.items()},
    }
    return out


def chains(
    states: Iterator[tuple[Any, Any]], scratch: Path, rounds: int, ks: list[int]
) -> dict[str, Any]:
    """What ``delta_chain`` costs a resume: every checkpoint of one vault per K, timed."""
    vaults = {k: Vault(scratch / f"vault-k{k}", delta_chain=k) for k in ks}
    lr: set[float] = set()
    model = opt = None
    for n, (model, opt) in enumerate(states):
        lr |= {g["lr"] for g in opt.param_groups}
        save_plain_files(scratch / f"files-{n:02d}", model, opt)
        for vault in vaults.values():
            vault.save(model, optimizer=opt)
            vault.wait()  # compacted before the next save, as an idle loop would have it
    assert model is not None and opt is not None
    files = sorted(scratch.glob("files-*"))
    names = [r.name for r in vaults[ks[0]].list()]
    contenders: dict[str, Callable[[], Any]] = {
        "files newest": lambda: _files_load(files[-1], model, opt)
    }
    for k, vault in vaults.items():
        for name in names:
            contenders[f"K={k} {name}"] = lambda v=vault, n=name: v.load(model, n, optimizer=opt)
    times = _alternate(contenders, rounds)
    base = med(times["files newest"])
    folders = sum(_disk(f) for f in files)
    out: dict[str, Any] = {"optimizer lr": sorted(lr), "files newest s": base, "K": {}}
    for k, vault in vaults.items():
        each = {n: med(times[f"K={k} {n}"]) for n in names}
        slowest = max(each, key=lambda n: each[n])
        out["K"][k] = {
            "oldest s": each[names[0]],
            "newest s": each[names[-1]],
            "slowest": slowest,
            "slowest s": each[slowest],
            "disk / folders": vault.disk_bytes() / folders,
        }
    return out


def report_chains(out: dict[str, Any]) -> None:
    base = out["files newest s"]
    rows = [
        [
            str(k),
            f"{v['newest s'] * 1000:.0f} ({v['newest s'] / base:.2f}x)",
            f"{v['oldest s'] * 1000:.0f} ({v['oldest s'] / base:.2f}x)",
            f"{v['slowest']}: {v['slowest s'] * 1000:.0f} ({v['slowest s'] / base:.2f}x)",
            f"{v['disk / folders']:.3f}x",
        ]
        for k, v in out["K"].items()
    ]
    heads = ["K", "newest ms", "oldest ms", "slowest ms", "disk vs folders"]
    print(f"plain files, newest resume: {base * 1000:.0f} ms; optimizer lr {out['optimizer lr']}")
    print(table(rows, heads))


def frozen(scratch: Path, rounds: int) -> dict[str, Any]:
    """Incremental saves of a frozen-backbone fine-tune against a full save_model."""
    from safetensors.torch import save_model

    vault = Vault(scratch / "frozen")
    times: dict[str, list[float]] = {"save_model + fsync": [], "vault.save": []}
    for k, (model, _) in enumerate(gpt2_states(1, frozen=True)):
        if k > rounds:
            break
        for name in list(times)[k % 2 :] + list(times)[: k % 2]:
            quiesce()
            t0 = time.perf_counter()
            if name == "vault.save":
                vault.save(model)
            else:
                path = scratch / f"frozen-{k}.safetensors"
                save_model(model, str(path))
                fsync_path(str(path))
                os.unlink(path)
            times[name].append(time.perf_counter() - t0)
        vault.wait()
    return {n: {"median": med(ts[1:]), "spread": spread(ts[1:])} for n, ts in times.items()}


def report(out: dict[str, Any]) -> None:
    files_save = out["save"]["files"]["median"]
    rows = [
        [n, f"{v['median'] * 1000:.0f}", v["spread"], f"{v['median'] / files_save:.2f}x"]
        for n, v in out["save"].items()
    ]
    print(table(rows, ["save (model + optimizer)", "median ms", "spread s", "vs files"]))
    base = out["load"]["files newest"]["median"]
    rows = [
        [n, f"{v['median'] * 1000:.0f}", v["spread"], f"{v['median'] / base:.2f}x"]
        for n, v in out["load"].items()
    ]
    print(table(rows, ["resume (model + optimizer)", "median ms", "spread s", "vs files newest"]))
    files = out["disk"]["files"]
    rows = [[n, f"{b / 1e6:.1f}", f"{b / files:.3f}x"] for n, b in out["disk"].items()]
    print(table(rows, ["disk, 10 checkpoints", "MB", "vs files"]))
    print(json.dumps({k: out[k] for k in ("compactor", "optimizer lr", "save samples")}, indent=1))
    if "frozen" in out:
        f = out["frozen"]
        ratio = f["vault.save"]["median"] / f["save_model + fsync"]["median"]
        print(f"frozen backbone: {json.dumps(f)}; incremental / full = {ratio:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", choices=["gpt2", "lm"])
    ap.add_argument("--dir", type=Path, help="the trained run of bench_compress.py (lm)")
    ap.add_argument("--rounds", type=int, default=5, help="load rounds")
    ap.add_argument("--steps", type=int, default=2, help="training steps between checkpoints")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--tiny", action="store_true", help="a 1 x 64 GPT-2: checks the script")
    ap.add_argument("--chains", help="measure these delta_chain values instead, e.g. 0,1,2,8")
    ap.add_argument("--passes", type=int, default=1, help="save the 10 checkpoints this often")
    args = ap.parse_args()
    if args.tiny:
        SHAPE.update(n_layer=1, n_embd=64, n_head=2, vocab_size=256)
    scratch = Path(tempfile.mkdtemp(prefix="wv-bench-speed-"))
    if args.run == "lm" and args.dir is None:
        ap.error("lm needs --dir (bench_compress.py train --dir DIR makes it)")
    try:
        if args.chains:
            states = gpt2_states(args.steps) if args.run == "gpt2" else lm_states(args.dir)
            ks = [int(k) for k in args.chains.split(",")]
            out = chains(states, scratch, args.rounds, ks)
        elif args.run == "gpt2":
            out = run(lambda: gpt2_states(args.steps), scratch, args.rounds, args.passes)
            # Nine samples at least: a full save's fsync alone moved from 0.12 to 0.46 s.
            out["frozen"] = frozen(scratch, max(args.rounds, 9))
        else:
            out = run(lambda: lm_states(args.dir), scratch, args.rounds, args.passes)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out["machine"] = machine()
    if args.chains:
        report_chains(out)
    else:
        report(out)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
