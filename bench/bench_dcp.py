"""weightvault.dcp against DCP's FileSystemWriter, and the coordinator's cost at 1,024 ranks.

Two commands::

    python bench/bench_dcp.py plan --ranks 1024     # planning + record, simulated in one process
    python bench/bench_dcp.py save-load --mib 64    # save/load time on the same state
    python bench/bench_dcp.py async --mib 64        # how long dcp.async_save blocks

``plan`` builds the local save plans that 1,024 FSDP ranks would send for a Llama-3.2-1B
shaped model (tied embedding, bf16, AdamW state), then runs what rank 0 runs: the vault
planner's global plan (ties, DCP's replica dedup, validation) and the commit record built
from every rank's write results. It prints times, the record's size and peak memory.

``save-load`` saves and loads one state (a tied model plus AdamW state, in one process,
no process group) with ``FileSystemWriter``/``FileSystemReader`` and with
``VaultWriter``/``VaultReader``, and prints the median of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import weightvault.dcp as wdcp
from weightvault import Vault


def llama_1b_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Llama-3.2-1B-like model (16 layers, d=2048, tied embedding)."""
    d, ff, kv = 2048, 8192, 512
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (128256, d)}
    for i in range(16):
        p = f"layers.{i}."
        shapes |= {
            p + "attention.wq.weight": (d, d),
            p + "attention.wk.weight": (kv, d),
            p + "attention.wv.weight": (kv, d),
            p + "attention.wo.weight": (d, d),
            p + "feed_forward.w1.weight": (ff, d),
            p + "feed_forward.w2.weight": (d, ff),
            p + "feed_forward.w3.weight": (ff, d),
            p + "attention_norm.weight": (d,),
            p + "ffn_norm.weight": (d,),
        }
    shapes["norm.weight"] = (d,)
    return shapes


def _rows(n: int, ranks: int, r: int) -> tuple[int, int]:
    # FSDP2 pads to ceil(n / ranks) rows per rank; trailing ranks may get fewer or none.
    per = -(-n // ranks)
    start = min(r * per, n)
    return start, min(per, n - start)


def local_plans(ranks: int) -> list[SavePlan]:
    """What each rank's VaultSavePlanner.create_local_plan returns, built without tensors."""
    shapes = llama_1b_shapes()
    plans = []
    for r in range(ranks):
        items, same = [], {}
        for fqn, shape in shapes.items():
            start, rows = _rows(shape[0], ranks, r)
            offsets, sizes = (start, *([0] * (len(shape) - 1))), (rows, *shape[1:])
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            for name in (
                f"model.{fqn}",
                f"optim.state.{fqn}.exp_avg",
                f"optim.state.{fqn}.exp_avg_sq",
            ):
                dtype = torch.bfloat16 if name.startswith("model.") else torch.float32
                items.append(
                    WriteItem(
                        index=MetadataIndex(name, torch.Size(offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk, TensorProperties(dtype), torch.Size(shape)
                        ),
                    )
                )
                same[name] = [(None, (offsets, sizes))]
            step = f"optim.state.{fqn}.step"  # a replicated scalar on every rank
            items.append(
                WriteItem(
                    index=MetadataIndex(step, torch.Size([])),
                    type=WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(
                        ChunkStorageMetadata(torch.Size([]), torch.Size([])),
                        TensorProperties(torch.float32),
                        torch.Size([]),
                    ),
                )
            )
            same[step] = [(None, ((), ()))]
        # The tied head: the same local memory as the embedding on every rank.
        emb = shapes["tok_embeddings.weight"]
        start, rows = _rows(emb[0], ranks, r)
        box = ((start, 0), (rows, emb[1]))
        items.append(
            WriteItem(
                index=MetadataIndex("model.output.weight", torch.Size(box[0])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    ChunkStorageMetadata(torch.Size(box[0]), torch.Size(box[1])),
                    TensorProperties(torch.bfloat16),
                    torch.Size(emb),
                ),
            )
        )
        same["model.output.weight"] = [("model.tok_embeddings.weight" if rows else "empty", box)]
        plans.append(SavePlan(items, planner_data={"mappings": {}, "same_memory": same}))
    return plans


def _now() -> float:
    # CPU seconds of this process: the machine is shared, and wall time would count others.
    return time.process_time()


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def plan_sim(ranks: int) -> dict[str, Any]:
    t0 = _now()
    plans = local_plans(ranks)
    t_build = _now() - t0
    items = sum(len(p.items) for p in plans)
    before = _peak_mib()
    planner = wdcp.VaultSavePlanner(model_prefix="model.")
    t0 = _now()
    global_plans, metadata = planner.create_global_plan(plans)
    t_plan = _now() - t0
    kept = sum(len(p.items) for p in global_plans)
    results = []
    for r, p in enumerate(global_plans):
        out = []
        for i, item in enumerate(p.items):
            digest = f"{hash((r, i)) & (2**256 - 1):064x}"
            nbytes = item.tensor_storage_size() or 0
            out.append(
                WriteResult(
                    item.index, nbytes, wdcp._Written(digest, nbytes, True, f"intents/sim-{r}.json")
                )
            )
        results.append(out)
    with tempfile.TemporaryDirectory() as d:
        writer = wdcp.VaultWriter(Vault(d), "sim")
        writer._info = planner.info()
        t0 = _now()
        writer.finish(metadata, results)
        t_finish = _now() - t0
        record = os.path.getsize(os.path.join(d, "checkpoints", "sim.json"))
        t0 = _now()
        meta = wdcp.VaultReader(Vault(d), "sim").read_metadata()
        t_read = _now() - t0
    return {
        "ranks": ranks,
        "local_items": items,
        "global_items": kept,
        "ties": planner.ties,
        "clock": "process CPU seconds",
        "build_local_plans_s": round(t_build, 2),
        "coordinator_global_plan_s": round(t_plan, 2),
        "coordinator_record_s": round(t_finish, 2),
        "record_bytes": record,
        "read_metadata_s": round(t_read, 2),
        "metadata_entries": len(meta.state_dict_metadata),
        "peak_rss_mib": round(_peak_mib(), 1),
        "peak_rss_before_global_plan_mib": round(before, 1),
    }


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
        result = plan_sim(args.ranks)
    elif args.cmd == "async":
        result = async_blocking(args.mib, args.repeat)
    else:
        result = save_load(args.mib, args.repeat, args.ranks, args.state)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
