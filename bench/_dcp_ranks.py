"""Rank bodies for bench_dcp.py's ``save-load``: gloo ranks on CPU, spawned once per world.

Every rank holds an FSDP2-sharded model (a tied embedding and head, one linear layer)
with AdamW state, and times, side by side and alternating which goes first, DCP's
``FileSystemWriter``/``FileSystemReader`` and the vault's ``VaultWriter``/``VaultReader``
on the same state, both through ``dcp.save``/``dcp.load``. Each repeat writes into fresh
folders (an unchanged vault save would write nothing). A warm-up round touches every
buffer first. Rank 0 reports the minimum over repeats of the slowest rank's time, and
each load's peak memory beyond what the process held before it (``VmHWM``, reset through
``/proc/self/clear_refs``, on every rank; the largest is reported).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MiB = 1 << 20


def _entry(rank: int, world: int, rdzv: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rdzv}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Buffers of 128 KiB and more are mapped and unmapped on free, so RSS shows what a
    # load holds (glibc would otherwise reuse freed heap that RSS already counts).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _entry,
            args=(world, os.path.join(d, "rdzv"), fn, args),
            nprocs=world,
            join=True,
            start_method="spawn",
        )


def sharded_state(mib: int, world: int, kind: str) -> tuple[Any, Any]:
    """A model of about ``mib`` MiB with its AdamW state (a tied embedding), sharded by
    FSDP2 (``kind="fsdp"``) or replicated by DDP (``"ddp"``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    d = 512
    vocab = max(world, (mib << 20) // (3 * d * 4))  # embedding + AdamW's two moments
    emb = torch.nn.Embedding(vocab, d)
    head = torch.nn.Linear(d, vocab, bias=False)
    head.weight = emb.weight
    model: Any = torch.nn.Sequential(emb, torch.nn.Linear(d, d), head)
    if kind == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    else:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, vocab, (2, 4))).sum().backward()
    opt.step()
    return model, opt


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        found = re.search(rf"{field}:\s+(\d+)", f.read())
    return int(found.group(1)) if found else 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS, so the next peak read is what came after
    except OSError:
        pass


def _timed(op: Callable[[], Any]) -> tuple[float, float]:
    """Seconds of ``op`` on the slowest rank, and this rank's peak extra memory in MiB."""
    dist.barrier()
    _reset_peak()
    before = _kib("VmRSS")
    t0 = time.perf_counter()
    op()
    dist.barrier()
    return time.perf_counter() - t0, max(_kib("VmHWM") - before, 0) / 1024


def _ops(state: dict[str, Any], base: str) -> dict[str, Callable[[int], Any]]:
    import torch.distributed.checkpoint as dcp

    import weightvault.dcp as wdcp
    from weightvault._dcp.index import VaultLoadPlanner

    def vault(i: int) -> str:
        return os.path.join(base, f"vault{i}")

    return {
        "fs_save": lambda i: dcp.save(
            state, storage_writer=dcp.FileSystemWriter(os.path.join(base, f"fs{i}"))
        ),
        "wv_save": lambda i: dcp.save(
            state,
            storage_writer=wdcp.VaultWriter(vault(i), "c"),
            planner=wdcp.VaultSavePlanner(model_prefix="model."),
        ),
        "fs_load": lambda i: dcp.load(
            state, storage_reader=dcp.FileSystemReader(os.path.join(base, f"fs{i}"))
        ),
        "wv_load": lambda i: dcp.load(
            state, storage_reader=wdcp.VaultReader(vault(i), "c"), planner=VaultLoadPlanner()
        ),
    }


