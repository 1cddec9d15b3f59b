"""A DCP ``StorageReader`` over a vault checkpoint that :class:`VaultWriter` committed.

DCP reshards: each rank asks for the boxes its shards overlap, and the reader fetches
just those byte ranges of each chunk object (``preadv`` into the destination locally,
ranged GETs on object stores), wherever the object is, a running gc's trash included.
It reads the record's index, then only the chunk tables holding chunks it needs. Under
:func:`weightvault.dcp.load` a box that several ranks need (replicas) is read by one of
them and sent to the others after DCP's load (:class:`SharingReader`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._base.dtypes import ITEMSIZE
from .._base.errors import DistributedCheckpointError, FormatError
from .._torch.tensors import DTYPES
from .._vault.records.dcp import KIND
from .._vault.records.dcp_layout import Chunk, parse_layout
from .._vault.records.names import record_key
from .._vault.records.reading import read_doc
from .._vault.vault import VaultLike, as_vault
from .index import ChunkIndex
from .peers import Exchange, Shares, Stamp, assign_reads, own_reads, prepare
from .planner import storage_key
from .ranged import read_box
from .values import as_blob

__all__ = ["ReadStats", "SharingReader", "VaultReader"]


@dataclass
class ReadStats:
    """What one rank read in a :class:`VaultReader` load.

    Attributes:
        bytes_read: Bytes of chunk objects read from the store (only the ranges this rank
            needs).
        requests: Object reads issued.
        skipped_bytes: Bytes not read because the destination was already filled from
            the same chunk (a tied tensor loaded through two names).
        record_bytes: Bytes of the record and of the chunk tables this rank read.
        bytes_received: Bytes received from other ranks instead of read (replicas).
        bytes_sent: Bytes this rank read once and sent to the other ranks holding them.
        per_object: Bytes read per object.
    """

    bytes_read: int = 0
    requests: int = 0
    skipped_bytes: int = 0
    record_bytes: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    per_object: dict[str, int] = field(default_factory=dict)


class VaultReader(StorageReader):
    """A DCP ``StorageReader`` over a vault checkpoint written by :class:`VaultWriter`.

    DCP reshards: each rank asks for the boxes its shards overlap, and the reader fetches
    just those byte ranges of each chunk object, into the destination tensor where it is
    one contiguous run of CPU memory. A tied tensor is listed under each of its names,
    all reading one stored chunk; when the destinations are one memory, it is read once.
    Each rank reads every box it loads itself, and issues no collective of its own, so a
    rank failing anywhere in DCP's load makes DCP raise on every rank;
    :func:`weightvault.dcp.load` reads a box several ranks load (DDP and HSDP replicas)
    once (:class:`SharingReader`).

    Every load resolves ``name`` anew (a reused reader of ``"latest"`` reads the newest
    checkpoint each time), and all ranks read the checkpoint the coordinator resolved: DCP
    has each rank read metadata on its own, so a checkpoint committed between two ranks'
    reads would otherwise give them different checkpoints. The coordinator's choice
    reaches every rank with DCP's global plan; a rank that resolved another checkpoint
    plans its reads again against the coordinator's (with DCP's default load planner;
    another planner gets a :class:`~weightvault.DistributedCheckpointError`).

    Args:
        vault: A :class:`~weightvault.Vault`, or its root or URL.
        name: The checkpoint to read (``"latest"`` by default).

    Attributes:
        name: The checkpoint asked for (``"latest"`` stays ``"latest"``).
        resolved: The checkpoint this rank reads in the current load.
        stats: :class:`ReadStats` of the last load on this rank.
        frozen: Names the checkpoint records as frozen (after ``read_metadata``).
        weights_only: The checkpoint's optimizer state was dropped
            (``retain(training_state_last=)``), after ``read_metadata``.

    Example:
        >>> reader = VaultReader("runs/ft")          # "latest", resolved at each load
        >>> dcp.load(state, storage_reader=reader)
        >>> reader.resolved, reader.stats.bytes_received
        ('000007', 0)
    """

    #: Whether the coordinator assigns replicated boxes to one reader (see
    #: :class:`SharingReader`); a plain ``dcp.load`` has no later step to send them in.
    shares_reads: ClassVar[bool] = False

    def __init__(self, vault: VaultLike, name: str = "latest") -> None:
        super().__init__()
        self.vault = as_vault(vault)
        self.name = name
        self.resolved: str | None = None
        self.stats = ReadStats()
        self.frozen: list[str] = []
        self.weights_only = False
        self._index: ChunkIndex | None = None
        self._ahead: Metadata | None = None
        self._coordinator = True
        self._pending: Exchange | None = None

    def __getstate__(self) -> dict[str, Any]:
        # DCP's process checkpointer pickles readers: the index is rebuilt from the record.
        return {**self.__dict__, "_index": None, "_ahead": None, "_pending": None}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.name = os.fspath(checkpoint_id)
        self.resolved, self._ahead, self._pending = None, None, None
        self.stats = ReadStats()

    def prefetch(self) -> Metadata:
        """Resolve and read the checkpoint's metadata now; the next load uses this copy.

        :func:`weightvault.dcp.load` reads the frozen flags and the optimizer state it
        must place before DCP plans, without reading the record twice.
        """
        self.resolved = self.vault.resolve(self.name)
        self._ahead = self._open(self.resolved)
        return self._ahead

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if "rank" in kwargs:
            # DCP asks for a rank's own metadata after the global read failed, and a rank
            # that got it would load without collectives while the others wait in them.
            raise DistributedCheckpointError(
                f"{self.vault.url}: a vault checkpoint has one record for every rank, "
                "no per-rank metadata; see the first error of read_metadata"
            )
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            return ahead
        self.resolved = self.vault.resolve(self.name)
        return self._open(self.resolved)

    def _open(self, name: str) -> Metadata:
        """DCP's metadata of checkpoint ``name``, its chunk lists filled later (see
        :class:`~weightvault._dcp.index.ChunkIndex`); keeps its frozen names and index."""
        doc = read_doc(self.vault.store, name)
        where = f"{self.vault.url}/{record_key(name)}"
        section = doc.get("dcp")
        if doc.get("kind") != KIND or not isinstance(section, dict):
            raise FormatError(
                f"{where}: checkpoint {name!r} was not written through DCP; load it with "
                "Vault.load(model, name) instead"
            )
        # The record as committed (compact JSON): what this rank read of it.
        self.stats.record_bytes += len(json.dumps(doc, separators=(",", ":")))
        ties = {str(a): str(c) for a, c in dict(section.get("ties", {})).items()}
        self._index = ChunkIndex(self.vault.store, parse_layout(section, where), ties, where)
        self.frozen = [str(f) for f in section.get("frozen", [])]
        self.weights_only = doc.get("weights_only") is True
        values, mappings = dict(section.get("values", {})), dict(section.get("mappings", {}))
        return self._index.metadata(values, mappings)

    @property
    def index(self) -> ChunkIndex:
        if self._index is None:
            raise DistributedCheckpointError(
                f"{self.vault.url}: the reader has no checkpoint open; DCP calls "
                "read_metadata before reading (pass it to dcp.load as storage_reader)"
            )
        return self._index

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if isinstance(metadata.storage_data, ChunkIndex):
            self._index = metadata.storage_data
            if not self._index.narrowed:
                self._index.fill(metadata, None)  # another planner: list every chunk
        self._coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        # What this rank resolved travels to the coordinator with its plan.
        return dataclasses.replace(plan, storage_data=self.resolved)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # DCP scatters these plans: the one message every rank receives from the
        # coordinator after each resolved its checkpoint on its own.
        agreed = all(p.storage_data == self.resolved for p in plans)
        shares: list[Shares | None] = [None] * len(plans)
        if agreed and self.shares_reads and 1 < len(plans) == _world():
            ties = self.index.ties
            shares = list(assign_reads(plans, lambda fqn: ties.get(fqn, fqn)))
        return [
            dataclasses.replace(p, storage_data=Stamp(str(self.resolved), s))
            for p, s in zip(plans, shares, strict=True)
        ]

    def _agree(self, plan: LoadPlan, planner: LoadPlanner) -> LoadPlan:
        """``plan``, or this rank's plan made again against the coordinator's checkpoint."""
        stamp = plan.storage_data
        chosen = stamp.checkpoint if isinstance(stamp, Stamp) else None
        if chosen is None or chosen == self.resolved:
            return plan
        if not isinstance(planner, DefaultLoadPlanner):
            raise DistributedCheckpointError(
                f"{self.vault.url}: {self.name!r} is checkpoint {chosen!r} on the "
                f"coordinator but {self.resolved!r} here (one was committed during the "
                f"load), and {type(planner).__name__} cannot plan again; name the "
                f"checkpoint: VaultReader(vault, {chosen!r})"
            )
        metadata = self._open(chosen)
        self.resolved = chosen
        planner.set_up_planner(planner.original_state_dict, metadata, self._coordinator)
        self.set_up_storage_reader(metadata, self._coordinator)
        return planner.finish_plan(planner.create_local_plan())

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # No collective here: a rank failing anywhere in DCP's load skips this call.
        stamp = plan.storage_data
        shares = stamp.shares if isinstance(stamp, Stamp) else None
        agreed = self._agree(plan, planner)
        tensors = [r for r in agreed.items if r.type != LoadItemType.BYTE_IO]
        read: dict[int, torch.Tensor] = {}
        self._read_own(agreed, planner, own_reads(tensors, shares), read)
        if shares is not None:
            self._pending = prepare(tensors, shares, planner, read, self._stored_dtype)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _stored_dtype(self, req: ReadItem) -> torch.dtype:
        dtype, _ = self.index.chunk(req.storage_index.fqn, req.storage_index.offset or ())
        return DTYPES[dtype]

    def _read_own(
        self,
        plan: LoadPlan,
        planner: LoadPlanner,
        mine: list[ReadItem],
        read: dict[int, torch.Tensor],
    ) -> None:
        """Values, then this rank's own tensor items, reading only the tables they need."""
        index = self.index
        before = index.table_bytes
        index.load_tables(
            index.tables_for((r.storage_index.fqn, r.storage_index.offset or ()) for r in mine)
        )
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, as_blob(index.value(req.storage_index)))
        tensors = [r for r in plan.items if r.type != LoadItemType.BYTE_IO]
        position = {id(r): i for i, r in enumerate(tensors)}
        filled: set[tuple[Any, ...]] = set()
        for req in mine:
            read[position[id(req)]] = self._read_tensor(req, planner, filled)
        self.stats.record_bytes += index.table_bytes - before

    def _read_tensor(self, req: ReadItem, planner: LoadPlanner, filled: set[Any]) -> torch.Tensor:
        dtype, chunk = self.index.chunk(req.storage_index.fqn, req.storage_index.offset or ())
        dst = planner.resolve_tensor(req).detach()
        key = storage_key(dst)
        box = (chunk.digest, tuple(req.storage_offsets), tuple(req.lengths))
        if key is not None and (box, key) in filled:
            self.stats.skipped_bytes += dst.numel() * ITEMSIZE[dtype]
        else:
            if dst.numel() > 0:
                self._read_box(req, dtype, chunk, dst)
            if key is not None:
                filled.add((box, key))
        planner.commit_tensor(req, dst)
        return dst

    def _read_box(self, req: ReadItem, dtype: str, chunk: Chunk, dst: torch.Tensor) -> None:
        fqn = req.storage_index.fqn
        try:
            n = read_box(self.vault.store, fqn, dtype, chunk, req.storage_offsets, req.lengths, dst)
        except FileNotFoundError:
            raise FormatError(
                f"{self.vault.url}: checkpoint {self.resolved!r}: tensor {fqn!r}: object "
                f"{chunk.digest[:12]} is missing; the vault is damaged, run "
                "'weightvault vault ROOT verify'"
            ) from None
        self.stats.requests += 1
        self.stats.bytes_read += n
        self.stats.per_object[chunk.digest] = self.stats.per_object.get(chunk.digest, 0) + n

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


class SharingReader(VaultReader):
    """A :class:`VaultReader` that reads a box several ranks need once and sends it on.

    :func:`weightvault.dcp.load` uses it. The coordinator gives each replicated box to
    one of the ranks that load it (:func:`~weightvault._dcp.peers.assign_reads`); inside
    DCP's load each rank reads only its own boxes and readies the exchange, and
    :meth:`exchange`, called on every rank once ``dcp.load`` returned on every rank,
    sends them. A rank that fails anywhere in the load makes DCP raise on every rank
    before any rank waits for a box.

    The load must run on the default process group (DCP's default); on a subgroup of
    another size every rank reads its own.
    """

    shares_reads = True

    def exchange(self) -> None:
        """Send the boxes this rank read for others, receive its own; collective.

        Call it on every rank right after ``dcp.load`` returned (not after it raised):
        DCP's last gather has then told every rank that every read succeeded, so every
        rank sends what the others wait for. A rank that dies meanwhile breaks the
        others' receives at once (gloo's connection reset), not at the group's timeout.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        sent, received = pending.run()
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
