"""Rank bodies for the weightvault.dcp tests: gloo on CPU, spawned by ``run_ranks``.

Functions here run in spawned children, so they live in an importable module; each takes
``(rank, world, *args)``. The model is a tiny GPT-2 whose head is tied to its embedding,
with its first block frozen, trained one AdamW step so the optimizer has state.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
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
    # The rank's work is done and checked. Leave before interpreter teardown: an FSDP
    # device mesh still holds the gloo group, and destroying it during finalization
    # aborts now and then ("terminate called without an active exception"), which
    # failed CI on a rank whose load had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; a rank's error fails it, and
    so does running past ``timeout`` seconds (every rank is killed first): a rank stuck in a
    collective fails the test instead of hanging the suite."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        ranks = mp.start_processes(
            _entry,
            args=(world, os.path.join(d, "rdzv"), fn, args),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ranks.join(max(min(deadline - time.monotonic(), 5.0), 0.1)):
            if time.monotonic() > deadline:
                for p in ranks.processes:
                    if p.is_alive():
                        p.kill()
                raise AssertionError(f"{fn.__name__} on {world} ranks ran past {timeout} s")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(EMBD), nn.LayerNorm(EMBD)
        self.attn = nn.ModuleDict(
            {"c_attn": nn.Linear(EMBD, 3 * EMBD), "c_proj": nn.Linear(EMBD, EMBD)}
        )
        self.mlp = nn.ModuleDict(
            {"c_fc": nn.Linear(EMBD, 4 * EMBD), "c_proj": nn.Linear(4 * EMBD, EMBD)}
        )

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


def full_state(
    model: Any, opt: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], Any]:
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


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def save_fsdp(rank: int, world: int, root: str, oracle: str, name: str) -> None:
    """Shard, train a step, save with weightvault.dcp (twice), and write the gathered oracle.

    Beside it, DCP's FileSystemWriter saves the same state; rank 0 writes both sizes, the
    unique bytes of the state and the second checkpoint's new bytes to ``oracle.sizes.json``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import weightvault.dcp as wdcp

    model = shard(gpt2(0), world)
    opt = optimizer(model)
    train_step(model, opt, 1)
    rec = wdcp.save(model, root, name, optimizer=opt, metadata={"step": "1"})
    assert rec.name == name
    with open(os.path.join(root, "checkpoints", f"{name}.json")) as f:
        tables = sum(json.load(f)["dcp"]["table_sizes"])  # the chunk index, not tensor bytes
    objects = _dir_bytes(os.path.join(root, "objects")) - tables
    msd, osd = get_state_dict(model, opt)
    fs_dir = oracle + ".distcp"
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(fs_dir))
    flat, rest = full_state(model, opt)
    if rank == 0:
        write_oracle(oracle, flat, rest)
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        with open(oracle + ".frozen.json", "w") as f:
            json.dump(frozen, f)
    # A second step: the frozen block's chunks are already in the vault.
    train_step(model, opt, 2)
    rec2 = wdcp.save(model, root, name + "-next", optimizer=opt)
    if rank == 0:
        unique = sum(
            v.numel() * v.element_size() for k, v in flat.items() if k != "model.lm_head.weight"
        )
        frozen_bytes = sum(
            v.numel() * v.element_size()
            for k, v in flat.items()
            if k.startswith("model.transformer.h.0.")
        )
        sizes = {
            "unique": unique,
            "vault_objects": objects,
            "filesystem_writer": _dir_bytes(fs_dir),
            "record_stored": rec.stored_bytes,
            "next_new": rec2.new_bytes,
            "next_stored": rec2.stored_bytes,
            "frozen_bytes": frozen_bytes,
        }
        with open(oracle + ".sizes.json", "w") as f:
            json.dump(sizes, f)


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


