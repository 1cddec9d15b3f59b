"""A DCP ``StorageWriter`` that keeps each chunk as a content-addressed vault object.

It follows the vault's one commit protocol (:mod:`weightvault._vault.commit`) across
ranks: every rank registers an intent for its chunks, waits for gc and stores the chunks
the vault lacks, durably, in ``write_data``; DCP runs ``finish`` on the coordinator only
after every rank succeeded, and it commits one record, then drops every rank's intent.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._base.dtypes import ITEMSIZE, numel
from .._base.errors import CollectivesRequiredError, FormatError
from .._torch.tensors import NAMES, tensor_bytes
from .._vault.commit import begin, commit_record, release, store_missing
from .._vault.dcp_record import KIND, model_header, parse_tensors
from .._vault.objects import content_hash
from .._vault.records import VERSION, CheckpointRecord, check_free, parse_record
from .._vault.vault import VaultLike, as_vault
from .planner import VaultSavePlanner
from .values import Value, to_record

__all__ = ["VaultWriter"]


@dataclass(frozen=True)
class Written:
    """What a rank reports for one chunk: its object, and whether it wrote it."""

    digest: str
    nbytes: int
    new: bool
    intent: str


class VaultWriter(StorageWriter):
    """A DCP ``StorageWriter`` that keeps each chunk as a content-addressed vault object.

    Each rank registers an intent naming its objects (so a concurrent gc keeps them),
    writes only objects the vault lacks, and makes them durable before ``write_data``
    returns. DCP runs :meth:`finish` on the coordinator only after every rank's writes
    succeeded; it commits the record with one exclusive create. If any rank fails, no
    record appears and the objects already written are freed by the next gc.

    Args:
        vault: A :class:`~weightvault.Vault`, or its root or URL.
        name: The checkpoint's name; ``None`` picks the next number. DCP's
            ``checkpoint_id`` overrides it.
        metadata: Your ``str -> str`` metadata for the record.

    Attributes:
        record: After a save, on the coordinator: the committed :class:`CheckpointRecord`.
        written_bytes: Bytes this rank wrote (objects the vault lacked).
        reused_bytes: Bytes this rank's chunks did not need to write.
        chunks: Chunks this rank stored (written or found): each is planned on one rank.
    """

    def __init__(
        self,
        vault: VaultLike,
        name: str | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.vault = as_vault(vault)
        self.name = name
        self.metadata = dict(metadata or {})
        self.record: CheckpointRecord | None = None
        self.written_bytes = 0
        self.reused_bytes = 0
        self.chunks = 0
        self._info: dict[str, Any] = {}
        check_free(self.vault.store, self.name)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.name = os.fspath(checkpoint_id)
            check_free(self.vault.store, self.name)
        self.record = None
        self.written_bytes = self.reused_bytes = self.chunks = 0

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise CollectivesRequiredError(
                f"{self.vault.url}: VaultWriter needs DCP's collectives (one record, "
                "committed by rank 0); call dcp.save without use_collectives=False"
            )
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.name, save_id=uuid.uuid4().hex)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if isinstance(planner, VaultSavePlanner):
            self._info = planner.info()
        values: dict[int, Value] = {}
        chunks: dict[int, memoryview] = {}
        for i, item in enumerate(plan.items):
            if item.type == WriteItemType.BYTE_IO:
                values[i] = to_record(planner, item, f"{self.vault.url}: {item.index.fqn}")
            else:
                chunks[i] = tensor_bytes(cast(torch.Tensor, planner.resolve_data(item)))
        digests = {i: content_hash(raw) for i, raw in chunks.items()}
        results = self._store(plan.items, chunks, digests)
        results.update({i: WriteResult(plan.items[i].index, 0, v) for i, v in values.items()})
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([results[i] for i in range(len(plan.items))])
        return fut

    def _store(
        self, items: list[WriteItem], chunks: dict[int, memoryview], digests: dict[int, str]
    ) -> dict[int, WriteResult]:
        """Steps 1 to 3 of the commit protocol for this rank's chunks."""
        store = self.vault.store
        intent = begin(store, digests.values(), gc_wait=self.vault.gc_wait)
        try:
            objects = {digests[i]: (raw.nbytes, lambda raw=raw: raw) for i, raw in chunks.items()}
            new = store_missing(store, objects)
        except BaseException:
            release(store, [intent])
            raise
        if not chunks:
            release(store, [intent])  # names nothing: finish has no object to keep
        results, done = {}, set()
        for i, raw in chunks.items():
            digest = digests[i]
            fresh = digest in new and digest not in done
            done.add(digest)
            if fresh:
                self.written_bytes += raw.nbytes
            else:
                self.reused_bytes += raw.nbytes
            self.chunks += 1
            written = Written(digest, raw.nbytes, fresh, intent)
            results[i] = WriteResult(items[i].index, raw.nbytes, written)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Step 4 on the coordinator: commit the record, then drop every rank's intent."""
        flat = [r for rs in results for r in rs]
        tensors, values = _tables(metadata, flat, self.vault.url)
        written: dict[str, Written] = {}
        for r in flat:
            w = r.storage_data
            if isinstance(w, Written) and (w.digest not in written or w.new):
                written[w.digest] = w  # one rank's "new" wins: it wrote the object
        doc = self._doc(tensors, values, metadata, written)
        name = commit_record(self.vault.store, doc, self.name)
        self.record = parse_record(name, doc, name)
        release(self.vault.store, sorted({w.intent for w in written.values()}))

    def _doc(
        self,
        tensors: dict[str, Any],
        values: dict[str, Any],
        metadata: Metadata,
        written: Mapping[str, Written],
    ) -> dict[str, Any]:
        """The record: byte counts, the model's header, the chunk table and the values."""
        info = self._info
        ties = {a: c for a, c in dict(info.get("ties", {})).items() if c in tensors}
        names = info.get("names") or [*tensors, *ties]
        prefix = str(info.get("model_prefix", ""))
        frozen = list(info.get("frozen", []))
        parsed = parse_tensors(tensors, self.vault.url)
        header = model_header(parsed, ties, names, frozen, prefix, "pt", self.metadata)
        # Logical: every name's bytes, the tied alias included, as a plain state dict holds.
        logical = sum(
            numel(c.sizes) * ITEMSIZE[parsed[ties.get(fqn, fqn)].dtype]
            for fqn in [*tensors, *ties]
            for c in parsed[ties.get(fqn, fqn)].chunks
        )
        mappings = {k: list(v) for k, v in (metadata.planner_data or {}).items()}
        return {
            "version": VERSION,
            "kind": KIND,
            "created": time.time(),
            "framework": "pt",
            "metadata": self.metadata,
            "logical_bytes": logical,
            "stored_bytes": sum(w.nbytes for w in written.values()),
            "new_bytes": sum(w.nbytes for w in written.values() if w.new),
            "tensors": len([n for n in names if n.startswith(prefix)]),
            "header": header,
            "dcp": {
                "version": 1,
                "tensors": tensors,
                "values": values,
                "ties": ties,
                "mappings": mappings,
                "model_prefix": prefix,
                "frozen": frozen,
            },
        }

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _tables(
    metadata: Metadata, flat: list[WriteResult], where: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The record's chunk table and values, from every rank's write results."""
    by_index = {(r.index.fqn, tuple(r.index.offset or ())): r.storage_data for r in flat}
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            got = by_index.get((fqn, ()))
            if not isinstance(got, Value):
                raise FormatError(f"{where}: value {fqn!r} was not written")
            values[fqn] = got.value
            continue
        chunks = []
        for c in md.chunks:
            w = by_index.get((fqn, tuple(c.offsets)))
            if not isinstance(w, Written):
                raise FormatError(
                    f"{where}: tensor {fqn!r} chunk {tuple(c.offsets)} was not written"
                )
            chunks.append([list(c.offsets), list(c.sizes), w.digest])
        tensors[fqn] = {
            "dtype": NAMES[md.properties.dtype],
            "shape": list(md.size),
            "chunks": chunks,
        }
    return tensors, values
