"""Where a DCP checkpoint lists its chunks: in the record, or in per-rank chunk tables.

A record of version 1 lists every chunk of every tensor (``[offsets, sizes, object]``)
in its one JSON document, so every loading rank reads all of them: 34 MB at 1,024 ranks.
From version 2 the record is a small index. Each saving rank writes the chunks it stored
into its own *chunk table*, a content-addressed JSON object, before the commit; the
index names those tables (``dcp.tables``, one per rank) and describes each tensor's
chunks without their objects:

- a tensor whose chunks tile it as a grid (FSDP, tensor parallel, both) keeps only the
  grid: per dimension the cells' starts (an int ``s`` for cells of ``s``, the last one
  shorter), and which table holds each cell (``{"start": a, "strides": [k, ...]}`` for
  ``a + sum(k * cell index)``, or one table number per cell in row-major order);
- any other tensor (one chunk, replicated scalars, irregular layouts) keeps its chunks
  inline, objects included, as version 1 did.

A loading rank reads the index, works out which cells its shards overlap, and reads only
the tables holding them. The commit is still one exclusive create of the index: the
tables are objects, durable before it, and named by it, so gc keeps them.

Example:
    >>> t = encode_tensor("F32", (4, 2), [((0, 0), (2, 2), "a" * 64, 0), ((2, 0), (2, 2), "b" * 64, 1)])
    >>> t["grid"], t["tables"]
    ([2, 2], {'start': 0, 'strides': [1, 0]})
"""  # noqa: E501

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..._base.dtypes import ITEMSIZE, numel
from ..._base.errors import FormatError
from ..objects.address import DIGEST

__all__ = [
    "LAYOUT_VERSION",
    "Chunk",
    "Grid",
    "Layout",
    "encode_table",
    "encode_tensor",
    "parse_layout",
    "parse_table",
]

#: The ``dcp.version`` this module writes; 1 (every chunk inline) still reads.
LAYOUT_VERSION = 2

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: its box in the global tensor and its object."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    digest: str

    def nbytes(self, dtype: str) -> int:
        return numel(self.sizes) * ITEMSIZE[dtype]


@dataclass(frozen=True)
class Grid:
    """Chunks that tile a tensor: per dimension the cells' starts, and each cell's table.

    Attributes:
        shape: The tensor's shape.
        starts: Per dimension, the start of each cell (a ``range`` for even cells).
        affine: The table of each cell as ``(start, strides)``: ``start + sum(k * i)``.
        listed: Or the table of each cell, in row-major order.
    """

    shape: tuple[int, ...]
    starts: tuple[Sequence[int], ...]
    affine: tuple[int, tuple[int, ...]] | None = None
    listed: tuple[int, ...] = ()

    def count(self) -> int:
        return numel(tuple(len(s) for s in self.starts))

    def _span(self, d: int, i: int) -> tuple[int, int]:
        s = self.starts[d]
        return s[i], (s[i + 1] if i + 1 < len(s) else self.shape[d])

    def box(self, cell: Sequence[int]) -> Box:
        spans = [self._span(d, i) for d, i in enumerate(cell)]
        return tuple(a for a, _ in spans), tuple(b - a for a, b in spans)

    def cell_at(self, offsets: Sequence[int]) -> tuple[int, ...] | None:
        """The cell that starts at ``offsets``, or ``None``."""
        if len(offsets) != len(self.starts):
            return None
        out = []
        for d, o in enumerate(offsets):
            i = bisect.bisect_left(self.starts[d], o)
            if i >= len(self.starts[d]) or self.starts[d][i] != o:
                return None
            out.append(i)
        return tuple(out)

    def table_of(self, cell: Sequence[int]) -> int:
        if self.affine is not None:
            start, strides = self.affine
            return start + sum(k * i for k, i in zip(strides, cell, strict=True))
        flat = 0
        for d, i in enumerate(cell):
            flat = flat * len(self.starts[d]) + i
        return self.listed[flat]

    def cells(self) -> Iterator[tuple[int, ...]]:
        return itertools.product(*(range(len(s)) for s in self.starts))

    def overlapping(
        self, offsets: Sequence[int], sizes: Sequence[int]
    ) -> Iterator[tuple[int, ...]]:
        """The cells a box overlaps (none for an empty box)."""
        if numel(tuple(sizes)) == 0:
            return iter(())
        ranges = []
        for d, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
            first = max(bisect.bisect_right(self.starts[d], o) - 1, 0)
            last = bisect.bisect_left(self.starts[d], o + n)
            ranges.append(range(first, last))
        return itertools.product(*ranges)


