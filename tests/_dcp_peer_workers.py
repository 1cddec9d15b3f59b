"""Rank bodies of tests/test_dcp_peers.py (issue 18), spawned by ``_dcp_workers.run_ranks``.

Each takes ``(rank, world, *args)`` and uses ``_dcp_workers``' tiny tied GPT-2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from _dcp_workers import full_state, gpt2, optimizer, shard, train_step


def latest_race(rank: int, world: int, root: str) -> None:
    """Each rank resolves "latest" on its own while B is committed between the two reads.

    A and B are a Shard(0) DTensor of ``arange(8)`` and ``arange(8) + 100``. Both orders:
    the coordinator reads first (every rank must read A), or the other rank does (every
    rank must read B).
    """
    for first, want in ((0, 0.0), (1, 100.0)):
        _race_round(rank, world, os.path.join(root, f"first-{first}"), first, want)


def _race_round(rank: int, world: int, vault: str, first: int, want: float) -> None:
    """B's record is held back, then committed (renamed into ``checkpoints/``) by rank
    ``first`` right after it read its metadata; the other rank reads its metadata after."""
    import time

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import weightvault.dcp as wdcp

    mesh = init_device_mesh("cpu", (world,))

    def dtensor(base: float) -> Any:
        return distribute_tensor(torch.arange(8.0) + base, mesh, [Shard(0)])

    dcp.save({"x": dtensor(0)}, storage_writer=wdcp.VaultWriter(vault, "A"))
    dcp.save({"x": dtensor(100)}, storage_writer=wdcp.VaultWriter(vault, "B"))
    record, held = Path(vault, "checkpoints", "B.json"), Path(vault, "B.held")
    committed = Path(vault, "B.committed")
    if rank == 0:
        record.rename(held)
    dist.barrier()

    class Racing(wdcp.VaultReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if rank == first:
                metadata = super().read_metadata(*args, **kwargs)
                held.rename(record)  # B is committed now
                committed.touch()
                return metadata
            deadline = time.monotonic() + 60
            while not committed.exists():  # bounded: the other rank may have failed
                assert time.monotonic() < deadline, "rank 0 never committed B"
                time.sleep(0.01)
            return super().read_metadata(*args, **kwargs)

    target = {"x": dtensor(-1000)}
    dcp.load(target, storage_reader=Racing(vault))
    got = target["x"].full_tensor()
    assert torch.equal(got, torch.arange(8.0) + want), (first, got)
    dist.barrier()


def async_process_save(rank: int, world: int, root: str) -> None:
    """``dcp.async_save`` with DCP's process checkpointer: the writer and planner are
    pickled into a checkpoint process, which commits; the checkpoint loads bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import weightvault.dcp as wdcp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the checkpoint process's rendezvous
    model = shard(gpt2(0), world)
    opt = optimizer(model)
    train_step(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    fut = dcp.async_save(
        {"model": msd, "optim": osd},
        storage_writer=wdcp.VaultWriter(root, "async"),
        planner=wdcp.VaultSavePlanner(model_prefix="model."),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    fut.result()
    want, rest = full_state(model, opt)
    fresh = shard(gpt2(3), world)
    fresh_opt = optimizer(fresh)
    wdcp.load(fresh, root, "async", optimizer=fresh_opt)
    got, got_rest = full_state(fresh, fresh_opt)
    if rank == 0:
        assert sorted(got) == sorted(want)
        for k, t in want.items():
            assert torch.equal(got[k], t), k
        assert got_rest == rest


def resume_fresh(rank: int, world: int, root: str) -> None:
    """Train (block 0 frozen), freeze block 1, train, save; resume a fresh, fully trainable
    model with a fresh AdamW: flags, weights and every optimizer state (block 1's included)
    equal the saved ones, and block 0 gets no made-up state."""
    import weightvault.dcp as wdcp

    model = shard(gpt2(0), world)  # block 0 frozen from the start: it has no state
    opt = optimizer(model)
    train_step(model, opt, 1)
    for p in model.transformer["h"][1].parameters():
        p.requires_grad_(False)  # trained, then frozen: AdamW keeps its state
    train_step(model, opt, 2)
    wdcp.save(model, root, "tf", optimizer=opt)
    want, rest = full_state(model, opt)
    fresh = shard(gpt2(5), world)
    for p in fresh.parameters():
        p.requires_grad_(True)
    fresh_opt = optimizer(fresh)
    wdcp.load(fresh, root, "tf", optimizer=fresh_opt)
    flags = [(n, p.requires_grad) for n, p in fresh.named_parameters()]
    assert flags == [(n, p.requires_grad) for n, p in model.named_parameters()]
    got, got_rest = full_state(fresh, fresh_opt)
    if rank == 0:
        assert any(k.startswith("optim.transformer.h.1.") for k in want)
        assert not any(k.startswith("optim.transformer.h.0.") for k in got)
        assert sorted(got) == sorted(want), set(got) ^ set(want)
        for k, t in want.items():
            assert torch.equal(got[k], t), k
        assert got_rest == rest
