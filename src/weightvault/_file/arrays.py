"""Decode stored bytes to numbers with numpy, for diffs; numpy is optional here."""

from __future__ import annotations

from typing import Any

from .._base.dtypes import numpy_dtype
from .checkpoint import Checkpoint


def _f8_table(np: Any, exp_bits: int, man_bits: int, bias: int, fn: bool, uz: bool = False) -> Any:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes >> 7, -1.0, 1.0)
    e = (codes >> man_bits) & ((1 << exp_bits) - 1)
    m = codes & ((1 << man_bits) - 1)
    normal = (1 + m / (1 << man_bits)) * np.exp2(e - bias)
    sub = (m / (1 << man_bits)) * np.exp2(1 - bias)
    out = sign * np.where(e == 0, sub, normal)
    top = (1 << exp_bits) - 1
    if uz:  # FNUZ: no infinities, no negative zero; 0x80 is the only NaN
        out[128] = np.nan
    elif fn:  # E4M3FN: no infinities, only S.1111.111 is NaN
        out[(e == top) & (m == (1 << man_bits) - 1)] = np.nan
    else:
        out[(e == top) & (m == 0)] *= np.inf
        out[(e == top) & (m != 0)] = np.nan
    return out


def as_numpy(ckpt: Checkpoint, name: str) -> Any:
    """The values of ``name`` as a numpy array (float64 for 8/16-bit floats)."""
    import numpy as np

    e = ckpt.entry(name)
    raw = np.frombuffer(ckpt.raw(e.stored), dtype=np.uint8)
    if e.view is not None:
        v = e.view
        raw = raw[v.offset : v.offset + v.span()]
    dtype = e.dtype
    if dtype == "BF16":
        flat = (raw.view("<u2").astype(np.uint32) << 16).view("<f4").astype(np.float64)
    elif dtype == "F8_E4M3":
        flat = _f8_table(np, 4, 3, 7, True)[raw]
    elif dtype == "F8_E5M2":
        flat = _f8_table(np, 5, 2, 15, False)[raw]
    elif dtype == "F8_E4M3FNUZ":
        flat = _f8_table(np, 4, 3, 8, True, uz=True)[raw]
    elif dtype == "F8_E5M2FNUZ":
        flat = _f8_table(np, 5, 2, 16, True, uz=True)[raw]
    elif dtype == "F8_E8M0":
        flat = np.where(raw == 255, np.nan, np.exp2(raw.astype(np.float64) - 127))
    else:
        flat = raw.view(numpy_dtype(dtype))
    if e.view is None:
        return flat.reshape(e.shape)
    item = flat.itemsize
    strides = tuple(s * item for s in e.view.stride)
    if flat.size == 0:
        return flat.reshape(e.shape)
    return np.lib.stride_tricks.as_strided(flat, e.shape, strides, writeable=False)
