"""A DCP ``StorageReader`` over a vault checkpoint that :class:`VaultWriter` committed.

DCP reshards: each rank asks for the boxes its shards overlap, and the reader fetches
just those byte ranges of each chunk object (``pread`` locally, ranged GETs on object
stores), wherever the object is, a running gc's trash included.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._base.dtypes import ITEMSIZE, numel
from .._base.errors import DistributedCheckpointError, FormatError
from .._torch.tensors import DTYPES
from .._vault.dcp_record import KIND, Chunk, ChunkedTensor, parse_tensors
from .._vault.objects import content_hash, read_range
from .._vault.records import read_doc, record_key
from .._vault.vault import VaultLike, as_vault
from .planner import storage_key
from .values import Value, as_blob, from_record

__all__ = ["ReadStats", "VaultReader"]


@dataclass
class ReadStats:
    """What one rank read in a :class:`VaultReader` load.

    Attributes:
        bytes_read: Bytes fetched from objects (only the ranges this rank needs).
        requests: Object reads issued.
        skipped_bytes: Bytes not read because the destination was already filled from
            the same chunk (a tied tensor loaded through two names).
    """

    bytes_read: int = 0
    requests: int = 0
    skipped_bytes: int = 0
    per_object: dict[str, int] = field(default_factory=dict)


def _tensor_metadata(
    fqn: str, t: ChunkedTensor, where: str
) -> tuple[TensorStorageMetadata, dict[MetadataIndex, Any]]:
    """DCP's metadata of one chunked tensor, and where each of its chunks is stored."""
    if t.dtype not in DTYPES:
        raise FormatError(f"{where}: tensor {fqn!r} has dtype {t.dtype}, unknown to torch")
    md = TensorStorageMetadata(
        TensorProperties(dtype=DTYPES[t.dtype]),
        torch.Size(t.shape),
        [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks],
    )
    storage = {MetadataIndex(fqn, torch.Size(c.offsets)): (t.dtype, c) for c in t.chunks}
    return md, storage


