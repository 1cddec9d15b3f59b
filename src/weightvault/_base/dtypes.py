"""Dtypes and tensor geometry: the one table of dtypes, and the arithmetic on shapes.

The core works on raw bytes, so a dtype is a safetensors name, an item size and the name
frameworks give it. Every adapter and reader resolves its own dtype objects from
:data:`FRAMEWORK_NAMES` (``getattr(torch, ...)``, ``np.dtype(...)``, ``ml_dtypes``),
so they cannot disagree about which dtypes exist. Shape limits, byte spans and
contiguity are computed here and nowhere else.
"""

from __future__ import annotations

from typing import Any

from .errors import BackendNotInstalled, UnsupportedDtypeError

#: safetensors dtype name -> bytes per element. Sub-byte types (F4, F6) are not supported.
ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}

#: safetensors dtype name -> the dtype's name in numpy/ml_dtypes, torch and Keras, which
#: agree (``torch.float8_e4m3fn``, ``ml_dtypes.float8_e4m3fn``, Keras ``"float8_e4m3fn"``).
FRAMEWORK_NAMES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "C64": "complex64",
}
#: Framework dtype name -> safetensors dtype name.
BY_FRAMEWORK_NAME: dict[str, str] = {v: k for k, v in FRAMEWORK_NAMES.items()}
#: Dtypes numpy has itself; the others (bfloat16, float8) come from ``ml_dtypes``.
NUMPY_NATIVE = frozenset(
    {"BOOL", "U8", "I8", "I16", "U16", "F16", "I32", "U32", "F32", "I64", "U64", "F64", "C64"}
)

#: The most dimensions a tensor read from any file may have.
MAX_DIMS = 64
#: The largest byte extent frameworks can address (int64).
MAX_EXTENT = (1 << 63) - 1


def numpy_dtype(name: str) -> Any:
    """The little-endian numpy dtype of a safetensors dtype name.

    Raises:
        BackendNotInstalled: ``name`` needs ``ml_dtypes`` (bfloat16, float8), which is
            not installed.
        KeyError: ``name`` is not a safetensors dtype.

    Example:
        >>> numpy_dtype("F32")
        dtype('float32')
    """
    import numpy as np

    if name in NUMPY_NATIVE:
        return np.dtype(FRAMEWORK_NAMES[name]).newbyteorder("<")
    try:
        import ml_dtypes
    except ImportError as e:
        raise BackendNotInstalled(
            f"{name} arrays need ml_dtypes: pip install 'weightvault[formats]'"
        ) from e
    return np.dtype(getattr(ml_dtypes, FRAMEWORK_NAMES[name]))


def unsupported(what: str, dtype: object, fix: str) -> UnsupportedDtypeError:
    """The error for a value whose dtype safetensors cannot store.

    Args:
        what: The value, such as ``"tensor 'w'"``.
        dtype: Its dtype, as the framework prints it.
        fix: How to convert it, such as ``".to(torch.float32)"``.
    """
    return UnsupportedDtypeError(
        f"{what} has dtype {dtype}, which safetensors cannot store; convert it first, "
        f"for example with {fix}. Supported: {', '.join(FRAMEWORK_NAMES.values())}"
    )


def numel(shape: tuple[int, ...] | list[int]) -> int:
    """Number of elements of ``shape``; ``1`` for a 0-d tensor."""
    n = 1
    for dim in shape:
        n *= dim
    return n


def span(dtype: str, shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Bytes from a strided tensor's first element to one past its last (0 when empty)."""
    if numel(shape) == 0:
        return 0
    last = sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    return (last + 1) * ITEMSIZE[dtype]


def contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` (in elements) lays ``shape`` out C-contiguously.

    Dimensions of size 1 may have any stride, as in torch.
    """
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride), strict=True):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def fits_int64(shape: list[int] | tuple[int, ...], itemsize: int) -> bool:
    """Whether frameworks can hold ``shape``: its size, zeros ignored, fits in int64 bytes.

    A zero-size tensor with huge other dimensions needs no bytes, but frameworks still
    compute its strides and overflow; refusing it keeps that a FormatError.
    """
    n = itemsize
    for d in shape:
        n *= max(d, 1)
    return n <= MAX_EXTENT


def describe(dtype: str, shape: tuple[int, ...] | list[int]) -> str:
    """Short form used in messages, such as ``F32[2048, 2048]``."""
    return f"{dtype}[{', '.join(str(d) for d in shape)}]"