def ddp_roundtrip(rank: int, world: int, root: str) -> None:
    """DDP replicates every tensor: each is written by one rank, and loads back equal."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import weightvault.dcp as wdcp

    model = DDP(gpt2(0))
    opt = optimizer(model)
    train_step(model, opt, 1)
    writer_bytes: list[Any] = [None] * world
    # Keep a handle on the writer save() makes, to read this rank's counts.
    real = wdcp.VaultWriter
    made: list[Any] = []

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            made.append(self)

    wdcp.VaultWriter = Counting  # type: ignore[misc]
    try:
        rec = wdcp.save(model, root, "ddp", optimizer=opt)
    finally:
        wdcp.VaultWriter = real  # type: ignore[misc]
    counts: list[Any] = [None] * world
    dist.all_gather_object(counts, made[0].chunks)
    dist.all_gather_object(writer_bytes, made[0].written_bytes)
    doc = json.loads((Path(root) / "checkpoints" / "ddp.json").read_text())
    # Every replicated tensor is planned on exactly one rank, and DCP spreads them.
    assert sum(counts) == sum(len(t["chunks"]) for t in doc["dcp"]["tensors"].values())
    assert all(c > 0 for c in counts), counts
    # Bytes: once across ranks. Two ranks may race to write one object for two equal
    # tensors (equal bytes, harmless), so allow at most the small ones twice.
    assert rec.stored_bytes <= sum(writer_bytes) <= rec.stored_bytes + 4096, writer_bytes
    want = {k: v.clone() for k, v in model.module.state_dict().items()}
    want_opt = {
        k: {n: t.clone() for n, t in st.items()} for k, st in opt.state_dict()["state"].items()
    }
    fresh = DDP(gpt2(5))
    fresh_opt = optimizer(fresh)
    wdcp.load(fresh, root, "ddp", optimizer=fresh_opt)
    got = fresh.module.state_dict()
    assert fresh.module.lm_head.weight is fresh.module.transformer["wte"].weight
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    got_opt = fresh_opt.state_dict()["state"]
    assert got_opt.keys() == want_opt.keys()
    for k, st in want_opt.items():
        for n, t in st.items():
            assert torch.equal(got_opt[k][n], t), (k, n)


class _Crash(RuntimeError):
    pass


def crash_mid_save(rank: int, world: int, root: str) -> None:
    """Rank 1 fails after writing some objects: nothing is committed, the earlier loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import weightvault
    import weightvault.dcp as wdcp

    model = shard(gpt2(0), world)
    opt = optimizer(model)
    train_step(model, opt, 1)
    wdcp.save(model, root, "good", optimizer=opt)
    want, rest = full_state(model, opt)
    train_step(model, opt, 2)

    def fail() -> None:
        raise _Crash("disk gone")

    Failing = _breaks_on_rank_1(fail)
    msd, osd = get_state_dict(model, opt)
    try:
        dcp.save(
            {"model": msd, "optim": osd},
            storage_writer=Failing(weightvault.Vault(root), "bad"),
            planner=wdcp.VaultSavePlanner(model_prefix="model."),
        )
    except CheckpointException as e:  # DCP raises a rank's error on every rank
        assert "disk gone" in str(e), e
    else:
        raise AssertionError("the save should have failed")
    dist.barrier()
    v = weightvault.Vault(root)
    assert [r.name for r in v.list()] == ["good"]
    fresh = shard(gpt2(3), world)
    fresh_opt = optimizer(fresh)
    wdcp.load(fresh, root, "latest", optimizer=fresh_opt)
    got, got_rest = full_state(fresh, fresh_opt)
    if rank == 0:
        assert sorted(got) == sorted(want)
        for k, t in want.items():
            assert torch.equal(got[k], t), k
        assert got_rest == rest


def killed_mid_save(rank: int, world: int, root: str, oracle: str) -> None:
    """Rank 1 is SIGKILLed after writing some objects of the second checkpoint."""
    import signal

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import weightvault
    import weightvault.dcp as wdcp

    model = shard(gpt2(0), world)
    opt = optimizer(model)
    train_step(model, opt, 1)
    wdcp.save(model, root, "good", optimizer=opt)
    flat, rest = full_state(model, None)
    if rank == 0:
        write_oracle(oracle, flat, rest)
    dist.barrier()
    train_step(model, opt, 2)

    Killed = _breaks_on_rank_1(lambda: os.kill(os.getpid(), signal.SIGKILL))  # no cleanup
    msd, osd = get_state_dict(model, opt)
    dcp.save(
        {"model": msd, "optim": osd},
        storage_writer=Killed(weightvault.Vault(root), "bad"),
        planner=wdcp.VaultSavePlanner(model_prefix="model."),
    )


def _breaks_on_rank_1(breaks: Callable[[], None]) -> Any:
    """A VaultWriter whose rank 1 calls ``breaks`` once it has written two objects."""
    import weightvault.dcp as wdcp

    class Breaking(wdcp.VaultWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            if dist.get_rank() == 1:
                store = self.vault.store
                real_stage = store.stage
                calls = [0]

                def stage(key: str, data: Any) -> str:
                    # Objects are staged, then published together (see Store.stage).
                    calls[0] += 1
                    if calls[0] > 2:
                        breaks()
                    return real_stage(key, data)

                store.stage = stage  # type: ignore[method-assign]
            return super().write_data(plan, planner)

    return Breaking