@dataclass(frozen=True)
class TensorLayout:
    """One tensor of the index: its chunks inline, or the grid they tile."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...] | None = None
    grid: Grid | None = None


@dataclass(frozen=True)
class Layout:
    """A record's ``dcp`` section: every tensor's layout, and the tables it names.

    Attributes:
        tensors: ``{fqn: TensorLayout}``.
        tables: One object per saving rank (``None`` for a rank that stored no chunk).
        table_sizes: Their sizes in bytes.
    """

    tensors: dict[str, TensorLayout]
    tables: tuple[str | None, ...]
    table_sizes: tuple[int, ...]


# -- writing -------------------------------------------------------------------------------


def _starts_of(shape: tuple[int, ...], boxes: Sequence[Box]) -> list[list[int]] | None:
    """Per dimension the sorted cell starts, if ``boxes`` tile ``shape`` as a grid."""
    starts = [sorted({o[d] for o, _ in boxes}) for d in range(len(shape))]
    if numel(tuple(len(s) for s in starts)) != len(boxes):
        return None
    ends = [dict(zip(s, [*s[1:], n], strict=True)) for s, n in zip(starts, shape, strict=True)]
    for offsets, sizes in boxes:
        for d, (o, n) in enumerate(zip(offsets, sizes, strict=True)):
            if ends[d][o] != o + n:
                return None
    if len(set(boxes)) != len(boxes):
        return None
    return starts


def _encode_starts(starts: list[int], n: int) -> int | list[int]:
    if len(starts) == 1:
        return n
    step = starts[1]
    return step if starts == list(range(0, n, step)) else starts


def _encode_tables(grid: Grid, tables: Mapping[tuple[int, ...], int]) -> Any:
    """Cells' tables as ``{"start", "strides"}`` where that holds, else one per cell."""
    zero = tuple(0 for _ in grid.starts)
    start = tables[zero]
    strides = []
    for d, s in enumerate(grid.starts):
        unit = tuple(int(i == d) for i in range(len(grid.starts)))
        strides.append(tables[unit] - start if len(s) > 1 else 0)
    affine = Grid(grid.shape, grid.starts, (start, tuple(strides)))
    if all(affine.table_of(c) == t for c, t in tables.items()):
        return {"start": start, "strides": strides}
    return [tables[c] for c in grid.cells()]


def encode_tensor(
    dtype: str,
    shape: Sequence[int],
    chunks: Sequence[tuple[Sequence[int], Sequence[int], str, int]],
) -> dict[str, Any]:
    """One tensor's index entry, from its chunks ``(offsets, sizes, object, table)``.

    Chunks that tile the tensor as a grid are described by the grid (their objects stay
    in the tables); a single chunk, an empty tensor or an irregular layout is inline.
    """
    shape = tuple(int(s) for s in shape)
    entry: dict[str, Any] = {"dtype": dtype, "shape": list(shape)}
    full = [(tuple(o), tuple(s), d, t) for o, s, d, t in chunks if numel(tuple(s)) > 0]
    starts = _starts_of(shape, [(o, s) for o, s, _, _ in full]) if len(full) > 1 else None
    if starts is None:
        entry["chunks"] = [[list(o), list(s), d] for o, s, d, _ in chunks]
        return entry
    grid = Grid(shape, tuple(starts))
    tables = {cast(tuple[int, ...], grid.cell_at(o)): t for o, _, _, t in full}
    entry["grid"] = [_encode_starts(s, n) for s, n in zip(starts, shape, strict=True)]
    entry["tables"] = _encode_tables(grid, tables)
    return entry


def encode_table(chunks: Mapping[str, Sequence[tuple[Sequence[int], Sequence[int], str]]]) -> bytes:
    """A rank's chunk table: ``{"chunks": {fqn: [[offsets, sizes, object], ...]}}``."""
    doc = {"chunks": {f: [[list(o), list(s), d] for o, s, d in cs] for f, cs in chunks.items()}}
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


# -- reading -------------------------------------------------------------------------------


def _chunk(entry: Any, shape: tuple[int, ...] | None, fqn: str) -> Chunk:
    """A ``[offsets, sizes, object]`` entry; within ``shape`` unless it is ``None``."""
    off, sizes, digest = entry
    c = Chunk(tuple(int(o) for o in off), tuple(int(s) for s in sizes), str(digest))
    if len(c.offsets) != len(c.sizes) or (shape is not None and len(c.sizes) != len(shape)):
        raise ValueError(f"chunk rank differs from the tensor's ({fqn})")
    if any(o < 0 or s < 0 for o, s in zip(c.offsets, c.sizes, strict=True)):
        raise ValueError(f"negative chunk box ({fqn})")
    if shape is not None and any(
        o + s > n for o, s, n in zip(c.offsets, c.sizes, shape, strict=True)
    ):
        raise ValueError(f"chunk out of bounds ({fqn})")
    if not DIGEST.fullmatch(c.digest):
        raise ValueError(f"bad object name ({fqn})")
    return c


