"""The dtypes weightvault stores, by their safetensors names.

The core works on raw bytes, so a dtype is only a name and an item size here; the
adapters map names to framework dtypes.
"""

from __future__ import annotations

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


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name (``KeyError`` if unknown)."""
    return ITEMSIZE[dtype]


def numel(shape: tuple[int, ...] | list[int]) -> int:
    """Number of elements of ``shape``; ``1`` for a 0-d tensor."""
    n = 1
    for dim in shape:
        n *= dim
    return n


def describe(dtype: str, shape: tuple[int, ...] | list[int]) -> str:
    """Short form used in messages, such as ``F32[2048, 2048]``."""
    return f"{dtype}[{', '.join(str(d) for d in shape)}]"