def save_load(rank: int, world: int, kind: str, mib: int, repeat: int, out: str) -> None:
    """Time both writers and readers on the same sharded state; rank 0 writes ``out``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from weightvault import Vault

    model, opt = sharded_state(mib, world, kind)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    base = os.path.join(os.path.dirname(out), f"run-{world}")
    ops = _ops(state, base)
    times: dict[str, list[float]] = {k: [] for k in ops}
    peaks: dict[str, float] = {k: 0.0 for k in ops}
    largest = 0
    for i in range(repeat + 1):  # round 0 warms up: touches every buffer, starts threads
        order = ["fs", "wv"] if i % 2 else ["wv", "fs"]
        for step in ("save", "load"):
            for which in order:
                op = f"{which}_{step}"
                seconds, peak = _timed(lambda op=op, i=i: ops[op](i))
                if i:
                    times[op].append(seconds)
                    peaks[op] = max(peaks[op], peak)
        dist.barrier()
        if rank == 0:
            with Vault(os.path.join(base, f"vault{i}")).open("c") as ckpt:
                chunks = [c.nbytes(t.dtype) for t in ckpt.tensors.values() for c in t.chunks]
            largest = max(chunks)
            for d in (f"vault{i}", f"fs{i}"):
                shutil.rmtree(os.path.join(base, d), ignore_errors=True)
        dist.barrier()
    all_peaks: list[Any] = [None] * world
    dist.all_gather_object(all_peaks, peaks)
    if rank == 0:
        best = {k: round(min(v), 3) for k, v in times.items()}
        result = {
            "ranks": world,
            "state": kind,
            "state_mib": mib,
            "repeats": repeat,
            "min_seconds": best,
            "load_ratio": round(best["wv_load"] / best["fs_load"], 2),
            "save_ratio": round(best["wv_save"] / best["fs_save"], 2),
            "peak_extra_mib_of_a_load": {
                k: round(max(p[k] for p in all_peaks), 1) for k in ("fs_load", "wv_load")
            },
            "largest_chunk_mib": round(largest / MiB, 1),
        }
        with open(out, "w") as f:
            json.dump(result, f)


def _async_ops(model: Any, opt: Any, base: str, mib: int) -> dict[str, Callable[[int], Any]]:
    """Each asynchronous save: its call returns a future."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import weightvault.dcp as wdcp

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def at(kind: str, i: int) -> str:
        return os.path.join(base, f"{kind}{i}")

    budget = (mib << 20) // 4
    return {
        "fs_dcp_async_save": lambda i: dcp.async_save(
            state(), storage_writer=dcp.FileSystemWriter(at("fs", i))
        ),
        "vault_dcp_async_save": lambda i: dcp.async_save(
            state(),
            storage_writer=wdcp.VaultWriter(at("dv", i), "c"),
            planner=wdcp.VaultSavePlanner(model_prefix="model."),
        ),
        "wdcp_async_save": lambda i: wdcp.async_save(model, at("wv", i), "c", optimizer=opt),
        "wdcp_async_save_quarter_budget": lambda i: wdcp.async_save(
            model, at("wq", i), "c", optimizer=opt, staging_bytes=budget
        ),
    }


def async_saves(rank: int, world: int, mib: int, repeat: int, out: str) -> None:
    """Blocking time, time until committed and peak extra memory of each async save."""
    model, opt = sharded_state(mib, world, "ddp")
    base = os.path.join(os.path.dirname(out), "runs")
    ops = _async_ops(model, opt, base, mib)
    block: dict[str, list[float]] = {k: [] for k in ops}
    total: dict[str, list[float]] = {k: [] for k in ops}
    peak: dict[str, float] = {k: 0.0 for k in ops}
    for i in range(repeat + 1):  # round 0 warms up
        for name, op in ops.items():
            dist.barrier()
            _reset_peak()
            before = _kib("VmRSS")
            t0 = time.perf_counter()
            pending = op(i)
            t_block = time.perf_counter() - t0
            pending.result()
            t_total = time.perf_counter() - t0
            if i:
                block[name].append(t_block)
                total[name].append(t_total)
                peak[name] = max(peak[name], (_kib("VmHWM") - before) / 1024)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
        dist.barrier()
    if rank == 0:
        result = {
            "ranks": world,
            "state_mib": mib,
            "repeats": repeat,
            "blocks_s": {k: round(min(v), 3) for k, v in block.items()},
            "until_committed_s": {k: round(min(v), 3) for k, v in total.items()},
            "peak_extra_mib": {k: round(v, 1) for k, v in peak.items()},
        }
        with open(out, "w") as f:
            json.dump(result, f)
