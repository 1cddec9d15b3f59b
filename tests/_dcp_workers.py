"""Rank bodies for the weightvault.dcp tests: gloo on CPU, spawned by ``run_ranks``.

Functions here run in spawned children, so they live in an importable module; each takes
``(rank, world, *args)``. The model is a tiny GPT-2 whose head is tied to its embedding,
with its first block frozen, trained one AdamW step so the optimizer has state.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

VOCAB, EMBD = 128, 32


def _entry(rank: int, world: int, rdzv: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rdzv}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; a rank's error fails it."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _entry,
            args=(world, os.path.join(d, "rdzv"), fn, args),
            nprocs=world,
            join=True,
            start_method="spawn",
        )


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(EMBD), nn.LayerNorm(EMBD)
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(EMBD, 3 * EMBD), "c_proj": nn.Linear(EMBD, EMBD)})
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(EMBD, 4 * EMBD), "c_proj": nn.Linear(4 * EMBD, EMBD)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn["c_attn"](self.ln_1(x)).split(EMBD, dim=-1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn["c_proj"](a)
        return x + self.mlp["c_proj"](torch.nn.functional.gelu(self.mlp["c_fc"](self.ln_2(x))))


class TinyGPT2(nn.Module):
    """GPT-2's layout and names (transformer.wte ... lm_head), small; the head is tied."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, EMBD),
                "wpe": nn.Embedding(16, EMBD),
                "h": nn.ModuleList([Block(), Block()]),
                "ln_f": nn.LayerNorm(EMBD),
            }
        )
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t["wte"](ids) + t["wpe"](torch.arange(ids.shape[1]))
        for block in t["h"]:
            x = block(x)
        logits: torch.Tensor = self.lm_head(t["ln_f"](x))
        return logits


def gpt2(seed: int) -> Any:
    torch.manual_seed(seed)
    model = TinyGPT2()
    for p in model.transformer["h"][0].parameters():
        p.requires_grad_(False)
    return model


def shard(model: Any, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer["h"]:
        fully_shard(block, mesh=mesh)
    # The root group holds wte and lm_head: a shared parameter must sit in one group.
    fully_shard(model, mesh=mesh)
    assert model.lm_head.weight is model.transformer["wte"].weight
    return model


def train_step(model: Any, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


def optimizer(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def full_state(model: Any, opt: torch.optim.Optimizer | None) -> tuple[dict[str, torch.Tensor], Any]:
    """The gathered full state on rank 0: flat tensors, and the JSON-able rest."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt if opt is not None else [], options=opts)
    if dist.get_rank() != 0:
        return {}, {}  # cpu_offload gathers to rank 0 only
    flat = {f"model.{k}": v.clone() for k, v in msd.items()}
    rest: dict[str, Any] = {}
    if opt is not None:
        for fqn, st in osd["state"].items():
            for k, v in st.items():
                flat[f"optim.{fqn}.{k}"] = v.clone()
        rest["param_groups"] = [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
            for g in osd["param_groups"]
        ]
    return flat, rest


def write_oracle(path: str, flat: dict[str, torch.Tensor], rest: Any) -> None:
    from safetensors.torch import save_file

    # The tie makes two names share memory; the oracle keeps independent copies.
    save_file({k: v.contiguous().clone() for k, v in flat.items()}, path + ".safetensors")
    with open(path + ".json", "w") as f:
        json.dump(rest, f)


def assert_matches_oracle(path: str, flat: dict[str, torch.Tensor], rest: Any) -> None:
    from safetensors.torch import load_file

    want = load_file(path + ".safetensors")
    assert sorted(flat) == sorted(want), set(flat) ^ set(want)
    for k, v in want.items():
        got = flat[k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got.view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k
    with open(path + ".json") as f:
        assert json.load(f) == json.loads(json.dumps(rest))


# -- rank bodies ------------------------------------------------------------------------


def save_fsdp(rank: int, world: int, root: str, oracle: str, name: str) -> None:
    """Shard, train a step, save with weightvault.dcp, and write the gathered oracle."""
    import weightvault.dcp as wdcp

    model = shard(gpt2(0), world)
    opt = optimizer(model)
    train_step(model, opt, 1)
    rec = wdcp.save(model, root, name, optimizer=opt, metadata={"step": "1"})
    assert rec.name == name
    flat, rest = full_state(model, opt)
    if rank == 0:
        write_oracle(oracle, flat, rest)
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        with open(oracle + ".frozen.json", "w") as f:
            json.dump(frozen, f)


def load_fsdp(rank: int, world: int, root: str, oracle: str, name: str, stats_path: str) -> None:
    """Load into a differently initialised model sharded over ``world`` ranks; compare."""
    import weightvault.dcp as wdcp

    model = shard(gpt2(7), world)
    opt = optimizer(model)
    stats = wdcp.load(model, root, name, optimizer=opt)
    assert model.lm_head.weight is model.transformer["wte"].weight
    flat, rest = full_state(model, opt)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    reads = [None] * world
    dist.all_gather_object(reads, stats.bytes_read)
    if rank == 0:
        assert_matches_oracle(oracle, flat, rest)
        with open(oracle + ".frozen.json") as f:
            assert frozen == json.load(f)
        with open(stats_path, "w") as f:
            json.dump(reads, f)
