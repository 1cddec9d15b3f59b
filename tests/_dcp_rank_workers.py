"""Rank bodies for tests/test_dcp_ranks.py (issue 21): replicas read once, plan caching,
``async_save`` on ranks, a failed save, loads while gc runs, and a rank killed mid-load.

Each body takes ``(rank, world, ...)`` and writes what the test checks to JSON files
(the test process asserts on them), so one spawn serves several tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import _dcp_workers as W


def _report(path: str, doc: Any) -> None:
    with open(path, "w") as f:
        json.dump(doc, f)


def _same(a: Any, b: Any) -> None:
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), k


def _same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    want, got = a.state_dict()["state"], b.state_dict()["state"]
    assert want.keys() == got.keys()
    for k, st in want.items():
        for n, t in st.items():
            assert torch.equal(got[k][n], t), (k, n)


def _count_global_plans() -> list[int]:
    """A counter of global plans actually built on this rank (not taken from a cache)."""
    from weightvault._dcp.planner import VaultSavePlanner

    built = [0]
    real = VaultSavePlanner._global_plan

    def counting(self: Any, plans: Any) -> Any:
        built[0] += 1
        return real(self, plans)

    VaultSavePlanner._global_plan = counting  # type: ignore[method-assign]
    return built


def replicas(rank: int, world: int, root: str, out: str) -> None:
    """DDP on every rank: saved twice (the second from the plan cache), loaded once per
    replica group with each box read by one rank, saved in the background within a
    small staging budget while training goes on, and a save that fails on two ranks."""
    import weightvault.dcp as wdcp

    built = _count_global_plans()
    model = DDP(W.gpt2(0))
    opt = W.optimizer(model)
    W.train_step(model, opt, 1)
    rec = wdcp.save(model, root, "ddp", optimizer=opt)
    again = wdcp.save(model, root, "ddp-again", optimizer=opt)  # nothing changed
    fresh = DDP(W.gpt2(5))
    fresh_opt = W.optimizer(fresh)
    stats = wdcp.load(fresh, root, "ddp", optimizer=fresh_opt)
    assert fresh.module.lm_head.weight is fresh.module.transformer["wte"].weight
    _same(model, fresh)
    _same_optim(opt, fresh_opt)
    reads: list[Any] = [None] * world
    dist.all_gather_object(reads, [stats.bytes_read, stats.bytes_received, stats.bytes_sent])
    report = {"reads": reads, "stored": rec.stored_bytes, "logical": rec.logical_bytes,
              "plans_built": built[0], "again_new": again.new_bytes}  # fmt: skip
    report["async"] = _async_on_ranks(model, opt, root)
    report["failed"] = _failing_save(rank, model, opt, root)
    if rank == 0:
        _report(out, report)


def _async_on_ranks(model: Any, opt: torch.optim.Optimizer, root: str) -> str:
    """``async_save`` with a 64 KiB budget, then a training step before it finishes."""
    import weightvault.dcp as wdcp

    want = {k: v.clone() for k, v in model.module.state_dict().items()}
    pending = wdcp.async_save(model, root, "async", optimizer=opt, staging_bytes=64 << 10)
    W.train_step(model, opt, 2)  # DDP's allreduce on the default group, meanwhile
    rec = pending.result()
    fresh = DDP(W.gpt2(6))
    wdcp.load(fresh, root, rec.name)
    for k, v in want.items():
        assert torch.equal(fresh.module.state_dict()[k], v), k
    return rec.name


def _failing_save(rank: int, model: Any, opt: torch.optim.Optimizer, root: str) -> Any:
    """Ranks 1 and 2 run out of disk: every rank gets one ``Exception`` naming both."""
    import weightvault
    import weightvault.dcp as wdcp

    vault = weightvault.Vault(root)
    if rank in (1, 2):

        def stage(key: str, data: Any) -> str:  # every object write (Store.stage)
            raise OSError(28, f"No space left on device (rank {rank})")

        vault.store.stage = stage  # type: ignore[method-assign]
    W.train_step(model, opt, 3)  # something new to write
    try:
        wdcp.save(model, vault, "bad", optimizer=opt)
    except Exception as e:  # what a training loop catches
        assert isinstance(e, weightvault.DistributedCheckpointError), repr(e)
        return {"failures": sorted(e.failures), "message": str(e),
                "kinds": sorted({type(x).__name__ for x in e.failures.values()})}  # fmt: skip
    raise AssertionError("the save should have failed")


_GC_LOOP = """
import os, sys, time, weightvault
v = weightvault.Vault(sys.argv[1])
runs = freed = 0
deadline = time.monotonic() + 240  # bounded: an orphan if the rank that started it died
while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
    freed += v.gc()
    runs += 1
    time.sleep(0.1)  # saves wait while a gc runs: leave them a gap
