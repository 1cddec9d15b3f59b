"""Each replicated box read once: one rank reads it from the store, the others receive it.

Under DDP every rank loads every tensor; under HSDP each replica group loads the same
shards. DCP has each rank read what it needs on its own, so the store serves every byte
once per replica. The coordinator sees every rank's load plan (DCP gathers them), finds
boxes that several ranks read identically (same chunk, same offsets and lengths), and
gives each to the holder with the fewest bytes so far. That rank reads it and sends it
to the others over the process group, point to point; they receive straight into their
destination where it is one contiguous run of CPU memory.

Before anything is sent, the ranks agree that every read succeeded, so a rank that
failed to read makes every rank raise rather than wait for bytes that never come.

Example:
    >>> shares = assign_reads(plans)        # on the coordinator, one per rank
    >>> shares[1].recv                      # (item, source rank, tag) for rank 1
    ((0, 0, 0), (1, 0, 1))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from .._base.dtypes import numel
from .._base.errors import DistributedCheckpointError
from .planner import storage_key
from .ranged import host_bytes

__all__ = ["Shares", "Stamp", "agree", "assign_reads", "exchange", "own_reads"]


@dataclass(frozen=True)
class Shares:
    """One rank's part in reading replicated boxes once.

    Attributes:
        send: ``(item, receivers, tag)``: this rank reads item ``item`` (its position among
            the plan's tensor items) and sends it to ``receivers``.
        recv: ``(item, source, tag)``: this rank receives item ``item`` from ``source``.
        copies: ``(item, from)``: item ``item`` is the same box as received item ``from``
            (a tied tensor's second name): copied once that one arrives.
    """

    send: tuple[tuple[int, tuple[int, ...], int], ...] = ()
    recv: tuple[tuple[int, int, int], ...] = ()
    copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Stamp:
    """What the coordinator puts on every rank's load plan: the checkpoint, and shares."""

    checkpoint: str
    shares: Shares | None = None


def _key(item: ReadItem, canonical: Callable[[str], str]) -> tuple[Any, ...]:
    """What a read item reads: a box of a stored chunk (a tie's alias reads its canonical)."""
    index = item.storage_index
    return (
        canonical(index.fqn),
        tuple(index.offset or ()),
        tuple(item.storage_offsets),
        tuple(item.lengths),
    )


def assign_reads(plans: Sequence[LoadPlan], canonical: Callable[[str], str]) -> list[Shares]:
    """Per rank, the boxes it reads for others and those it receives (coordinator).

    Args:
        plans: Every rank's load plan.
        canonical: The stored tensor a name reads (itself, or a tie's canonical name).
    """
    holders: dict[tuple[Any, ...], dict[int, list[int]]] = {}
    for rank, plan in enumerate(plans):
        tensors = [r for r in plan.items if r.type != LoadItemType.BYTE_IO]
        for pos, item in enumerate(tensors):
            holders.setdefault(_key(item, canonical), {}).setdefault(rank, []).append(pos)
    load = [0] * len(plans)
    send: list[list[tuple[int, tuple[int, ...], int]]] = [[] for _ in plans]
    recv: list[list[tuple[int, int, int]]] = [[] for _ in plans]
    copies: list[list[tuple[int, int]]] = [[] for _ in plans]
    shared = [(k, h) for k, h in holders.items() if len(h) > 1]
    # Largest first, each to the holder with the fewest bytes so far: balanced reads.
    shared.sort(key=lambda kh: -numel(kh[0][3]))
    for tag, (key, held) in enumerate(shared):
        reader = min(held, key=lambda r: (load[r], r))
        load[reader] += numel(key[3])
        others = tuple(sorted(r for r in held if r != reader))
        send[reader].append((held[reader][0], others, tag))
        for r in others:
            first, *rest = held[r]
            recv[r].append((first, reader, tag))
            copies[r] += [(pos, first) for pos in rest]
    return [
        Shares(tuple(s), tuple(r), tuple(c)) for s, r, c in zip(send, recv, copies, strict=True)
    ]


def own_reads(tensors: Sequence[ReadItem], shares: Shares | None) -> list[ReadItem]:
    """The tensor items this rank reads from the store itself."""
    if shares is None:
        return list(tensors)
    elsewhere = {pos for pos, _, _ in shares.recv} | {pos for pos, _ in shares.copies}
    return [r for i, r in enumerate(tensors) if i not in elsewhere]


def agree(read: Callable[[], None], where: str) -> None:
    """Run this rank's reads, then learn whether every rank's succeeded (collective).

    Raises:
        DistributedCheckpointError: Another rank failed (this rank's own error is raised
            as it is).
    """
    error: BaseException | None = None
    try:
        read()
    except Exception as e:  # every rank must reach the vote below, or the others hang
        error = e
    votes = torch.zeros(dist.get_world_size(), dtype=torch.int32)
    votes[dist.get_rank()] = int(error is not None)
    dist.all_reduce(votes)
    if error is not None:
        raise error
    failed = [r for r, v in enumerate(votes.tolist()) if v]
    if failed:
        raise DistributedCheckpointError(
            f"{where}: rank(s) {failed} failed to read their part of the checkpoint, so "
            "this rank received nothing from them; see those ranks' errors"
        )


def _wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s bytes as one contiguous uint8 CPU tensor in dtype ``dtype`` (to send)."""
    t = t.detach().to("cpu", dtype).contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def exchange(
    tensors: Sequence[ReadItem],
    shares: Shares,
    planner: LoadPlanner,
    read: dict[int, torch.Tensor],
    dtypes: Callable[[ReadItem], torch.dtype],
) -> tuple[int, int]:
    """Send the boxes this rank read to their receivers, and receive the others.

    Args:
        tensors: This rank's tensor items, in plan order.
        shares: Its part.
        planner: The load planner (receivers resolve and commit their destinations).
        read: ``{item: destination}`` of the items this rank read and sends.
        dtypes: The stored dtype of an item: what travels.

    Returns:
        Bytes sent and bytes received.
    """
    ops: list[Any] = []
    sent = received = 0
    for pos, receivers, tag in shares.send:
        wire = _wire(read[pos], dtypes(tensors[pos]))
        for r in receivers:
            ops.append(dist.isend(wire, r, tag=tag))
            sent += wire.numel()
    landing: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None, torch.dtype]] = []
    for pos, source, tag in shares.recv:
        req = tensors[pos]
        dst = planner.resolve_tensor(req).detach()
        stored = dtypes(req)
        out = host_bytes(dst) if dst.dtype == stored else None
        buf = (
            torch.frombuffer(out, dtype=torch.uint8)
            if out is not None
            else torch.empty(numel(tuple(req.lengths)) * stored.itemsize, dtype=torch.uint8)
        )
        if buf.numel():
            ops.append(dist.irecv(buf, source, tag=tag))
        received += buf.numel()
        landing.append((req, dst, None if out is not None else buf, stored))
    for op in ops:
        op.wait()
    arrived = {}
    for (pos, _, _), (req, dst, staged, stored) in zip(shares.recv, landing, strict=True):
        if staged is not None and staged.numel():
            dst.copy_(staged.view(stored).reshape(dst.shape))
        planner.commit_tensor(req, dst)
        arrived[pos] = dst
    for pos, first in shares.copies:
        dst = planner.resolve_tensor(tensors[pos]).detach()
        if storage_key(dst) != storage_key(arrived[first]):  # a tie: often one memory
            dst.copy_(arrived[first])
        planner.commit_tensor(tensors[pos], dst)
    return sent, received
