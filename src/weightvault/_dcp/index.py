"""A DCP checkpoint's chunks as DCP's load planner asks for them.

The record (an index, :mod:`weightvault._vault.records.dcp_layout`) says every tensor's dtype,
shape and chunk boxes, but a gridded tensor's objects are in per-rank chunk tables. So
:class:`ChunkIndex` builds DCP's ``Metadata`` with empty chunk lists, fills each list
only when asked (for a loading rank's own shards where the planner says which, for every
chunk otherwise), and reads a table only when a read needs one of its chunks.

Example:
    >>> index = ChunkIndex(store, layout, ties={}, where=url)
    >>> md = index.metadata(values={}, mappings={})
    >>> index.fill(md, {"model.w": [((0, 0), (8, 4))]})   # this rank holds rows 0-7
    >>> index.chunk("model.w", (0, 0))                     # reads the one table it needs
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

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

from .._base.errors import FormatError
from .._torch.tensors import DTYPES
from .._vault.records.dcp import read_tables
from .._vault.records.dcp_layout import Chunk, Layout, TensorLayout, grid_chunk
from .._vault.store.backend import Store
from .values import Value, from_record

__all__ = ["Box", "ChunkIndex", "VaultLoadPlanner", "local_boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _overlaps(a: Box, b: Box) -> bool:
    return all(
        o1 < o2 + n2 and o2 < o1 + n1 and n1 > 0 and n2 > 0
        for o1, n1, o2, n2 in zip(a[0], a[1], b[0], b[1], strict=True)
    )


class ChunkIndex:
    """Every chunk of one checkpoint, found by ``(fqn, offsets)``; tables read on demand.

    Args:
        store: The vault's store.
        layout: The record's parsed layout.
        ties: ``alias -> canonical``: an alias reads its canonical tensor's chunks.
        where: The record, for messages.

    Attributes:
        table_bytes: Bytes of chunk tables read so far.
    """

    def __init__(self, store: Store, layout: Layout, ties: Mapping[str, str], where: str) -> None:
        self.store, self.layout, self.where = store, layout, where
        self.ties = dict(ties)
        self.values: dict[str, Value] = {}
        self.table_bytes = 0
        self._tables: dict[int, dict[str, dict[tuple[int, ...], Chunk]]] = {}
        self._filled: set[str] = set()
        self._inline: dict[str, dict[tuple[int, ...], Chunk]] = {}
        self.narrowed = False
        for alias, canon in self.ties.items():
            if canon not in layout.tensors:
                raise FormatError(f"{where}: tie {alias!r} -> {canon!r} names no stored tensor")

    def _tensor(self, fqn: str) -> TensorLayout:
        return self.layout.tensors[self.ties.get(fqn, fqn)]

    def metadata(self, values: Mapping[str, Any], mappings: Mapping[str, Any]) -> Metadata:
        """DCP's metadata: every tensor (aliases too) with its chunk list still empty."""
        sdm: dict[str, Any] = {}
        for fqn in [*self.layout.tensors, *self.ties]:
            t = self._tensor(fqn)
            if t.dtype not in DTYPES:
                raise FormatError(
                    f"{self.where}: tensor {fqn!r} has dtype {t.dtype}, unknown to torch"
                )
            props = TensorProperties(dtype=DTYPES[t.dtype])
            sdm[fqn] = TensorStorageMetadata(props, torch.Size(t.shape), [])
        for fqn, value in values.items():
            sdm[fqn] = BytesStorageMetadata()
            self.values[fqn] = from_record(value, f"{self.where}: value {fqn!r}")
        planner_data = {k: tuple(v) for k, v in mappings.items()}
        return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=self)

    def _boxes(self, fqn: str, local: Sequence[Box] | None) -> Iterable[Box]:
        t = self._tensor(fqn)
        if t.grid is None:
            chunks = [(c.offsets, c.sizes) for c in t.chunks or ()]
            return [c for c in chunks if local is None or any(_overlaps(c, b) for b in local)]
        g = t.grid
        if local is None:
            return [g.box(c) for c in g.cells()]
        cells = {c for o, n in local for c in g.overlapping(o, n)}
        return [g.box(c) for c in sorted(cells)]

    def fill(self, metadata: Metadata, local: Mapping[str, Sequence[Box]] | None) -> None:
        """Fill the chunk lists still empty: with the chunks ``local``'s boxes overlap
        (names ``local`` lacks stay empty), or, with ``None``, with every chunk."""
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata) or fqn in self._filled:
                continue
            if local is not None and fqn not in local:
                continue
            boxes = self._boxes(fqn, None if local is None else local[fqn])
            md.chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in boxes]
            self._filled.add(fqn)

    def value(self, index: MetadataIndex) -> Value:
        got = self.values.get(index.fqn)
        if got is None:
            raise FormatError(f"{self.where}: value {index.fqn!r} is not in the checkpoint")
        return got

    def tables_for(self, keys: Iterable[tuple[str, Sequence[int]]]) -> set[int]:
        """The tables the chunks at ``(fqn, offsets)`` are listed in (none for inline)."""
        out = set()
        for fqn, offsets in keys:
            g = self._tensor(fqn).grid
            cell = g.cell_at(offsets) if g is not None else None
            if g is not None and cell is not None:
                out.add(g.table_of(cell))
        return out

    def load_tables(self, which: Iterable[int]) -> None:
        """Read the tables among ``which`` not read yet, in one batch."""
        missing = set(which) - set(self._tables)
        if missing:
            got = read_tables(self.store, self.layout, missing, self.where)
            self.table_bytes += sum(self.layout.table_sizes[i] for i in got)
            self._tables.update(got)

    def chunk(self, fqn: str, offsets: Sequence[int]) -> tuple[str, Chunk]:
        """``(dtype, chunk)`` of the chunk at ``offsets``, reading its table if need be.

        Raises:
            FormatError: No chunk starts there, or its table is damaged.
        """
        t = self._tensor(fqn)
        offsets = tuple(offsets)
        if t.grid is None:
            name = self.ties.get(fqn, fqn)
            if name not in self._inline:
                self._inline[name] = {c.offsets: c for c in t.chunks or ()}
            if offsets in self._inline[name]:
                return t.dtype, self._inline[name][offsets]
        else:
            cell = t.grid.cell_at(offsets)
            if cell is not None:
                table = t.grid.table_of(cell)
                self.load_tables([table])
                name = self.ties.get(fqn, fqn)
                return t.dtype, grid_chunk(name, t.grid, cell, self._tables[table], self.where)
        raise FormatError(f"{self.where}: tensor {fqn!r} has no chunk at {offsets}")


def local_boxes(state: Mapping[str, Any]) -> dict[str, list[Box]] | None:
    """The box each tensor of a flattened state covers on this rank (DTensor shards too);
    ``None`` where this torch cannot say."""
    try:
        from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
    except ImportError:  # pragma: no cover - every torch this package supports has it
        return None
    out: dict[str, list[Box]] = {}
    for fqn, obj in state.items():
        if isinstance(obj, torch.Tensor):
            try:
                chunks = _create_chunk_list(obj)
            except ValueError:
                continue
            out[fqn] = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
    return out


class VaultLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that lists, per tensor, only the chunks this rank's
    shards overlap, so planning costs what the rank reads, not the world size.

    With another planner the reader lists every chunk, as DCP's own readers do.
    """

    def set_up_planner(
        self,
        state_dict: Any,
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        index = metadata.storage_data if metadata is not None else None
        if isinstance(index, ChunkIndex) and metadata is not None:
            boxes = local_boxes(self.state_dict)
            if boxes is not None:
                index.fill(metadata, boxes)
                index.narrowed = True
