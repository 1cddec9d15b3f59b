"""A DCP ``StorageWriter`` that keeps each chunk as a content-addressed vault object.

It follows the vault's one commit protocol (:mod:`weightvault._vault.writing.commit`) across
ranks: every rank registers an intent for its chunks, waits for gc and stores the chunks
the vault lacks, durably, in ``write_data``; DCP runs ``finish`` on the coordinator only
after every rank succeeded, and it commits one record, then drops every rank's intent.
"""

from __future__ import annotations

import dataclasses
import os
import threading
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
from .._vault.objects.address import content_hash
from .._vault.objects.encoding import Encoder
from .._vault.records.dcp_layout import encode_table
from .._vault.records.reading import check_free
from .._vault.records.record import CheckpointRecord, parse_record
from .._vault.vault import VaultLike, as_vault
from .._vault.writing.commit import Data, begin, commit_record, release, store_missing
from .planner import VaultSavePlanner
from .record import Written, record_doc
from .staging import wave_bytes
from .values import to_record

__all__ = ["VaultWriter", "Written", "chunk_table"]


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
        staging_bytes: Hold at most this many bytes of copies of the chunks (see
            :mod:`weightvault._dcp.staging`): everything else is written before
            :attr:`staged` is set, the rest from the copy after. ``None``: write straight
            from the state.

    Attributes:
        staged: Set once the state may change again (every byte still to write is a copy).
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
        staging_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.vault = as_vault(vault)
        self.name = name
        self.metadata = dict(metadata or {})
        self.record: CheckpointRecord | None = None
        self.written_bytes = 0
        self.reused_bytes = 0
        self.chunks = 0
        self.staging_bytes = staging_bytes
        self.staged = threading.Event()
        self._info: dict[str, Any] = {}
        self._done: set[str] = set()
        self._table: tuple[str, int, str] | None = None
        check_free(self.vault.store, self.name)

    def __getstate__(self) -> dict[str, Any]:
        # DCP's process checkpointer pickles writers; an event is this process's own.
        return {k: v for k, v in self.__dict__.items() if k != "staged"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.staged = threading.Event()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            # Checked in set_up_storage_writer: DCP calls reset before its steps, where a
            # rank's error reaches no other rank.
            self.name = os.fspath(checkpoint_id)
        self.record = None
        self.written_bytes = self.reused_bytes = self.chunks = 0
        self.staged = threading.Event()
        self._done, self._table = set(), None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise CollectivesRequiredError(
                f"{self.vault.url}: VaultWriter needs DCP's collectives (one record, "
                "committed by rank 0); call dcp.save without use_collectives=False"
            )
        check_free(self.vault.store, self.name)  # again: a record may have come since
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.name, save_id=uuid.uuid4().hex)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = self._write(plan, planner)
        finally:
            self.staged.set()  # a failed save stops holding the caller too
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([results[i] for i in range(len(plan.items))])
        return fut

    def _write(self, plan: SavePlan, planner: SavePlanner) -> dict[int, WriteResult]:
        if isinstance(planner, VaultSavePlanner):
            self._info = planner.info()
        results: dict[int, WriteResult] = {}
        tensors: dict[int, torch.Tensor] = {}
        for i, item in enumerate(plan.items):
            if item.type == WriteItemType.BYTE_IO:
                value = to_record(planner, item, f"{self.vault.url}: {item.index.fqn}")
                results[i] = WriteResult(item.index, 0, value)
            else:
                tensors[i] = cast(torch.Tensor, planner.resolve_data(item))
        digests: dict[int, str] = {}
        tensor_results: dict[int, WriteResult] = {}

        def write(chunks: dict[int, memoryview], last: bool) -> None:
            hashed = {i: content_hash(raw) for i, raw in chunks.items()}
            digests.update(hashed)
            table = chunk_table(plan.items, digests) if last else None
            tensor_results.update(self._store(plan.items, chunks, hashed, table))

        if self.staging_bytes is None:
            write({i: tensor_bytes(t) for i, t in tensors.items()}, True)
        else:
            wave_bytes(tensors, self.staging_bytes, write, self.staged.set)
        return {**results, **self._with_table(tensor_results)}

    def _with_table(self, results: dict[int, WriteResult]) -> dict[int, WriteResult]:
        """``results`` naming this rank's chunk table, and the intent that protects it."""
        if self._table is None:
            return results
        digest, size, intent = self._table
        out = {}
        for i, r in results.items():
            w = dataclasses.replace(r.storage_data, table=digest, table_bytes=size,
                                    table_intent=intent)  # fmt: skip
            out[i] = dataclasses.replace(r, storage_data=w)
        return out

    def _store(
        self,
        items: list[WriteItem],
        chunks: dict[int, memoryview],
        digests: dict[int, str],
        table: bytes | None,
    ) -> dict[int, WriteResult]:
        """Steps 1 to 3 of the commit protocol for some of this rank's chunks (and, in
        the last wave, its chunk table)."""
        store = self.vault.store
        objects: dict[str, Data] = {digests[i]: _data(raw) for i, raw in chunks.items()}
        table_digest = content_hash(table) if table is not None else None
        if table is not None and table_digest is not None:
            objects[table_digest] = _data(table)
        intent = begin(store, objects, gc_wait=self.vault.gc_wait)
        try:
            # Chunks stay raw: each rank's load reads its ranges straight into the
            # destination tensors, which a compressed frame would first have to decode.
            new = store_missing(store, objects, encoder=Encoder())
        except BaseException:
            release(store, [intent])
            raise
        if not objects:
            release(store, [intent])  # names nothing: finish has no object to keep
        results = {}
        for i, raw in chunks.items():
            digest = digests[i]
            fresh = digest in new and digest not in self._done
            self._done.add(digest)
            if fresh:
                self.written_bytes += raw.nbytes
            else:
                self.reused_bytes += raw.nbytes
            self.chunks += 1
            written = Written(digest, raw.nbytes, fresh, intent)
            results[i] = WriteResult(items[i].index, raw.nbytes, written)
        if table_digest is not None:
            self._table = (table_digest, len(table or b""), intent)
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


def chunk_table(items: list[WriteItem], digests: dict[int, str]) -> bytes | None:
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
