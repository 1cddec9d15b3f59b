"""weightvault.dcp against DCP's FileSystemWriter/FileSystemReader, and the cost at 1,024 ranks.

Three commands::

    python bench/bench_dcp.py plan --ranks 1024       # planning, record, one rank's load
    python bench/bench_dcp.py save-load --ranks 2 4   # save/load time on gloo ranks
    python bench/bench_dcp.py async --mib 64          # how long dcp.async_save blocks

``plan`` simulates 1,024 FSDP ranks of a Llama-3.2-1B-shaped model in one process (see
``bench/_dcp_sim.py``): rank 0's global plan with and without the plan cache, the record,
and what one loading rank reads of it.

``save-load`` spawns 2 and 4 gloo ranks holding an FSDP2-sharded (or DDP-replicated)
state and times ``FileSystemWriter``/``FileSystemReader`` against ``VaultWriter``/
``VaultReader`` side by side, alternating, reporting minimums (``bench/_dcp_ranks.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import weightvault.dcp as wdcp


def _state(mib: int) -> dict[str, Any]:
    torch.manual_seed(0)
    d = 512
    vocab = max(1, (mib << 20) // (4 * d * 4))  # embedding + AdamW's two moments ~ 3/4 of it
    emb = torch.nn.Embedding(vocab, d)
    head = torch.nn.Linear(d, vocab, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, torch.nn.Linear(d, d), head)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, vocab, (4,))).sum().backward()
    opt.step()
    return {"model": model, "opt": opt}


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(path) for f in fs)


def save_load(mib: int, repeat: int, ranks: list[int], states: list[str]) -> list[Any]:
    """``FileSystemWriter``/``Reader`` against ``VaultWriter``/``Reader`` on gloo ranks."""
    import _dcp_ranks

    out = []
    with tempfile.TemporaryDirectory(prefix="bench-dcp-") as d:
        for kind in states:
            for world in ranks:
                path = os.path.join(d, f"result-{kind}-{world}.json")
                _dcp_ranks.run_ranks(_dcp_ranks.save_load, world, kind, mib, repeat, path)
                with open(path) as f:
                    out.append(json.load(f))
    return out


def async_blocking(mib: int, repeat: int) -> dict[str, Any]:
    """How long ``dcp.async_save`` blocks the training loop, and how long until durable."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    s = _state(mib)
    model = s["model"]
    base = tempfile.mkdtemp(prefix="bench-dcp-async-")
    dist.init_process_group("gloo", init_method=f"file://{base}/rdzv", rank=0, world_size=1)
    out: dict[str, Any] = {}
    try:
        times: dict[str, list[float]] = {
            k: [] for k in ("fs_block", "fs_total", "wv_block", "wv_total")
        }
        for i in range(repeat):
            for kind in ("fs", "wv"):
                state = {"model": model.state_dict()}
                if kind == "fs":
                    writer: Any = dcp.FileSystemWriter(os.path.join(base, f"fs{i}"))
                    planner = None
                else:
                    writer = wdcp.VaultWriter(os.path.join(base, f"v{i}"), "a")
                    planner = wdcp.VaultSavePlanner(model_prefix="model.")
                t0 = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=writer, planner=planner)
                times[f"{kind}_block"].append(time.perf_counter() - t0)
                fut.result()
                times[f"{kind}_total"].append(time.perf_counter() - t0)
        out = {k: round(statistics.median(v), 3) for k, v in times.items()}
    finally:
        dist.destroy_process_group()
        shutil.rmtree(base, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--ranks", type=int, default=1024)
    s = sub.add_parser("save-load")
    s.add_argument("--mib", type=int, default=64)
    s.add_argument("--repeat", type=int, default=5)
    s.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    s.add_argument("--state", nargs="+", choices=["fsdp", "ddp"], default=["fsdp", "ddp"])
    a = sub.add_parser("async")
    a.add_argument("--mib", type=int, default=64)
    a.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "plan":
        import _dcp_sim

        result = _dcp_sim.plan_sim(args.ranks)
    elif args.cmd == "async":
        result = async_blocking(args.mib, args.repeat)
    else:
        result = save_load(args.mib, args.repeat, args.ranks, args.state)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
