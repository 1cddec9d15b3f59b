"""Vault records of checkpoints written through torch.distributed.checkpoint (DCP).

A DCP save leaves each tensor in pieces: one content-addressed object per shard chunk,
written by whichever rank held that chunk. The record (``checkpoints/<name>.json``, kind
``"dcp"``) is JSON, nothing is pickled; it lists each tensor's chunks, inline or in the
per-rank chunk tables it names (:mod:`.dcp_layout`). It also carries the usual
safetensors header for the model's tensors (canonical names, ties as aliases, frozen
flags), so a single plain process can load the checkpoint
with :meth:`Vault.load` or export it with :meth:`Vault.export`: :class:`DcpCheckpoint`
assembles each tensor from its chunks on demand.

This module imports no framework; :mod:`weightvault.dcp` writes these records.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._base.dtypes import ITEMSIZE, numel
from ..._base.errors import ChecksumError, FormatError
from ..._file.header import TensorInfo, encode_header
from ..._file.manifest import MANIFEST_KEY, Manifest
from ..._training.codec import decode
from ..objects.address import content_hash, object_key
from ..objects.prefetch import prefetch
from ..objects.read import damaged, read_object, read_verified
from ..store.backend import Store
from ..store.pack import missing
from .dcp_layout import Chunk, Layout, grid_chunk, parse_layout, parse_table
from .names import record_key
from .object_checkpoint import ObjectCheckpoint
from .record import parse_header_text, parse_record

KIND = "dcp"


@dataclass(frozen=True)
class ChunkedTensor:
    """A global tensor kept as chunks."""

    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


def parse_tensors(section: Mapping[str, Any], where: str) -> dict[str, ChunkedTensor]:
    """The inline ``tensors`` of a version 1 ``dcp`` section, validated."""
    layout = parse_layout({"version": 1, "tensors": section}, where)
    return {f: ChunkedTensor(t.dtype, t.shape, t.chunks or ()) for f, t in layout.tensors.items()}


def read_tables(
    store: Store, layout: Layout, which: Iterable[int], where: str
) -> dict[int, dict[str, dict[tuple[int, ...], Chunk]]]:
    """Tables ``which`` of ``layout``, each checked against its object name.

    Raises:
        FormatError: A table is missing, corrupt or malformed.
    """
    wanted = {i: layout.tables[i] for i in set(which)}
    digests = {i: d for i, d in wanted.items() if d is not None}
    keys = {object_key(d): i for i, d in digests.items()}
    try:
        got = {keys[k]: v for k, v in store.get_many(sorted(keys)).items()}
    except FileNotFoundError:
        got = {}  # one is in a gc's trash, or gone: read each where it is
    out = {}
    for i, digest in sorted(digests.items()):
        try:
            files = {digest: got[i]} if i in got else None
            raw = read_verified(store, digest, files=files)
        except FileNotFoundError:
            raise FormatError(
                f"{where}: chunk table of rank {i} ({digest[:12]}) is missing; the vault is "
                "damaged, run 'weightvault vault ROOT verify'"
            ) from None
        except ChecksumError:
            raise FormatError(
                f"{where}: chunk table of rank {i} ({digest[:12]}) is corrupt (hash mismatch); "
                "run 'weightvault vault ROOT verify'"
            ) from None
        out[i] = parse_table(raw, f"{where} (table of rank {i})")
    return out


def resolve_tensors(
    layout: Layout, tables: Mapping[int, Mapping[str, Mapping[Any, Chunk]]], where: str
) -> dict[str, ChunkedTensor]:
    """Every tensor with all its chunks, the grid's looked up in ``tables``."""
    out = {}
    for fqn, t in layout.tensors.items():
        if t.grid is None:
            out[fqn] = ChunkedTensor(t.dtype, t.shape, t.chunks or ())
            continue
        g = t.grid
        chunks = [grid_chunk(fqn, g, c, tables[g.table_of(c)], where) for c in g.cells()]
        out[fqn] = ChunkedTensor(t.dtype, t.shape, tuple(chunks))
    return out


