"""The manifest: weightvault's knowledge about a file, kept in ``__metadata__``.

A plain safetensors reader sees only the stored tensors, the de facto ``{alias: kept}``
entries and ``"format"``. Everything else lives in one namespaced entry, ``weightvault``,
whose value is a JSON document::

    {"version": 2, "checksum": "xxh3_64", "sums": {stored: hex},
     "aliases": {alias: kept}, "copies": {copy: stored},
     "views": {name: [base, dtype, shape, stride, byte_offset]},
     "frozen": [...], "names": [... every name, model order ...], "metadata": {...},
     "duplicates": {stored: equal earlier name}, "training": {...}}

``metadata`` is also written as plain ``__metadata__`` entries, so ``safe_open`` shows
it; ``duplicates`` (present only when non-empty) lists stored tensors whose bytes equal
an earlier one's, kept for plain readers, so ``inspect`` can tell what
``dedupe_copies=True`` would save.
``"training"`` (optimizer, scheduler and RNG state) is present only in checkpoints saved
with them; :mod:`weightvault._training` describes it.

``version`` says whether the header is sealed (:data:`~.header.HEADER_SUM_KEY`): a file
of version 2 must carry its header's sum and one of version 1 (written before sums)
must carry none, so no change of one byte turns a sealed file into one read unchecked.
A vault record's header is sealed by its record and keeps version 1.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .._base.dtypes import ITEMSIZE, MAX_DIMS, fits_int64, span
from .._base.errors import ChecksumError, FormatError
from .header import HEADER_SUM_KEY, TensorInfo, check_unicode

MANIFEST_KEY = "weightvault"
#: The version a file is written at: its header carries its sum.
FORMAT_VERSION = 2
#: A header without a sum: files written before sums, and vault records' headers.
UNSEALED_VERSION = 1
READ_VERSIONS = (UNSEALED_VERSION, FORMAT_VERSION)
CHECKSUM_ALGORITHM = "xxh3_64"
CHECKSUM_WIDTH = 16
#: Metadata keys with a meaning of their own, never read as ``{alias: kept}``.
RESERVED_KEYS = frozenset({"format", MANIFEST_KEY, HEADER_SUM_KEY})
#: Stored tensors under this prefix hold the storage that several partial views share;
#: they are no model's name.
INTERNAL_PREFIX = "__weightvault__."


@dataclass(frozen=True)
class View:
    """A tensor that reads part of a stored tensor's bytes with its own dtype and strides."""

    base: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # bytes from the start of ``base``

    def span(self) -> int:
        """Bytes from ``offset`` to one past the last element (0 when empty)."""
        return span(self.dtype, self.shape, self.stride)


