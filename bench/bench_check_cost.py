"""What the integrity checks cost end to end: a vault save and resume of GPT-2 6 x 512 +
AdamW, and a single file of GPT-2 small, with the code before the checks against the code
after them.

The checks are the seals of records, pack indexes, intents and ``vault.json``, the single
file's header sum, the training-state validation, and reads without mappings. Each
contender is a source tree (``--before`` and ``--after``, e.g. two ``git worktree``
checkouts); each round runs one child process per contender, the order alternating, with
that tree's ``src`` first on ``sys.path`` (the child checks ``weightvault.__file__`` is
under it). A child:

1. builds GPT-2 6 x 512 from its config (``GPT2Config(n_layer=6, n_embd=512, n_head=8,
   n_positions=256)``, seed 0, no download) with AdamW (lr 1e-4, weight decay 0.01) and a
   linear-warm-up ``LambdaLR``, and trains ``--steps`` steps on seeded random tokens;
2. ``--inner`` times: one more training step (every weight and moment changes), then
   (a) ``Vault.save(model, optimizer=, scheduler=)``, synchronous (``compaction=None``, so
   the vault's durability is the save's own syncfs in both trees), (b) a resume: ``load``
   of ``"latest"`` with a new optimizer and scheduler into a second model, the process'
   pack tables emptied first as in a new process, (c) a weights-only ``load``;
3. (d) ``--saves`` consecutive saves into a new vault, one training step between them,
   then ``compact()``, then a resume of the settled newest;
4. GPT-2 small (``GPT2Config()``, random weights): ``weightvault.torch.save`` and
   ``load``, and ``load(verify=True)``, ``--inner`` times.

A child's figure for a step is the median of its ``--inner`` times; the parent prints,
per step, each contender's median over rounds (min-max), the ratio after / before of
those medians, and the median and range of the ratios paired within a round, with a
bootstrap 95% interval of that median. Resumes are checked bitwise against the saved
state (weights, optimizer state, scheduler). Everything is written under ``--dir``,
deleted at the end of each child, except ``children.jsonl`` there: each child's figures
as they come, which ``--report`` prints the tables of (e.g. of a run that was stopped).

    python3 -c "bytearray(8 << 30)"      # touch memory first
    git worktree add /tmp/wv/checks/before 3bd2e94
    git worktree add /tmp/wv/checks/after 959c933
    .venv/bin/python bench/bench_check_cost.py --rounds 7 \\
        --before /tmp/wv/checks/before --after /tmp/wv/checks/after --dir /tmp/wv/checks/run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHAPE = {"n_layer": 6, "n_embd": 512, "n_head": 8, "n_positions": 256}
BATCH = (4, 128)  # random tokens per training step
WARMUP = 10  # the scheduler's warm-up steps
LOG = "children.jsonl"  # in --dir: every child's figures, one line each, as they come

# -- the child ---------------------------------------------------------------------------


def _import_from(src: Path) -> Any:
    """Import weightvault from ``src``, ahead of the editable install, and prove it."""
    sys.path.insert(0, str(src))
    import weightvault

    where = Path(weightvault.__file__).resolve()
    if not where.is_relative_to(src.resolve()):
        raise SystemExit(f"weightvault came from {where}, not from {src}")
    return weightvault


def _quiesce() -> None:
    gc.collect()
    os.sync()  # other dirty data flushed before the timed step, not during it


def _timed(fn: Callable[[], Any]) -> float:
    _quiesce()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP)


def _gpt2(cfg: dict[str, int], seed: int = 0) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch_seed(seed)  # a resume's model has another seed: a load that did nothing fails
    return GPT2LMHeadModel(GPT2Config(**cfg)).train()


def torch_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def _training(model: Any) -> tuple[Any, Any]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _warmup)


def _step(model: Any, opt: Any, sched: Any, gen: Any) -> float:
    import torch

    ids = torch.randint(0, model.config.vocab_size, BATCH, generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested state (tensors, dicts, lists, numbers)."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _check_resume(model: Any, opt: Any, sched: Any, fresh: Any, f_opt: Any, f_sched: Any) -> None:
    if not _same(model.state_dict(), fresh.state_dict()):
        raise SystemExit("resume: weights differ from the saved model")
    if not _same(opt.state_dict(), f_opt.state_dict()):
        raise SystemExit("resume: optimizer state differs from the saved one")
    if not _same(sched.state_dict(), f_sched.state_dict()):
        raise SystemExit("resume: scheduler state differs from the saved one")


def _forget_packs(wv: Any) -> None:
    """Empty this process' pack tables, as a new process starts (trees keep them in
    ``_vault.pack._tables``, or ``_vault.store.pack._tables`` since the vault's folders)."""
    import importlib

    try:
        pack = importlib.import_module(f"{wv.__name__}._vault.store.pack")
    except ModuleNotFoundError:
        pack = importlib.import_module(f"{wv.__name__}._vault.pack")
    pack._tables.clear()