print(runs, freed)
"""


def under_gc(rank: int, world: int, root: str, out: str) -> None:
    """FSDP2 saves, deletes and loads while another process runs gc in a loop."""
    import weightvault
    import weightvault.dcp as wdcp

    model = W.shard(W.gpt2(0), world)
    opt = W.optimizer(model)
    wdcp.save(model, root, "g0", optimizer=opt)  # the vault exists before gc runs
    gc = None
    stop = os.path.join(os.path.dirname(out), "stop-gc")
    if rank == 0:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        args = [sys.executable, "-c", _GC_LOOP, root, stop]
        gc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)
    dist.barrier()
    for i in range(1, 4):
        W.train_step(model, opt, i)
        wdcp.save(model, root, f"g{i}", optimizer=opt)
        if rank == 0:
            weightvault.Vault(root).delete(f"g{i - 1}")  # garbage for the gc to free
        fresh = W.shard(W.gpt2(9), world)
        wdcp.load(fresh, root, f"g{i}")
        want, _ = W.full_state(model, None)
        got, _ = W.full_state(fresh, None)
        if rank == 0:
            assert all(torch.equal(got[k], v) for k, v in want.items()), i
    dist.barrier()
    if rank == 0 and gc is not None:
        Path(stop).touch()
        runs, freed = (int(x) for x in gc.communicate(timeout=120)[0].split())
        vault = weightvault.Vault(root)
        _report(out, {"ok": vault.verify().ok, "names": [r.name for r in vault.list()],
                      "gc_runs": runs, "gc_freed": freed})  # fmt: skip


def reshard_to_three(rank: int, world: int, root: str, d: str) -> None:
    """Load the 4-rank checkpoint on 3 ranks, then save on 3 ranks."""
    W.load_fsdp(rank, world, root, f"{d}/oracle4", "s4", f"{d}/reads3.json")
    W.save_fsdp(rank, world, root, f"{d}/oracle3", "s3")


def run_raw(fn: Callable[..., Any], world: int, timeout: float, *args: Any) -> list[int | None]:
    """Run ``fn`` on ``world`` spawned ranks that may die: every rank is waited for (up to
    ``timeout`` seconds) and none is killed because another died. Returns exit codes."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        procs = [
            ctx.Process(target=W._entry, args=(r, world, os.path.join(d, "rdzv"), fn, args))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.time() + timeout
        for p in procs:
            p.join(max(deadline - time.time(), 0))
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        return codes


def killed_mid_load(rank: int, world: int, root: str, out: str) -> None:
    """Rank 1 is SIGKILLed after its first read of a load; the others report how they end."""
    import weightvault.dcp as wdcp
    from weightvault._dcp.reader import VaultReader

    model = W.shard(W.gpt2(0), world)
    opt = W.optimizer(model)
    W.train_step(model, opt, 1)
    wdcp.save(model, root, "k", optimizer=opt)
    flat, _ = W.full_state(model, None)
    if rank == 0:
        W.write_oracle(out + ".oracle", flat, {})
    dist.barrier()
    if rank == 1:
        real = VaultReader._read_box

        def dies(self: Any, *a: Any) -> None:
            real(self, *a)
            os.kill(os.getpid(), signal.SIGKILL)

        VaultReader._read_box = dies  # type: ignore[method-assign]
    fresh = W.shard(W.gpt2(3), world)
    started = time.time()
    try:
        wdcp.load(fresh, root, "k", optimizer=W.optimizer(fresh))
        outcome = {"error": None}
    except BaseException as e:
        outcome = {"error": type(e).__name__, "message": str(e)[:2000],
                   "trace": traceback.format_exc()[-3000:]}  # fmt: skip
    outcome["seconds"] = time.time() - started
    _report(f"{out}.{rank}", outcome)
    os._exit(0)  # the group has a dead member: skip the collective teardown


def s3_roundtrip(rank: int, world: int, vault: Any, out: str) -> None:
    """FSDP2 saved to S3 and loaded back with ranged reads, compared gathered."""
    import weightvault.dcp as wdcp

    model = W.shard(W.gpt2(0), world)
    opt = W.optimizer(model)
    W.train_step(model, opt, 1)
    rec = wdcp.save(model, vault, "s3", optimizer=opt)
    want, want_rest = W.full_state(model, opt)
    fresh = W.shard(W.gpt2(7), world)
    fresh_opt = W.optimizer(fresh)
    stats = wdcp.load(fresh, vault, "s3", optimizer=fresh_opt)
    got, got_rest = W.full_state(fresh, fresh_opt)
    reads: list[Any] = [None] * world
    dist.all_gather_object(reads, [stats.bytes_read, stats.requests, stats.record_bytes])
    if rank == 0:
        assert sorted(got) == sorted(want) and got_rest == want_rest
        for k, v in want.items():
            assert torch.equal(got[k], v), k
        _report(out, {"reads": reads, "stored": rec.stored_bytes})


def oracle_matches(path: str, model: Any) -> None:
    from safetensors.torch import load_file

    want = load_file(path + ".safetensors")
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[f"model.{k}"]), k