def _parse_starts(doc: Any, n: int, fqn: str) -> Sequence[int]:
    if type(doc) is int:
        if doc <= 0 or n <= 0:
            raise ValueError(f"grid step {doc} of a dimension of {n} ({fqn})")
        return range(0, n, doc)
    starts = [int(x) for x in doc]
    if not starts or starts[0] != 0 or starts[-1] >= n or starts != sorted(set(starts)):
        raise ValueError(f"grid starts are not increasing from 0 ({fqn})")
    return starts


def _parse_grid(t: Mapping[str, Any], shape: tuple[int, ...], fqn: str, tables: int) -> Grid:
    spec = list(t["grid"])
    if len(spec) != len(shape):
        raise ValueError(f"grid rank differs from the tensor's ({fqn})")
    starts = tuple(_parse_starts(s, n, fqn) for s, n in zip(spec, shape, strict=True))
    raw = t["tables"]
    if isinstance(raw, dict):
        strides = tuple(int(k) for k in raw["strides"])
        if len(strides) != len(shape):
            raise ValueError(f"table strides differ from the tensor's rank ({fqn})")
        grid = Grid(shape, starts, affine=(int(raw["start"]), strides))
        # A linear map takes its extremes at the grid's corners.
        used = [
            grid.table_of([i * (len(s) - 1) for i, s in zip(c, starts, strict=True)])
            for c in itertools.product((0, 1), repeat=len(shape))
        ]
    else:
        grid = Grid(shape, starts, listed=tuple(int(x) for x in raw))
        if len(grid.listed) != grid.count():
            raise ValueError(f"{len(grid.listed)} tables for {grid.count()} cells ({fqn})")
        used = list(grid.listed)
    if any(u < 0 or u >= tables for u in used):
        raise ValueError(f"a cell names a table the record does not list ({fqn})")
    return grid


def _parse_tensor(fqn: str, t: Mapping[str, Any], tables: int) -> TensorLayout:
    dtype, shape = str(t["dtype"]), tuple(int(s) for s in t["shape"])
    if dtype not in ITEMSIZE:
        raise ValueError(f"unknown dtype {dtype}")
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension ({fqn})")
    if "grid" in t:
        return TensorLayout(dtype, shape, grid=_parse_grid(t, shape, fqn, tables))
    return TensorLayout(dtype, shape, chunks=tuple(_chunk(c, shape, fqn) for c in t["chunks"]))


def parse_layout(section: Mapping[str, Any], where: str) -> Layout:
    """The tensors and tables of a record's ``dcp`` section (version 1 or 2), validated.

    Raises:
        FormatError: The section is malformed, or from a newer weightvault.
    """
    version = section.get("version", 1)
    if version not in (1, LAYOUT_VERSION):
        raise FormatError(
            f"{where}: DCP record version {version!r} is unknown; upgrade weightvault"
        )
    try:
        tables = tuple(None if d is None else str(d) for d in section.get("tables", []))
        sizes = tuple(int(s) for s in section.get("table_sizes", [0] * len(tables)))
        if len(sizes) != len(tables) or any(
            d is not None and not DIGEST.fullmatch(d) for d in tables
        ):
            raise ValueError("table list is malformed")
        tensors = {
            str(f): _parse_tensor(str(f), t, len(tables))
            for f, t in dict(section.get("tensors", {})).items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise FormatError(f"{where}: DCP chunk table is malformed ({e})") from e
    return Layout(tensors, tables, sizes)


def parse_table(raw: bytes | memoryview, where: str) -> dict[str, dict[tuple[int, ...], Chunk]]:
    """A chunk table's ``{fqn: {offsets: Chunk}}`` (bounds are checked against the grid).

    Raises:
        FormatError: The table is not the JSON :func:`encode_table` writes.
    """
    try:
        doc = json.loads(bytes(raw))
        out: dict[str, dict[tuple[int, ...], Chunk]] = {}
        for fqn, entries in dict(doc["chunks"]).items():
            chunks = [_chunk(e, None, str(fqn)) for e in entries]
            out[str(fqn)] = {c.offsets: c for c in chunks}
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
        raise FormatError(f"{where}: DCP chunk table is malformed ({e})") from e
    return out


def grid_chunk(
    fqn: str,
    grid: Grid,
    cell: tuple[int, ...],
    table: Mapping[str, Mapping[Any, Chunk]],
    where: str,
) -> Chunk:
    """Cell ``cell``'s chunk, as its table lists it (checked against the grid).

    Raises:
        FormatError: The table lacks the chunk, or lists another box for it.
    """
    offsets, sizes = grid.box(cell)
    got = table.get(fqn, {}).get(offsets)
    if got is None or got.sizes != sizes:
        raise FormatError(
            f"{where}: tensor {fqn!r}: chunk at {offsets} is missing from its chunk table; "
            "the vault is damaged, run 'weightvault vault ROOT verify'"
        )
    return got