def _vault_part(wv: Any, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    Vault = wv.Vault
    times: dict[str, list[float]] = {k: [] for k in ("save", "resume", "load weights")}
    model = _gpt2(SHAPE)
    opt, sched = _training(model)
    gen = torch.Generator().manual_seed(0)
    losses = [_step(model, opt, sched, gen) for _ in range(args.steps)]
    fresh = _gpt2(SHAPE, seed=1)  # the resumes' model: built once, overwritten by each load
    vault = Vault(scratch / "vault", create=True, compaction=None)
    vault.save(model, optimizer=opt, scheduler=sched)  # untimed: the vault's first save
    steps = args.steps
    for _ in range(args.inner):
        losses.append(_step(model, opt, sched, gen))
        steps += 1
        times["save"].append(_timed(lambda: vault.save(model, optimizer=opt, scheduler=sched)))
        f_opt, f_sched = _training(fresh)

        def resume(f_opt: Any = f_opt, f_sched: Any = f_sched) -> None:
            _forget_packs(wv)
            Vault(scratch / "vault", compaction=None).load(
                fresh, "latest", optimizer=f_opt, scheduler=f_sched
            )

        times["resume"].append(_timed(resume))
        _check_resume(model, opt, sched, fresh, f_opt, f_sched)
        times["load weights"].append(
            _timed(lambda: Vault(scratch / "vault", compaction=None).load(fresh, "latest"))
        )
    settings = {
        "lr after the scheduler": opt.param_groups[0]["lr"],
        "scheduler last_epoch": sched.last_epoch,
        "training steps before the timed saves": args.steps,
        "training steps at the last timed save": steps,
        "losses": [round(x, 4) for x in losses],
        "param dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "optimizer state dtypes": sorted(
            {str(v.dtype) for s in opt.state.values() for v in s.values()}
        ),
        "parameters": sum(p.numel() for p in model.parameters()),
        "checkpoints in the vault": len(vault.list()),
    }
    # (d) several consecutive saves, then compact(), then a resume of the settled newest
    chain = Vault(scratch / "chain", create=True, compaction=None)
    saves = []
    for _ in range(args.saves):
        _step(model, opt, sched, gen)
        saves.append(_timed(lambda: chain.save(model, optimizer=opt, scheduler=sched)))
    times["consecutive saves (sum)"] = [sum(saves)]
    times["compact()"] = [_timed(chain.compact)]
    f_opt, f_sched = _training(fresh)

    def settled() -> None:
        _forget_packs(wv)
        Vault(scratch / "chain", compaction=None).load(
            fresh, "latest", optimizer=f_opt, scheduler=f_sched
        )

    times["resume settled"] = [_timed(settled)]
    _check_resume(model, opt, sched, fresh, f_opt, f_sched)
    settings["consecutive saves"] = args.saves
    settings["lr at the end"] = opt.param_groups[0]["lr"]
    return {"times": times, "settings": settings}