def _metadata(section: dict[str, Any], where: str) -> Metadata:
    """DCP's metadata of a record's ``dcp`` section: tensors, ties as aliases, values."""
    tensors = parse_tensors(section.get("tensors", {}), where)
    ties = {str(a): str(c) for a, c in dict(section.get("ties", {})).items()}
    sdm: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for fqn, t in tensors.items():
        sdm[fqn], chunks = _tensor_metadata(fqn, t, where)
        storage.update(chunks)
    for alias, canon in ties.items():
        if canon not in tensors:
            raise FormatError(f"{where}: tie {alias!r} -> {canon!r} names no stored tensor")
        sdm[alias], chunks = _tensor_metadata(alias, tensors[canon], where)
        storage.update(chunks)
    for fqn, value in dict(section.get("values", {})).items():
        sdm[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = from_record(value, f"{where}: value {fqn!r}")
    mappings = {k: tuple(v) for k, v in dict(section.get("mappings", {})).items()}
    return Metadata(state_dict_metadata=sdm, planner_data=mappings, storage_data=storage)


class VaultReader(StorageReader):
    """A DCP ``StorageReader`` over a vault checkpoint written by :class:`VaultWriter`.

    DCP reshards: each rank asks for the boxes its shards overlap, and the reader fetches
    just those byte ranges of each chunk object (``pread`` locally, ranged GETs on
    object stores). A tied tensor is listed under each of its names, all reading one
    stored chunk; when the destinations are one memory, it is read once.

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

    Example:
        >>> reader = VaultReader("runs/ft")          # "latest", resolved at each load
        >>> dcp.load(state, storage_reader=reader)
        >>> reader.resolved
        '000007'
    """

    def __init__(self, vault: VaultLike, name: str = "latest") -> None:
        super().__init__()
        self.vault = as_vault(vault)
        self.name = name
        self.resolved: str | None = None
        self.stats = ReadStats()
        self.frozen: list[str] = []
        self._storage: dict[MetadataIndex, Any] = {}
        self._ahead: Metadata | None = None
        self._coordinator = True

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.name = os.fspath(checkpoint_id)
        self.resolved, self._ahead = None, None
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
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            return ahead
        self.resolved = self.vault.resolve(self.name)
        return self._open(self.resolved)

    def _open(self, name: str) -> Metadata:
        """DCP's metadata of checkpoint ``name``; keeps its frozen names and chunk table."""
        doc = read_doc(self.vault.store, name)
        where = f"{self.vault.url}/{record_key(name)}"
        section = doc.get("dcp")
        if doc.get("kind") != KIND or not isinstance(section, dict):
            raise FormatError(
                f"{where}: checkpoint {name!r} was not written through DCP; load it with "
                "Vault.load(model, name) instead"
            )
        metadata = _metadata(section, where)
        self.frozen = [str(f) for f in section.get("frozen", [])]
        self._storage = cast(dict[MetadataIndex, Any], metadata.storage_data)
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._storage = cast(dict[MetadataIndex, Any], metadata.storage_data)
        self._coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # DCP scatters these plans: the one message every rank receives from the
        # coordinator after each resolved its checkpoint on its own.
        return [dataclasses.replace(p, storage_data=self.resolved) for p in plans]

    def _agree(self, plan: LoadPlan, planner: LoadPlanner) -> LoadPlan:
        """``plan``, or this rank's plan made again against the coordinator's checkpoint."""
        chosen = plan.storage_data
        if not isinstance(chosen, str) or chosen == self.resolved:
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
        return planner.finish_plan(planner.create_local_plan())

    def _range(self, digest: str, start: int, end: int) -> bytes:
        self.stats.requests += 1
        self.stats.bytes_read += end - start
        self.stats.per_object[digest] = self.stats.per_object.get(digest, 0) + end - start
        try:
            return read_range(self.vault.store, digest, start, end)
        except FileNotFoundError:
            raise FormatError(
                f"{self.vault.url}: checkpoint {self.resolved!r}: object {digest[:12]} is "
                "missing; the vault is damaged, run 'weightvault vault ROOT verify'"
            ) from None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        plan = self._agree(plan, planner)
        filled: set[tuple[Any, ...]] = set()
        for req in plan.items:
            ref = self._storage[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                assert isinstance(ref, Value)
                planner.load_bytes(req, as_blob(ref))
            else:
                self._read_tensor(req, planner, ref, filled)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_tensor(
        self, req: ReadItem, planner: LoadPlanner, ref: tuple[str, Chunk], filled: set[Any]
    ) -> None:
        dtype, chunk = ref
        dst = planner.resolve_tensor(req).detach()
        key = storage_key(dst)
        box = (chunk.digest, tuple(req.storage_offsets), tuple(req.lengths))
        if key is not None and (box, key) in filled:
            self.stats.skipped_bytes += dst.numel() * ITEMSIZE[dtype]
        else:
            if dst.numel() > 0:
                dst.copy_(self._read_box(dtype, chunk, req.storage_offsets, req.lengths))
            if key is not None:
                filled.add((box, key))
        planner.commit_tensor(req, dst)

    def _read_box(
        self, dtype: str, chunk: Chunk, offsets: Sequence[int], lengths: Sequence[int]
    ) -> torch.Tensor:
        """Elements ``offsets + [0, lengths)`` of ``chunk``, reading the covering range."""
        sizes = list(chunk.sizes)
        strides = [1] * len(sizes)
        for d in range(len(sizes) - 2, -1, -1):
            strides[d] = strides[d + 1] * sizes[d + 1]
        first = sum(o * s for o, s in zip(offsets, strides, strict=True))
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
        item = ITEMSIZE[dtype]
        whole = first == 0 and last + 1 == numel(sizes)
        data = self._range(chunk.digest, first * item, (last + 1) * item)
        if whole and content_hash(data) != chunk.digest:
            raise FormatError(
                f"{self.vault.url}: checkpoint {self.resolved!r}: object {chunk.digest[:12]} is "
                "corrupt (hash mismatch); run 'weightvault vault ROOT verify'"
            )
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(DTYPES[dtype])
        return flat.as_strided(tuple(lengths), tuple(strides), 0)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False