def check_section(section: Mapping[str, Any], tensors: Mapping[str, Any], where: str) -> None:
    """The checks a DCP load (:mod:`weightvault.dcp`) makes of a record's ``dcp`` section
    beyond its chunk layout (``tensors``, by name): the ties name stored tensors, the
    frozen names and mappings are lists, and every non-tensor value decodes. For
    ``verify``, which has no torch to open the checkpoint through DCP.

    Raises:
        FormatError: What a DCP load would refuse, naming the record and the field.
    """
    try:
        ties = {str(a): str(c) for a, c in dict(section.get("ties", {})).items()}
        [str(f) for f in section.get("frozen", [])]
        values = dict(section.get("values", {}))
        for v in dict(section.get("mappings", {})).values():
            tuple(v)
    except (TypeError, ValueError, AttributeError) as e:
        raise FormatError(
            f"{where}: DCP record's ties, frozen names, values or mappings are malformed "
            f"({e!r:.80}); restore the record or delete the checkpoint"
        ) from e
    for alias, canon in ties.items():
        if canon not in tensors:
            raise FormatError(f"{where}: tie {alias!r} -> {canon!r} names no stored tensor")
    for fqn, value in values.items():
        decode(value, f"{where}: value {fqn!r}")


def model_header(
    tensors: Mapping[str, ChunkedTensor],
    ties: Mapping[str, str],
    names: Sequence[str],
    frozen: Sequence[str],
    prefix: str,
    framework: str | None,
    metadata: Mapping[str, str],
) -> str:
    """The safetensors header a single file of the model's tensors would have.

    Only names under ``prefix`` (``"model."`` for :func:`weightvault.dcp.save`) are the
    model's; the prefix is stripped. Ties become aliases of their canonical name.
    """
    model = [n for n in names if n.startswith(prefix) and (n in tensors or n in ties)]
    stored = [n for n in model if n in tensors]
    aliases = {
        a[len(prefix) :]: ties[a][len(prefix) :]
        for a in model
        if a in ties and ties[a] in tensors and ties[a].startswith(prefix)
    }
    infos, position = [], 0
    # Widest dtype first, as the file writer lays them out, so offsets stay aligned.
    for n in sorted(stored, key=lambda n: -ITEMSIZE[tensors[n].dtype]):
        t = tensors[n]
        size = numel(t.shape) * ITEMSIZE[t.dtype]
        infos.append(TensorInfo(n[len(prefix) :], t.dtype, t.shape, position, position + size))
        position += size
    manifest = Manifest(
        aliases=aliases,
        frozen=[f[len(prefix) :] for f in frozen if f.startswith(prefix)],
        names=[n[len(prefix) :] for n in model],
        metadata=dict(metadata),
    )
    meta = {"format": framework} if framework else {}
    meta[MANIFEST_KEY] = manifest.encode()
    return encode_header(infos, meta)[8:].decode("utf-8").rstrip(" ")


