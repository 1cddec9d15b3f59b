"""bench_dcp.py's ``plan``: 1,024 FSDP ranks of a Llama-3.2-1B-shaped model, simulated.

It builds the local save plans those ranks would send (tied embedding, bf16, AdamW
state), without tensors, then runs what each side runs:

- rank 0: the vault planner's global plan (ties, DCP's replica dedup, validation), once
  with an empty plan cache and once more when every rank sends "unchanged";
- every rank: its chunk table (written to a real vault folder, one object per rank);
- rank 0: the commit record built from every rank's write results;
- one loading rank: read the index, list the chunks its shard overlaps, read the chunk
  tables that hold them.

Times are CPU seconds of this process (``time.process_time``): the machine is shared.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

import weightvault.dcp as wdcp
from weightvault import Vault
from weightvault._dcp.plancache import same_plan, unchanged
from weightvault._dcp.record import Written
from weightvault._dcp.writer import chunk_table
from weightvault._vault.objects.address import content_hash, object_key

Box = tuple[tuple[int, ...], tuple[int, ...]]


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


def rows(n: int, ranks: int, r: int) -> tuple[int, int]:
    """FSDP2's rows of rank ``r``: ceil(n / ranks) each; trailing ranks get fewer or none."""
    per = -(-n // ranks)
    start = min(r * per, n)
    return start, min(per, n - start)


def _item(name: str, box: Box, dtype: torch.dtype, shape: tuple[int, ...]) -> WriteItem:
    offsets, sizes = box
    kind = WriteItemType.SHARD if shape else WriteItemType.TENSOR
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    data = TensorWriteData(chunk, TensorProperties(dtype), torch.Size(shape))
    return WriteItem(index=MetadataIndex(name, torch.Size(offsets)), type=kind, tensor_data=data)


def rank_boxes(r: int, ranks: int) -> dict[str, tuple[Box, torch.dtype, tuple[int, ...]]]:
    """Every tensor rank ``r`` holds: its box, dtype and global shape."""
    out: dict[str, tuple[Box, torch.dtype, tuple[int, ...]]] = {}
    for fqn, shape in llama_1b_shapes().items():
        start, n = rows(shape[0], ranks, r)
        box = ((start, *([0] * (len(shape) - 1))), (n, *shape[1:]))
        out[f"model.{fqn}"] = (box, torch.bfloat16, shape)
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"optim.state.{fqn}.{moment}"] = (box, torch.float32, shape)
        out[f"optim.state.{fqn}.step"] = (((), ()), torch.float32, ())  # replicated
    return out


def local_plan(r: int, ranks: int) -> SavePlan:
    """What rank ``r``'s VaultSavePlanner.create_local_plan returns, built without tensors."""
    items, same = [], {}
    for name, (box, dtype, shape) in rank_boxes(r, ranks).items():
        items.append(_item(name, box, dtype, shape))
        same[name] = [(None, box)]
    # The tied head: the same local memory as the embedding on every rank.
    box, dtype, shape = rank_boxes(r, ranks)["model.tok_embeddings.weight"]
    items.append(_item("model.output.weight", box, dtype, shape))
    same["model.output.weight"] = [("model.tok_embeddings.weight" if box[1][0] else "empty", box)]
    return SavePlan(items, planner_data={"mappings": {}, "same_memory": same})