@dataclass
class Manifest:
    """What a file holds beyond its stored tensors."""

    aliases: dict[str, str] = field(default_factory=dict)
    copies: dict[str, str] = field(default_factory=dict)
    views: dict[str, View] = field(default_factory=dict)
    frozen: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    sums: dict[str, str] = field(default_factory=dict)
    checksum: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    #: A file's writer sets :data:`FORMAT_VERSION` as it seals the header.
    version: int = UNSEALED_VERSION
    ours: bool = True
    duplicates: dict[str, str] = field(default_factory=dict)
    training: dict[str, Any] | None = None

    def encode(self) -> str:
        views = {
            n: [v.base, v.dtype, list(v.shape), list(v.stride), v.offset]
            for n, v in self.views.items()
        }
        doc = {
            "version": self.version,
            "checksum": self.checksum,
            "sums": self.sums,
            "aliases": self.aliases,
            "copies": self.copies,
            "views": views,
            "frozen": self.frozen,
            "names": self.names,
            "metadata": self.metadata,
        }
        if self.duplicates:
            doc["duplicates"] = self.duplicates
        if self.training is not None:
            # Only when present, so weights-only files keep their bytes.
            doc["training"] = self.training
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def read_manifest(
    metadata: dict[str, str],
    tensors: dict[str, TensorInfo],
    where: str,
    *,
    sealed: bool | None = None,
) -> Manifest:
    """Build the manifest of a file from its header, validating every reference.

    Files we did not write get a manifest too: their ``{alias: kept}`` entries (written by
    ``safetensors.torch.save_model`` or the Hub converter) become aliases.

    Args:
        metadata: The header's ``__metadata__``.
        tensors: The header's stored tensors.
        where: The file, for messages.
        sealed: For a file, whether its header carried its sum: version 2 must, version
            1 and files without a manifest must not. ``None`` (a vault record's header,
            which its record seals) checks nothing.

    Raises:
        FormatError: A reference points nowhere, names collide, aliases form a cycle,
            or the version and the header's sum disagree (a :class:`ChecksumError`).
    """
    raw = metadata.get(MANIFEST_KEY)
    if raw is None:
        if sealed:
            raise FormatError(
                f"{where}: the header carries {HEADER_SUM_KEY!r} but no weightvault manifest "
                f"({MANIFEST_KEY!r}); restore the file from a good copy"
            )
        return _foreign_manifest(metadata, tensors, where)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where}: the weightvault manifest is not valid JSON") from e
    check_unicode(raw, doc, where, "weightvault manifest")
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: the weightvault manifest must be a JSON object")
    version = doc.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise FormatError(
            f"{where}: manifest version {str(version)[:20]!r} is not supported by this "
            f"weightvault (it reads versions {READ_VERSIONS[0]} and {READ_VERSIONS[-1]}); "
            "upgrade weightvault"
        )
    if sealed is not None and sealed != (version == FORMAT_VERSION):
        # Either way one damaged byte (a version digit, the sum's key) would otherwise
        # turn a sealed file into one read unchecked.
        problem = (
            f"carries a checksum ({HEADER_SUM_KEY!r}) but its manifest is version {version}, "
            "written before header checksums"
            if sealed
            else f"lacks the checksum ({HEADER_SUM_KEY!r}) that every file of manifest "
            f"version {version} carries"
        )
        raise ChecksumError(
            f"{where}: the header {problem}: it was damaged after it was saved; restore "
            "the file from a good copy"
        )
    m = Manifest(
        aliases=_str_map(doc.get("aliases", {}), "aliases", where),
        copies=_str_map(doc.get("copies", {}), "copies", where),
        views={
            n: _view(n, v, where) for n, v in _dict(doc.get("views", {}), "views", where).items()
        },
        frozen=_str_list(doc.get("frozen", []), "frozen", where),
        names=_str_list(doc.get("names", []), "names", where),
        sums=_str_map(doc.get("sums", {}), "sums", where),
        checksum=doc.get("checksum"),
        metadata=_str_map(doc.get("metadata", {}), "metadata", where),
        duplicates=_str_map(doc.get("duplicates", {}), "duplicates", where),
        training=None if doc.get("training") is None else _dict(doc["training"], "training", where),
        version=version,
    )
    _validate(m, tensors, where)
    return m


def _foreign_manifest(
    metadata: dict[str, str], tensors: dict[str, TensorInfo], where: str
) -> Manifest:
    # Chains (a -> b -> stored) are legal in the convention. Each key is resolved once
    # and the answer shared along its path, so a long chain costs linear time. A chain
    # that ends nowhere, cycles included, names no tensor: plain metadata.
    resolved: dict[str, str | None] = {}
    for key in metadata:
        if key in RESERVED_KEYS or key in tensors or key in resolved:
            continue
        path, on_path, target = [], set(), key
        while True:
            if target in tensors:
                answer: str | None = target
                break
            if target in resolved:
                answer = resolved[target]
                break
            if target in on_path or target in RESERVED_KEYS or target not in metadata:
                answer = None
                break
            path.append(target)
            on_path.add(target)
            target = metadata[target]
        for k in path:
            resolved[k] = answer
    aliases = {k: t for k, t in resolved.items() if t is not None}
    names = list(tensors) + list(aliases)
    user = {k: v for k, v in metadata.items() if k not in aliases}
    return Manifest(aliases=aliases, names=names, metadata=user, ours=False)


