"""A DCP ``StorageWriter`` that keeps each chunk as a content-addressed vault object.

It follows the vault's one commit protocol (:mod:`weightvault._vault.commit`) across
ranks: every rank registers an intent for its chunks, waits for gc and stores the chunks
the vault lacks, durably, in ``write_data``; DCP runs ``finish`` on the coordinator only
after every rank succeeded, and it commits one record, then drops every rank's intent.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._base.errors import CollectivesRequiredError
from .._torch.tensors import tensor_bytes
from .._vault.commit import Data, begin, commit_record, release, store_missing
from .._vault.dcp_layout import encode_table
from .._vault.objects import content_hash
from .._vault.records import CheckpointRecord, check_free, parse_record
from .._vault.vault import VaultLike, as_vault
from .planner import VaultSavePlanner
from .record import Written, record_doc
from .values import Value, to_record

__all__ = ["VaultWriter", "Written"]


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
        """Steps 1 to 3 of the commit protocol for this rank's chunks and chunk table."""
        store = self.vault.store
        table = _table(items, digests)
        table_digest = content_hash(table) if table is not None else None
        objects: dict[str, Data] = {digests[i]: _data(raw) for i, raw in chunks.items()}
        if table is not None and table_digest is not None:
            objects[table_digest] = _data(table)
        intent = begin(store, objects, gc_wait=self.vault.gc_wait)
        try:
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
            written = Written(digest, raw.nbytes, fresh, intent, table_digest, len(table or b""))
            results[i] = WriteResult(items[i].index, raw.nbytes, written)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Step 4 on the coordinator: commit the record, then drop every rank's intent."""
        doc, intents = record_doc(metadata, results, self._info, self.metadata, self.vault.url)
        name = commit_record(self.vault.store, doc, self.name)
        self.record = parse_record(name, doc, name)
        release(self.vault.store, sorted(intents))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def _data(raw: memoryview | bytes) -> Data:
    return (memoryview(raw).nbytes, lambda: raw)


def _table(items: list[WriteItem], digests: dict[int, str]) -> bytes | None:
    """This rank's chunk table: its chunks that are part of a tensor, not all of it.

    Whole-tensor chunks (a rank's own tensor, replicated scalars) are inline in the
    record, so a rank that holds only those writes no table.
    """
    partial: dict[str, list[tuple[Any, Any, str]]] = {}
    for i, digest in digests.items():
        data = items[i].tensor_data
        if data is None or tuple(data.chunk.sizes) == tuple(data.size):
            continue
        entry = (tuple(data.chunk.offsets), tuple(data.chunk.sizes), digest)
        partial.setdefault(items[i].index.fqn, []).append(entry)
    return encode_table(partial) if partial else None