def _file_part(wv: Any, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    import weightvault.torch as wvt  # from the tree _import_from put first

    model = _gpt2({}).eval()
    fresh = _gpt2({}, seed=1).eval()
    path = scratch / "gpt2.safetensors"
    times: dict[str, list[float]] = {"file save": [], "file load": [], "file load verify": []}
    wvt.save(model, path)  # untimed: the first write of the file
    for _ in range(args.inner):
        times["file save"].append(_timed(lambda: wvt.save(model, path)))
        times["file load"].append(_timed(lambda: wvt.load(fresh, path)))
        times["file load verify"].append(_timed(lambda: wvt.load(fresh, path, verify=True)))
    if not _same(model.state_dict(), fresh.state_dict()):
        raise SystemExit("file load: weights differ")
    return {
        "times": times,
        "settings": {"gpt2 small parameters": sum(p.numel() for p in model.parameters())},
    }


def child(args: argparse.Namespace) -> None:
    src = Path(args.src)
    wv = _import_from(src)
    import torch

    scratch = Path(args.dir) / args.label
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    load_start = os.getloadavg()[0]
    try:
        out = _vault_part(wv, scratch, args)
        if not args.no_file:
            part = _file_part(wv, scratch, args)
            out["times"].update(part["times"])
            out["settings"].update(part["settings"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out["settings"].update(
        {
            "weightvault": str(Path(wv.__file__).resolve()),
            "torch threads": torch.get_num_threads(),
            "inner repeats": args.inner,
        }
    )
    out["load average"] = [load_start, os.getloadavg()[0]]
    Path(args.out).write_text(json.dumps(out))
    with open(Path(args.dir) / LOG, "a") as log:  # kept if the parent is stopped
        log.write(json.dumps({"label": args.label, **out}) + "\n")


# -- the parent --------------------------------------------------------------------------


def _bootstrap(ratios: list[float], n: int = 4000) -> tuple[float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def _report(results: dict[str, list[dict[str, Any]]]) -> None:
    names = list(results)
    before, after = names
    print("settings (first child of each):")
    for name in names:
        print(f"  {name}: {json.dumps(results[name][0]['settings'])}")
    loads = [x for name in names for r in results[name] for x in r["load average"]]
    print(f"load average (1 min) at child start/end: {min(loads):.2f}-{max(loads):.2f}")
    print(f"{len(results[before])} rounds; seconds, median over rounds (min-max)")
    head = f"  {'step':24} {before:>22} {after:>22}  ratio  paired: median (min-max) [95% CI]"
    print(head)
    for step in results[before][0]["times"]:
        per = {n: [statistics.median(r["times"][step]) for r in results[n]] for n in names}
        paired = [a / b for a, b in zip(per[after], per[before], strict=True)]
        lo, hi = _bootstrap(paired)
        cells = [
            f"{statistics.median(per[n]):.4f} ({min(per[n]):.3f}-{max(per[n]):.3f})" for n in names
        ]
        ratio = statistics.median(per[after]) / statistics.median(per[before])
        print(
            f"  {step:24} {cells[0]:>22} {cells[1]:>22}  {ratio:.3f}"
            f"  {statistics.median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})"
            f" [{lo:.3f}-{hi:.3f}]"
        )


def parent(args: argparse.Namespace) -> None:
    trees = {"before": Path(args.before), "after": Path(args.after)}
    python = args.python or sys.executable
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    print(
        f"machine: {os.cpu_count()} cores, {platform.platform()}, Python "
        f"{platform.python_version()}; {python}"
    )
    (Path(args.dir) / LOG).unlink(missing_ok=True)
    order = list(trees)
    for r in range(args.rounds):
        for name in order[r % 2 :] + order[: r % 2]:
            out = Path(args.dir) / f"{name}.json"
            env = dict(os.environ, PYTHONPATH=str(trees[name] / "src"))
            env.setdefault("HF_HUB_OFFLINE", "1")
            env.setdefault("TRANSFORMERS_VERBOSITY", "error")
            cmd = [python, __file__, "--child", "--src", str(trees[name] / "src"),
                   "--label", name, "--out", str(out), "--dir", args.dir,
                   "--steps", str(args.steps), "--inner", str(args.inner),
                   "--saves", str(args.saves)]  # fmt: skip
            if args.no_file:
                cmd.append("--no-file")
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, check=True)
            got = json.loads(out.read_text())
            out.unlink()
            results[name].append(got)
            print(f"round {r + 1} {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    _report(results)


def from_log(path: Path) -> None:
    """Print the report of the children logged in ``path`` (the k-th child of each
    contender paired with the other's k-th), e.g. of a run that was stopped."""
    results: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for line in path.read_text().splitlines():
        got = json.loads(line)
        results[got.pop("label")].append(got)
    rounds = min(len(v) for v in results.values())
    _report({name: got[:rounds] for name, got in results.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="source tree before the checks")
    parser.add_argument("--after", help="source tree after the checks")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--inner", type=int, default=3, help="timed repeats in a child")
    parser.add_argument("--steps", type=int, default=3, help="training steps before timing")
    parser.add_argument("--saves", type=int, default=4, help="consecutive saves for (d)")
    parser.add_argument("--dir", default="/tmp/wv/checks/run")
    parser.add_argument("--python", help="the children's interpreter (default: this one)")
    parser.add_argument("--json", help="write every child's figures here")
    parser.add_argument("--no-file", action="store_true", help="skip GPT-2 small's file")
    parser.add_argument("--report", help="only print the report of a children.jsonl")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--label", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
    elif args.report:
        from_log(Path(args.report))
    elif not (args.before and args.after):
        parser.error("--before and --after are required")
    else:
        parent(args)


if __name__ == "__main__":
    main()
