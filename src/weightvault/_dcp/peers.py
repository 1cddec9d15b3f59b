"""Each replicated box read once: one rank reads it from the store, the others receive it.

Under DDP every rank loads every tensor; under HSDP each replica group loads the same
shards. DCP has each rank read what it needs on its own, so the store serves every byte
once per replica. The coordinator sees every rank's load plan (DCP gathers them), finds
boxes that several ranks read identically (same chunk, same offsets and lengths), and
gives each to the holder with the fewest bytes so far. That rank reads it and sends it
to the others over the process group, point to point; they receive straight into their
destination where it is one contiguous run of CPU memory.

Nothing is sent inside DCP's load: a rank can fail anywhere in it (its planner's
``finish_plan``, a wrapper's ``read_data``) and go straight to DCP's final gather, so
any collective of ours there would wait forever for it. Each rank reads its own part in
``read_data`` and :func:`prepare` readies the exchange; only
:func:`weightvault.dcp.load`, once DCP's gather has returned on every rank (every rank
read its part), runs it (:meth:`Exchange.run`).

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

__all__ = [
    "FIX",
    "OUTCOME",
    "Exchange",
    "Shares",
    "Stamp",
    "assign_reads",
    "broken",
    "own_reads",
    "prepare",
]


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


#: What :mod:`weightvault.dcp` says, once a rank failed, between the failed ranks and
#: :data:`FIX` (``agree``'s ``outcome``): every rank raises, and nothing is left in part.
OUTCOME = "every rank raises, and nothing was committed or read in part: "
#: The fix :mod:`weightvault.dcp` suggests for a rank that failed.
FIX = "fix that rank's error and call it again"


def broken(what: str, error: RuntimeError) -> DistributedCheckpointError:
    """The error for a collective that failed under ``what``: a rank or its link died."""
    first = (str(error).splitlines() or [""])[0][:300]
    return DistributedCheckpointError(
        f"{what} failed: the process group broke (a rank died, or its connection did: "
        f"{first}); a checkpoint is committed whole or not at all, so the vault is "
        "intact: restart the job and load again"
    )


def _wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s bytes as one contiguous uint8 CPU tensor in dtype ``dtype`` (to send)."""
    t = t.detach().to("cpu", dtype).contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


@dataclass
class Exchange:
    """One rank's sends and receives of replicated boxes, ready to go.

    :func:`prepare` makes it inside ``read_data`` (everything that may fail: the wire
    copies, the destinations), so a failure there reaches DCP's gather like any other;
    :meth:`run` only moves bytes, after DCP's gather said every rank read its part.
    """

    tensors: Sequence[ReadItem]
    shares: Shares
    planner: LoadPlanner
    wires: list[tuple[torch.Tensor, tuple[int, ...], int]]
    #: ``(item, destination, buffer, staged, stored dtype, source, tag)`` per receive.
    landing: list[tuple[ReadItem, torch.Tensor, torch.Tensor, bool, torch.dtype, int, int]]

    def run(self) -> tuple[int, int]:
        """Send this rank's boxes and receive the others'; bytes sent and received."""
        ops: list[Any] = []
        sent = received = 0
        for wire, receivers, tag in self.wires:
            for r in receivers:
                ops.append(dist.isend(wire, r, tag=tag))
                sent += wire.numel()
        for _, _, buf, _, _, source, tag in self.landing:
            if buf.numel():
                ops.append(dist.irecv(buf, source, tag=tag))
            received += buf.numel()
        for op in ops:
            op.wait()
        arrived = {}
        for (pos, _, _), (req, dst, buf, staged, stored, _, _) in zip(
            self.shares.recv, self.landing, strict=True
        ):
            if staged and buf.numel():
                dst.copy_(buf.view(stored).reshape(dst.shape))
            self.planner.commit_tensor(req, dst)
            arrived[pos] = dst
        for pos, first in self.shares.copies:
            dst = self.planner.resolve_tensor(self.tensors[pos]).detach()
            if storage_key(dst) != storage_key(arrived[first]):  # a tie: often one memory
                dst.copy_(arrived[first])
            self.planner.commit_tensor(self.tensors[pos], dst)
        return sent, received


def prepare(
    tensors: Sequence[ReadItem],
    shares: Shares,
    planner: LoadPlanner,
    read: dict[int, torch.Tensor],
    dtypes: Callable[[ReadItem], torch.dtype],
) -> Exchange:
    """What this rank sends and where it receives, with nothing sent yet.

    Args:
        tensors: This rank's tensor items, in plan order.
        shares: Its part.
        planner: The load planner (receivers resolve and commit their destinations).
        read: ``{item: destination}`` of the items this rank read and sends.
        dtypes: The stored dtype of an item: what travels.
    """
    wires = [
        (_wire(read[pos], dtypes(tensors[pos])), receivers, tag)
        for pos, receivers, tag in shares.send
    ]
    landing = []
    for pos, source, tag in shares.recv:
        req = tensors[pos]
        dst = planner.resolve_tensor(req).detach()
        stored = dtypes(req)
        out = host_bytes(dst) if dst.dtype == stored else None
        buf = (
            torch.frombuffer(out, dtype=torch.uint8)
            if out is not None and len(out)
            else torch.empty(numel(tuple(req.lengths)) * stored.itemsize, dtype=torch.uint8)
        )
        landing.append((req, dst, buf, out is None or not len(out), stored, source, tag))
    return Exchange(tensors, shares, planner, wires, landing)