def _dict(value: Any, what: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FormatError(f"{where}: manifest field {what!r} must be an object")
    return value


def _str_map(value: Any, what: str, where: str) -> dict[str, str]:
    d = _dict(value, what, where)
    if not all(isinstance(v, str) for v in d.values()):
        raise FormatError(f"{where}: manifest field {what!r} must map names to names")
    return d


def _str_list(value: Any, what: str, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise FormatError(f"{where}: manifest field {what!r} must be a list of names")
    return value


def _view(name: str, value: Any, where: str) -> View:
    ok = isinstance(value, list) and len(value) == 5
    if ok:
        base, dtype, shape, stride, offset = value
        ok = (
            isinstance(base, str)
            and isinstance(dtype, str)
            and dtype in ITEMSIZE
            and isinstance(shape, list)
            and isinstance(stride, list)
            and len(shape) == len(stride) <= MAX_DIMS
            and all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63
                for d in [*shape, *stride, offset]
            )
        )
    if not ok:
        raise FormatError(f"{where}: view {name!r}: malformed view record")
    if not fits_int64(shape, ITEMSIZE[dtype]):
        raise FormatError(f"{where}: view {name!r}: shape {shape[:8]} overflows 64-bit sizes")
    return View(base, dtype, tuple(shape), tuple(stride), offset)


def _validate(m: Manifest, tensors: dict[str, TensorInfo], where: str) -> None:
    logical = [*m.aliases, *m.copies, *m.views]
    if len(set(logical)) != len(logical) or not set(logical).isdisjoint(tensors):
        counts = Counter(logical)
        clash = sorted({n for n, c in counts.items() if c > 1} | (set(logical) & set(tensors)))
        raise FormatError(f"{where}: manifest gives names {clash[:8]} more than one meaning")
    for name, target in m.copies.items():
        if target not in tensors and target not in m.views:
            raise FormatError(
                f"{where}: copy {name!r} points at {target!r}, which is neither stored nor a view"
            )
    for name, target in m.aliases.items():
        # An alias names a stored tensor, a copy or a view, never another alias, so no
        # chain and no cycle can form.
        if target not in tensors and target not in m.copies and target not in m.views:
            raise FormatError(
                f"{where}: alias {name!r} points at {target!r}, which is neither stored "
                "nor a copy or view"
            )
    for name, view in m.views.items():
        base = tensors.get(view.base)
        if base is None:
            raise FormatError(f"{where}: view {name!r} reads {view.base!r}, which is not stored")
        if view.offset % ITEMSIZE[view.dtype]:
            raise FormatError(
                f"{where}: view {name!r} starts at byte {view.offset}, which is not a "
                f"multiple of its {view.dtype} item size"
            )
        if view.offset + view.span() > base.nbytes:
            raise FormatError(
                f"{where}: view {name!r} reads bytes [{view.offset}, "
                f"{view.offset + view.span()}) outside {view.base!r} ({base.nbytes} bytes)"
            )
    for name, twin in m.duplicates.items():
        if name not in tensors or name == twin or (twin not in tensors and twin not in m.views):
            raise FormatError(
                f"{where}: duplicate {name!r} of {twin!r} must name two stored tensors or views"
            )
    every = set(tensors) | set(logical)
    if not set(m.frozen) <= every or not set(m.names) <= every:
        unknown = sorted((set(m.frozen) | set(m.names)) - every)
        raise FormatError(f"{where}: manifest lists unknown names {unknown[:8]}")
    if m.checksum is not None:
        if m.checksum != CHECKSUM_ALGORITHM:
            raise FormatError(f"{where}: unknown checksum algorithm {str(m.checksum)[:20]!r}")
        if set(m.sums) != set(tensors) or not all(
            len(s) == CHECKSUM_WIDTH and all(c in "0123456789abcdef" for c in s)
            for s in m.sums.values()
        ):
            raise FormatError(f"{where}: manifest checksums do not match the stored tensors")
    # Names the model had, in its order; a file without the list still reads.
    listed = set(m.names)
    m.names += [
        n for n in [*tensors, *logical] if n not in listed and not n.startswith(INTERNAL_PREFIX)
    ]