class DcpCheckpoint(ObjectCheckpoint):
    """A DCP-made vault checkpoint, read by a single process as one whole model.

    ``objects`` maps one label per chunk (``"<fqn>@<i>"``, optimizer state included) to
    its object, so gc keeps and verify checks every piece.
    """

    def __init__(self, store: Store, name: str, doc: Mapping[str, Any]) -> None:
        where = f"{store.url}/{record_key(name)}"
        self.record = parse_record(name, doc, where)
        section, header_text = doc.get("dcp"), doc.get("header")
        if not isinstance(section, dict) or not isinstance(header_text, str):
            raise FormatError(f"{where}: DCP checkpoint record lacks its chunk table or header")
        layout = parse_layout(section, where)
        tables = read_tables(store, layout, range(len(layout.tables)), where)
        self.tensors = resolve_tensors(layout, tables, where)
        self.prefix = str(section.get("model_prefix", ""))
        header, manifest = parse_header_text(header_text, where)
        self._check_coverage(header.tensors, where)
        objects: dict[str, str] = {}
        sizes: dict[str, int] = {}
        for fqn, t in self.tensors.items():
            for i, c in enumerate(t.chunks):
                objects[f"{fqn}@{i}"] = c.digest
                sizes[f"{fqn}@{i}"] = c.nbytes(t.dtype)
        for i, digest in enumerate(layout.tables):
            if digest is not None:  # gc keeps and verify checks the tables too
                objects[f"chunk table of rank {i}"] = digest
                sizes[f"chunk table of rank {i}"] = layout.table_sizes[i]
        self._pieces: dict[str, bytes | memoryview] = {}
        self._files: dict[str, bytes] = {}
        super().__init__(
            store, where, header.tensors, manifest,
            framework=header.metadata.get("format"), objects=objects, sizes=sizes,
        )  # fmt: skip

    def _check_coverage(self, stored: Mapping[str, TensorInfo], where: str) -> None:
        """Every tensor of the header has chunks of its dtype and shape covering it."""
        for name, info in stored.items():
            t = self.tensors.get(self.prefix + name)
            if t is None or t.dtype != info.dtype or t.shape != info.shape:
                raise FormatError(f"{where}: tensor {name!r} has no matching chunks")
            covered = sum(numel(c.sizes) for c in t.chunks)
            if covered != numel(t.shape):
                raise FormatError(
                    f"{where}: tensor {name!r}: its chunks cover {covered} of "
                    f"{numel(t.shape)} elements"
                )

    def fetch(self) -> None:
        """Bring the model's chunk objects into memory now, concurrently."""
        digests = [c.digest for s in self.stored for c in self.tensors[self.prefix + s].chunks]
        self._files.update(prefetch(self.store, digests))

    def _piece(self, stored: str, c: Chunk, dtype: str) -> bytes | memoryview:
        expected = c.nbytes(dtype)
        if c.digest not in self._pieces:
            try:
                self._pieces[c.digest] = read_object(
                    self.store, c.digest, expected, files=self._files
                )
            except FileNotFoundError:
                raise missing(self.store, self.path, stored, "a chunk object is missing") from None
            except FormatError as e:
                raise damaged(self.path, stored, str(e)) from None
        data = self._pieces[c.digest]
        if len(data) != expected:
            raise damaged(
                self.path, stored, f"a chunk object holds {len(data)} bytes, expected {expected}"
            )
        return data

    def raw(self, stored: str) -> memoryview:
        t = self.tensors[self.prefix + stored]
        item = ITEMSIZE[t.dtype]
        if len(t.chunks) == 1 and t.chunks[0].sizes == t.shape:
            return memoryview(self._piece(stored, t.chunks[0], t.dtype)).cast("B")
        out = bytearray(numel(t.shape) * item)
        for c in t.chunks:
            if numel(c.sizes) == 0:
                continue
            _place(out, t.shape, item, c, memoryview(self._piece(stored, c, t.dtype)).cast("B"))
        return memoryview(out)

    def read_into(self, stored: str, buffer: memoryview) -> bool:
        return False

    def check(self, stored: str) -> bool:
        t = self.tensors[self.prefix + stored]
        return all(content_hash(self._piece(stored, c, t.dtype)) == c.digest for c in t.chunks)


def _place(out: bytearray, shape: tuple[int, ...], item: int, c: Chunk, src: memoryview) -> None:
    """Copy chunk ``c`` (row-major bytes ``src``) into the row-major tensor ``out``."""
    # The trailing dims the chunk spans completely form one contiguous run per outer index.
    run_dims = len(shape)
    while run_dims > 0 and c.sizes[run_dims - 1] == shape[run_dims - 1]:
        run_dims -= 1
    if run_dims == 0:
        out[:] = src
        return
    # Dim run_dims-1 is partial; everything after it is whole, so one run spans that dim's slice.
    inner = numel(shape[run_dims:]) * item
    run = c.sizes[run_dims - 1] * inner
    strides = [numel(shape[d + 1 :]) * item for d in range(len(shape))]
    pos = 0
    for idx in itertools.product(*(range(s) for s in c.sizes[: run_dims - 1])):
        start = sum((c.offsets[d] + i) * strides[d] for d, i in enumerate(idx))
        start += c.offsets[run_dims - 1] * strides[run_dims - 1]
        out[start : start + run] = src[pos : pos + run]
        pos += run