def _now() -> float:
    return time.process_time()


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _plan_twice(ranks: int) -> tuple[dict[str, Any], Any, Any]:
    """Rank 0's global plan with an empty cache, then with every rank unchanged."""
    out: dict[str, Any] = {}
    t0 = _now()
    plans = [local_plan(r, ranks) for r in range(ranks)]
    out["build_local_plans_s"] = round(_now() - t0, 2)
    out["local_items"] = sum(len(p.items) for p in plans)
    key = f"sim-{ranks}"
    planner = wdcp.VaultSavePlanner(model_prefix="model.", enable_plan_caching=True, cache_key=key)
    t0 = _now()
    global_plans, metadata = planner.create_global_plan(plans)
    out["coordinator_global_plan_s"] = _now() - t0
    out["global_items"] = sum(len(p.items) for p in global_plans)
    # The next save: each rank compares its new local plan with its cached one ...
    t0 = _now()
    assert same_plan(local_plan(ranks // 2, ranks), plans[ranks // 2])
    out["rank_plan_compare_s"] = round(_now() - t0, 3)
    # ... and sends "unchanged"; a new planner of the same checkpointer plans again.
    again = wdcp.VaultSavePlanner(model_prefix="model.", enable_plan_caching=True, cache_key=key)
    t0 = _now()
    deltas, cached = again.create_global_plan([unchanged() for _ in range(ranks)])
    out["coordinator_cached_plan_s"] = _now() - t0
    assert cached is metadata and again.ties == planner.ties
    assert not any(getattr(p, "usable", True) for p in deltas)
    out["cached_over_first"] = round(
        out["coordinator_cached_plan_s"] / out["coordinator_global_plan_s"], 5
    )
    out["coordinator_global_plan_s"] = round(out["coordinator_global_plan_s"], 2)
    out["coordinator_cached_plan_s"] = round(out["coordinator_cached_plan_s"], 4)
    out["ties"] = planner.ties
    return out, global_plans, (metadata, planner)


def _write_results(vault: Vault, plans: list[SavePlan]) -> tuple[list[list[WriteResult]], float]:
    """Every rank's results, its chunk table written as an object; seconds per rank."""
    results, spent = [], 0.0
    for r, p in enumerate(plans):
        digests = {i: f"{hash((r, i)) & (2**256 - 1):064x}" for i in range(len(p.items))}
        t0 = _now()
        table = chunk_table(p.items, digests)
        table_digest = content_hash(table) if table is not None else None
        if table is not None and table_digest is not None:
            vault.store.put(object_key(table_digest), table)
        spent += _now() - t0
        out = []
        for i, item in enumerate(p.items):
            nbytes = item.tensor_storage_size() or 0
            w = Written(digests[i], nbytes, True, f"intents/sim-{r}.json", table_digest,
                        len(table or b""))  # fmt: skip
            out.append(WriteResult(item.index, nbytes, w))
        results.append(out)
    return results, spent / len(plans)


def _load_one_rank(vault: Vault, r: int, ranks: int) -> dict[str, Any]:
    """What loading rank ``r`` reads of the record, and its CPU seconds on metadata."""
    reader = wdcp.VaultReader(vault, "sim")
    t0 = _now()
    md = reader.read_metadata()
    t_index = _now() - t0
    boxes = {n: [b] for n, (b, _, _) in rank_boxes(r, ranks).items()}
    boxes["model.output.weight"] = boxes["model.tok_embeddings.weight"]
    t0 = _now()
    reader.index.fill(md, boxes)  # what VaultLoadPlanner does with the rank's state
    keys = [
        (fqn, tuple(c.offsets))
        for fqn, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
        for c in m.chunks
    ]
    reader.index.load_tables(reader.index.tables_for(keys))
    for fqn, offsets in keys:
        reader.index.chunk(fqn, offsets)
    t_rest = _now() - t0
    full = wdcp.VaultReader(vault, "sim")
    md_full = full.read_metadata()
    t0 = _now()
    full.index.fill(md_full, None)  # what a plain dcp.load with another planner lists
    return {
        "load_rank": r,
        "load_chunks_needed": len(keys),
        "load_record_bytes": reader.stats.record_bytes + reader.index.table_bytes,
        "load_tables_read": len(reader.index.tables_for(keys)),
        "load_metadata_s": round(t_index + t_rest, 3),
        "load_index_s": round(t_index, 3),
        "load_every_chunk_listed_s": round(_now() - t0, 2),
    }


def plan_sim(ranks: int) -> dict[str, Any]:
    """The simulation; see the module docstring."""
    out, global_plans, (metadata, planner) = _plan_twice(ranks)
    with tempfile.TemporaryDirectory() as d:
        vault = Vault(d, create=True)
        results, per_rank = _write_results(vault, global_plans)
        out["rank_chunk_table_s"] = round(per_rank, 4)
        writer = wdcp.VaultWriter(vault, "sim")
        writer._info = planner.info()
        t0 = _now()
        writer.finish(metadata, results)
        out["coordinator_record_s"] = round(_now() - t0, 2)
        out["record_bytes"] = os.path.getsize(os.path.join(d, "checkpoints", "sim.json"))
        with open(os.path.join(d, "checkpoints", "sim.json")) as f:
            tables = json.load(f)["dcp"]["table_sizes"]
        out["chunk_tables"] = len([t for t in tables if t])
        out["chunk_table_bytes_max"] = max(tables)
        out |= _load_one_rank(vault, ranks // 2, ranks)
    out["clock"] = "process CPU seconds"
    out["peak_rss_mib"] = round(_peak_mib(), 1)
    return out
