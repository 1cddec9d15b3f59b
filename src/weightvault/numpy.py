"""Save and load numpy arrays, and read every supported format as numpy.

Example:
    >>> import numpy as np, weightvault.numpy as wvn
    >>> w = np.ones((4, 4), dtype=np.float32)
    >>> report = wvn.save({"a": w, "b": w.copy()}, "w.safetensors")   # b is a copy
    >>> sorted(wvn.load_file("w.safetensors"))
    ['a', 'b']

``load_file`` reads weightvault and plain safetensors files, MXNet ``.params``, torch
``.pt``/``.bin`` (safely), Keras ``.weights.h5`` and ``.npz``, recognised by their bytes.
bfloat16 and float8 arrays use the ``ml_dtypes`` types.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from ._base.background import SnapshotPool
from ._base.dtypes import FRAMEWORK_NAMES, NUMPY_NATIVE, numpy_dtype, unsupported
from ._base.errors import (
    BackendNotInstalled,
    UnsupportedDtypeError as UnsupportedDtypeError,
    UnsupportedValueError,
)

try:
    import numpy as np
except ImportError as e:  # pragma: no cover - exercised only without numpy
    raise BackendNotInstalled(
        "weightvault.numpy needs numpy: pip install 'weightvault[numpy]'"
    ) from e

from ._base.reports import LoadReport, SaveReport
from ._base.types import PathLike
from ._file import writer as _writer
from ._file.checkpoint import Checkpoint, CheckpointSource, Entry
from ._file.sharing import Source
from ._load.plan import RulesArg, Target, plan_load
from .formats._registry import opened

__all__ = ["load", "load_file", "save"]

#: The ``"format"`` written into ``__metadata__``.
FRAMEWORK = "np"


#: Dtypes numpy has natively, and those that need ``ml_dtypes``, by safetensors name.
NATIVE = {k: FRAMEWORK_NAMES[k] for k in NUMPY_NATIVE}
ML_DTYPES = {k: v for k, v in FRAMEWORK_NAMES.items() if k not in NUMPY_NATIVE}


def dtype_of(name: str) -> Any:
    """The numpy dtype of a safetensors dtype name (``ml_dtypes`` for bfloat16, float8).

    Example:
        >>> dtype_of("BF16")
        dtype(bfloat16)
    """
    return numpy_dtype(name)


def _name_of(key: str, a: np.ndarray) -> str:
    dt = a.dtype
    if dt.kind != "V" and dt.names is None:
        for name, np_name in NATIVE.items():
            if dt.kind != "b" and np.dtype(np_name) == dt.newbyteorder("="):
                return name
            if dt.kind == "b" and name == "BOOL":
                return name
    for name, ml_name in ML_DTYPES.items():
        if dt.name == ml_name:
            return name
    raise unsupported(f"array {key!r}", dt, ".astype(np.float32)")


def _bytes(a: np.ndarray) -> memoryview:
    if a.size == 0:
        return memoryview(b"")
    c = np.ascontiguousarray(a)
    if c.dtype.byteorder == ">":
        c = c.astype(c.dtype.newbyteorder("<"))
    out: memoryview = c.reshape(-1).view(np.uint8).data
    return out


def _root(a: np.ndarray) -> np.ndarray:
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root


def _source(key: str, a: np.ndarray) -> Source:
    if not isinstance(a, np.ndarray):
        raise UnsupportedValueError(
            f"save: {key!r} is a {type(a).__name__}, not a numpy array; a dict to save must "
            "hold only arrays (np.asarray(value) converts one)"
        )
    dtype = _name_of(key, a)
    shape = tuple(int(d) for d in a.shape)
    size = a.dtype.itemsize
    root = _root(a)
    ptr = a.__array_interface__["data"][0]
    identity = ("np", ptr, shape, a.strides, str(a.dtype))
    if a.size == 0:
        return Source(key, dtype, shape, ("empty", key), lambda: memoryview(b""))
    offset = ptr - root.__array_interface__["data"][0]
    usable = (
        root.flags.c_contiguous
        and a.dtype.byteorder != ">"
        and offset >= 0
        and all(s >= 0 and s % size == 0 for s in a.strides)
    )
    if not usable:
        return Source(key, dtype, shape, identity, lambda: _bytes(a))
    flat = root.reshape(-1).view(np.uint8)
    return Source(
        key,
        dtype,
        shape,
        identity,
        lambda: _bytes(a),
        storage=("np", root.__array_interface__["data"][0]),
        offset=offset,
        stride=tuple(s // size for s in a.strides),
        region=lambda s, e: flat[s:e].data,
    )


def save(
    arrays: Mapping[str, np.ndarray],
    path: PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    checksum: bool = True,
    dedupe_copies: bool = False,
) -> SaveReport:
    """Save a dict of arrays, storing every shared array once.

    The same array under two names (or two views with the same layout) becomes an alias,
    and partial views of one array are stored once as views. Equal but separate arrays
    are stored under every name, so plain safetensors readers see them all, unless
    ``dedupe_copies`` is set.

    Args:
        arrays: ``{name: array}``; bfloat16 and float8 arrays use ``ml_dtypes``.
        path: Where to write; replaced atomically.
        metadata: Your own ``str -> str`` metadata, also visible to ``safe_open``.
        checksum: Record an xxh3-64 checksum of every stored array.
        dedupe_copies: Store equal but separate arrays once, as copies only weightvault
            readers see.

    Example:
        >>> w = np.zeros((2, 2), np.float32)
        >>> save({"w": w, "w_again": w}, "w.safetensors").aliases
        {'w_again': 'w'}
    """
    return _writer.save_sources(
        path,
        [_source(k, v) for k, v in arrays.items()],
        framework=FRAMEWORK,
        metadata=dict(metadata or {}),
        checksum=checksum,
        dedupe_copies=dedupe_copies,
    )


def _read(ckpt: Checkpoint, e: Entry, bases: dict[str, memoryview]) -> np.ndarray:
    """A fresh array holding the values of ``e`` (the caller owns it).

    Bytes are read with ``preadv``, not through a mapping, so a file truncated meanwhile
    is a :class:`FormatError` instead of a ``SIGBUS``. ``bases`` caches the stored
    tensors that views read, so each is read once.
    """
    if e.view is None:
        out = np.empty(e.shape, dtype=dtype_of(e.dtype))
        flat = out.reshape(-1).view(np.uint8)
        if flat.nbytes and not ckpt.read_into(e.stored, flat.data):
            flat[:] = np.frombuffer(ckpt.raw(e.stored), dtype=np.uint8)
        return out
    v = e.view
    dt = dtype_of(v.dtype)
    if not v.span():
        return np.empty(v.shape, dtype=dt)
    if e.stored not in bases:
        bases[e.stored] = ckpt.read(e.stored)
    # as_strided goes through __array_interface__, which loses ml_dtypes' types (an
    # F8_E5M2 view raised TypeError): stride over unsigned integers of the same width.
    word = np.dtype(f"<u{dt.itemsize}")
    raw = np.frombuffer(bases[e.stored], dtype=np.uint8)
    base = raw[v.offset : v.offset + v.span()].view(word)
    strides = tuple(s * dt.itemsize for s in v.stride)
    out = np.lib.stride_tricks.as_strided(base, v.shape, strides, writeable=False).copy()
    return out.view(dt)


def _cost(ckpt: Checkpoint, names: list[str]) -> int:
    """Bytes that reading ``names`` allocates: every value, and each base a view reads."""
    bases = {ckpt.entry(n).stored for n in names if ckpt.entry(n).view is not None}
    return sum(ckpt.entry(n).nbytes for n in names) + sum(ckpt.stored[s].nbytes for s in bases)


def load_file(
    path: CheckpointSource, *, verify: bool = False, max_bytes: int | None = None
) -> dict[str, np.ndarray]:
    """Read every name in ``path`` as its own numpy array.

    Aliases and copies come back as separate arrays with equal values; views as arrays
    with the view's values.

    Args:
        path: Any supported file (see the module docstring), or an open checkpoint.
        verify: Check every checksum first (weightvault files only record them).
        max_bytes: Most bytes the arrays may take. By default the larger of 256 MiB and
            16 times the file's size, so that a tiny hostile file whose aliases, copies
            or stride-0 views describe gigabytes is refused before anything is
            allocated; raise it for a trusted file that really expands that much.

    Raises:
        FormatError: The file is not a valid checkpoint, or would exceed ``max_bytes``.
        ChecksumError: ``verify`` and a tensor's bytes are damaged.

    Example:
        >>> arrays = load_file("model-0000.params")      # an MXNet file
        >>> arrays["arg:fc1_weight"].dtype
        dtype('float32')
    """
    with opened(path) as ckpt:
        names = ckpt.names
        ckpt.materializing(_cost(ckpt, names), f"reading {len(names)} arrays", max_bytes)
        if verify:
            ckpt.verify()
        bases: dict[str, memoryview] = {}
        return {name: _read(ckpt, ckpt.entry(name), bases) for name in names}


def load(
    arrays: MutableMapping[str, np.ndarray],
    path: CheckpointSource,
    *,
    strict: bool = True,
    rules: RulesArg = (),
    tie: bool = False,
    verify: bool = False,
    cast: bool = False,
) -> LoadReport:
    """Fill the arrays of ``arrays`` in place from ``path``, all or nothing.

    The dict plays the model: its names, dtypes and shapes are checked first, then values
    are copied into the existing arrays. Arrays that are one object under two names are
    tied.

    Args:
        arrays: ``{name: array}`` to fill; every array must be writable.
        path: Any supported file, or an open checkpoint.
        strict: Raise on missing, unexpected or mismatched names.
        rules: ``(pattern, replacement)`` renames of names on disk, or ``"auto"``.
        tie: Where the file ties names the dict holds apart, make them one array.
        verify: Check checksums of what is read first.
        cast: Allow dtypes to differ; values are converted.

    Returns:
        What was loaded, renamed, missing and unexpected.

    Example:
        >>> arrays = {"w": np.zeros((4, 4), np.float32)}
        >>> load(arrays, "w.safetensors").loaded
        ['w']
    """
    targets = []
    for name, a in arrays.items():
        targets.append(Target(name, id(a), _name_of(name, a), tuple(a.shape)))
    with opened(path) as ckpt:
        lp = plan_load(ckpt, targets, rules=rules, strict=strict, cast=cast, tie=tie)
        if verify:
            ckpt.verify(sorted({ckpt.entry(a.source).stored for a in lp.assignments}))
        bases: dict[str, memoryview] = {}
        values = [(a, _read(ckpt, ckpt.entry(a.source), bases)) for a in lp.assignments]
    for assignment, value in values:
        target = arrays[assignment.names[0]]
        np.copyto(target, value, casting="unsafe" if assignment.cast else "no")
    if tie:
        for keep, *others in lp.tie:
            for other in others:
                arrays[other] = arrays[keep]
    return lp.report


# -- the adapter contract (weightvault._adapters.Adapter), used by the vault --------------


def owns(obj: Any) -> bool:
    """Whether ``obj`` is a flat dict of numpy arrays."""
    return (
        isinstance(obj, Mapping)
        and bool(obj)
        and all(isinstance(v, np.ndarray) for v in obj.values())
    )


def sources(obj: Any) -> tuple[list[Source], list[str]]:
    """``(sources, skipped)`` of a dict of arrays, as :func:`save` would store them."""
    return [_source(k, v) for k, v in obj.items()], []


def checkpoint_sources(
    obj: Any,
    *,
    optimizer: Any = None,
    scheduler: Any = None,
    rng: bool = False,
    snapshot: SnapshotPool | None = None,
) -> tuple[list[Source], list[str], dict[str, Any] | None]:
    """Every value as a source, for the vault; copied now when ``snapshot`` is given.

    Raises:
        TypeError: ``optimizer``, ``scheduler`` or ``rng`` was given: weightvault.numpy has no
            training state to save.
    """
    if optimizer is not None or scheduler is not None or rng:
        raise TypeError(
            "weightvault.numpy: the vault saves no optimizer, scheduler or RNG state here; "
            "save the model alone, or keep the optimizer state in the tree you save"
        )
    found, skipped = sources(obj)
    if snapshot is not None:
        # Arrays can change in place after the call (numpy) or be replaced in the module
        # (NNX); a background save must write the values of the call.
        found = [s.copied() for s in found]
    return found, skipped, None
