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

from ._base.dtypes import numpy_dtype
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
from ._file.arrays import array_bytes, read_array
from ._file.checkpoint import CheckpointSource
from ._file.sharing import Source
from ._load.plan import LoadOptions, RulesArg, Target, plan_load
from ._load.steps import save_file, separate_cost, start_reading
from ._load.values import read_value, read_value_into
from ._numpy.sources import array_dtype, untrained_checkpoint_sources
from .formats._registry import opened

__all__ = ["load", "load_file", "save"]

#: The ``"format"`` written into ``__metadata__``.
FRAMEWORK = "np"


def dtype_of(name: str) -> Any:
    """The numpy dtype of a safetensors dtype name (``ml_dtypes`` for bfloat16, float8).

    Example:
        >>> dtype_of("BF16")
        dtype(bfloat16)
    """
    return numpy_dtype(name)


def _name_of(key: str, a: np.ndarray) -> str:
    return array_dtype(f"array {key!r}", a.dtype, ".astype(np.float32)")


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
        return Source(key, dtype, shape, identity, lambda: array_bytes(a))
    flat = root.reshape(-1).view(np.uint8)
    return Source(
        key,
        dtype,
        shape,
        identity,
        lambda: array_bytes(a),
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
    found = [_source(k, v) for k, v in arrays.items()]
    return save_file(path, (found, [], None), FRAMEWORK, metadata, checksum, dedupe_copies)


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
        start_reading(ckpt, separate_cost(ckpt), "arrays", max_bytes, verify)
        bases: dict[str, memoryview] = {}
        return {name: read_array(ckpt, ckpt.entry(name), bases) for name in ckpt.names}


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
    targets = [Target(n, id(a), _name_of(n, a), tuple(a.shape)) for n, a in arrays.items()]
    options = LoadOptions(rules=rules, strict=strict, cast=cast, tie=tie, verify=verify)
    with opened(path) as ckpt:
        lp = plan_load(ckpt, targets, options)
        # Every byte is reached (and with verify, checked) before the first copy; then
        # each value is read into its array in turn, so no second copy is ever held.
        ckpt.stage(lp.reads(), verify)
        bases: dict[str, memoryview] = {}
        for a in lp.assignments:
            if ckpt.unchanged(a.stored):
                continue  # a walk's previous checkpoint put these very bytes there
            out = arrays[a.names[0]]
            if not read_value_into(ckpt, a, out):
                value = read_value(ckpt, a, bases, lambda a: arrays[a.names[0]].dtype)
                np.copyto(out, value, casting="unsafe" if a.cast else "no")
    if tie:
        for keep, *others in lp.tie:
            for other in others:
                arrays[other] = arrays[keep]
    return lp.report


# -- the adapter contract (weightvault._vault.adapters.Adapter), used by the vault --------------


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


#: The vault's ``checkpoint_sources``: :func:`sources`, copied now for a background save.
checkpoint_sources = untrained_checkpoint_sources("weightvault.numpy", sources)
