"""The commit record of a DCP save: built on the coordinator from every rank's results.

Each rank reports, per chunk, a :class:`Written`: the chunk's object, and the chunk table
(:mod:`weightvault._vault.records.dcp_layout`) it wrote for its partial chunks. The coordinator
turns DCP's global metadata and those reports into the record: the index of every tensor
(a grid pointing at the tables, or inline chunks), the values, the ties, and the plain
safetensors header a single process loads the model with.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.storage import WriteResult

from .._base.dtypes import ITEMSIZE, numel
from .._base.errors import FormatError
from .._torch.tensors import NAMES
from .._vault.records.dcp import KIND, ChunkedTensor, model_header
from .._vault.records.dcp_layout import LAYOUT_VERSION, Chunk, encode_tensor
from .._vault.records.record import VERSION
from .values import Value

__all__ = ["Written", "record_doc"]


@dataclass(frozen=True)
class Written:
    """What a rank reports for one chunk: its object, whether it wrote it, its table.

    Attributes:
        digest: The chunk's object.
        nbytes: Its size.
        new: This rank wrote it (the vault lacked it).
        intent: The rank's intent, to drop after the commit.
        table: The rank's chunk table (``None`` when it has no partial chunk).
        table_bytes: The table's size.
        table_intent: The intent naming the table, when another than ``intent``.
    """

    digest: str
    nbytes: int
    new: bool
    intent: str
    table: str | None = None
    table_bytes: int = 0
    table_intent: str | None = None


def _rank_tables(results: Sequence[Sequence[WriteResult]]) -> tuple[list[str | None], list[int]]:
    """Each rank's chunk table (``None`` for a rank that wrote none), and its size."""
    tables: list[str | None] = []
    sizes = []
    for rs in results:
        w = next((r.storage_data for r in rs if isinstance(r.storage_data, Written)), None)
        tables.append(w.table if w is not None else None)
        sizes.append(w.table_bytes if w is not None and w.table is not None else 0)
    return tables, sizes


def _index(
    metadata: Metadata, results: Sequence[Sequence[WriteResult]], where: str
) -> tuple[dict[str, Any], dict[str, ChunkedTensor], dict[str, Any]]:
    """Every tensor's index entry and chunks, and the values, from every rank's results."""
    by_index: dict[tuple[str, tuple[int, ...]], tuple[Any, int]] = {}
    for rank, rs in enumerate(results):
        for r in rs:
            by_index[(r.index.fqn, tuple(r.index.offset or ()))] = (r.storage_data, rank)
    entries: dict[str, Any] = {}
    chunked: dict[str, ChunkedTensor] = {}
    values: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            got, _ = by_index.get((fqn, ()), (None, 0))
            if not isinstance(got, Value):
                raise FormatError(f"{where}: value {fqn!r} was not written")
            values[fqn] = got.value
            continue
        chunks = []
        for c in md.chunks:
            w, rank = by_index.get((fqn, tuple(c.offsets)), (None, 0))
            if not isinstance(w, Written):
                raise FormatError(
                    f"{where}: tensor {fqn!r} chunk {tuple(c.offsets)} was not written"
                )
            chunks.append((tuple(c.offsets), tuple(c.sizes), w.digest, rank))
        dtype = NAMES[md.properties.dtype]
        entries[fqn] = encode_tensor(dtype, tuple(md.size), chunks)
        pieces = tuple(Chunk(o, s, d) for o, s, d, _ in chunks)
        chunked[fqn] = ChunkedTensor(dtype, tuple(md.size), pieces)
    return entries, chunked, values


def _written(
    results: Sequence[Sequence[WriteResult]],
) -> tuple[dict[str, Written], set[str]]:
    """Each object once (as the rank that wrote it reported it), and every rank's intents."""
    written: dict[str, Written] = {}
    intents: set[str] = set()
    for r in (r for rs in results for r in rs):
        w = r.storage_data
        if isinstance(w, Written):
            intents.update(i for i in (w.intent, w.table_intent) if i is not None)
            if w.digest not in written or w.new:
                written[w.digest] = w  # one rank's "new" wins: it wrote the object
    return written, intents


def record_doc(
    metadata: Metadata,
    results: Sequence[Sequence[WriteResult]],
    info: Mapping[str, Any],
    user_metadata: Mapping[str, str],
    where: str,
) -> tuple[dict[str, Any], set[str]]:
    """The record to commit, and the intents to drop once it is.

    Args:
        metadata: DCP's global metadata.
        results: Every rank's write results, by rank.
        info: The planner's :meth:`~weightvault.dcp.VaultSavePlanner.info` (ties, frozen
            names, model order), empty for another planner.
        user_metadata: The user's ``str -> str`` metadata.
        where: The vault, for messages.
    """
    entries, chunked, values = _index(metadata, results, where)
    written, intents = _written(results)
    ties = {a: c for a, c in dict(info.get("ties", {})).items() if c in chunked}
    names = info.get("names") or [*chunked, *ties]
    prefix = str(info.get("model_prefix", ""))
    frozen = list(info.get("frozen", []))
    header = model_header(chunked, ties, names, frozen, prefix, "pt", user_metadata)
    # Logical: every name's bytes, the tied alias included, as a plain state dict holds.
    logical = sum(
        numel(c.sizes) * ITEMSIZE[chunked[ties.get(f, f)].dtype]
        for f in [*chunked, *ties]
        for c in chunked[ties.get(f, f)].chunks
    )
    tables, table_sizes = _rank_tables(results)
    doc = {
        "version": VERSION,
        "kind": KIND,
        "created": time.time(),
        "framework": "pt",
        "metadata": dict(user_metadata),
        "logical_bytes": logical,
        "stored_bytes": sum(w.nbytes for w in written.values()),
        "new_bytes": sum(w.nbytes for w in written.values() if w.new),
        "tensors": len([n for n in names if n.startswith(prefix)]),
        "header": header,
        "dcp": {
            "version": LAYOUT_VERSION,
            "tensors": entries,
            "tables": tables,
            "table_sizes": table_sizes,
            "values": values,
            "ties": ties,
            "mappings": {k: list(v) for k, v in (metadata.planner_data or {}).items()},
            "model_prefix": prefix,
            "frozen": frozen,
        },
    }
    return doc, intents
