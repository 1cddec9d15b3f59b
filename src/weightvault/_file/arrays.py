"""Stored bytes as numpy arrays and back: the one decoder of stored tensors and views.

Every numpy-backed reader (``weightvault.numpy``, ``.jax``, ``.keras``, the load plan's
comparison of two views, ``inspect``'s diff) turns a name's bytes into an array here, so a
stored tensor, an alias, a copy and a strided view of a bfloat16 or float8 tensor decode
the same way everywhere. The torch adapter builds torch tensors over the same bytes
itself (:mod:`weightvault._torch.tensors`), since numpy cannot hand them to torch without
a copy for those dtypes.

Importing this module needs numpy; bfloat16 and float8 arrays need ``ml_dtypes`` too
(their diffs in :func:`as_numpy` do not).

Example:
    >>> with SafetensorsFile("views.safetensors") as ckpt:
    ...     read_array(ckpt, ckpt.entry("lm_head.weight.T"), {}).flags.c_contiguous
    True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._base.dtypes import BY_FRAMEWORK_NAME, ITEMSIZE, numpy_dtype
from .checkpoint import Checkpoint, Entry


def _words(data: Any, e: Entry) -> Any:
    """The elements of ``e`` as unsigned integers of the dtype's width, over ``data``.

    ``data`` holds the bytes of ``e``'s stored tensor. Nothing is copied: a view is
    strided over them, read-only if ``data`` is. The stride runs over plain integers
    because ``as_strided`` goes through ``__array_interface__``, which loses ``ml_dtypes``'
    types (an ``F8_E5M2`` view raised ``TypeError``); callers reinterpret the words.
    """
    word = np.dtype(f"<u{ITEMSIZE[e.dtype]}")
    raw = np.frombuffer(data, dtype=np.uint8)
    v = e.view
    if v is None:
        return raw.view(word).reshape(e.shape)
    if v.span() == 0:
        return np.empty(v.shape, dtype=word)
    flat = raw[v.offset : v.offset + v.span()].view(word)
    strides = tuple(s * word.itemsize for s in v.stride)
    return np.lib.stride_tricks.as_strided(flat, v.shape, strides)


def entry_array(e: Entry, data: Any) -> Any:
    """The values of ``e`` as an array of its dtype over ``data``, without a copy.

    Args:
        e: A name of the checkpoint (stored, alias, copy or view).
        data: The bytes of ``e.stored``: a mapping (zero-copy) or a private copy.

    Example:
        >>> base = ckpt.read(ckpt.entry("h.0.w.T").stored)
        >>> entry_array(ckpt.entry("h.0.w.T"), base).shape
        (16, 4)
    """
    return _words(data, e).view(numpy_dtype(e.dtype))


def read_array(ckpt: Checkpoint, e: Entry, bases: dict[str, memoryview]) -> Any:
    """A fresh C-contiguous array holding the values of ``e``; the caller owns it.

    Bytes are read with ``preadv``, not through a mapping, so a file truncated meanwhile
    is a :class:`~weightvault.FormatError` instead of a ``SIGBUS``.

    Args:
        ckpt: The open checkpoint.
        e: The name to read.
        bases: Stored tensors already read for views, by name; each is read once and
            kept here for the next view of it.
    """
    if e.view is None:
        return read_stored(ckpt, e.stored)
    if e.stored not in bases:
        bases[e.stored] = ckpt.read(e.stored)
    return np.ascontiguousarray(entry_array(e, bases[e.stored]))


def read_stored(ckpt: Checkpoint, stored: str) -> Any:
    """A fresh array of the stored tensor ``stored`` (internal ones too), read with
    ``preadv``; the caller owns it."""
    info = ckpt.stored[stored]
    out = np.empty(info.shape, dtype=numpy_dtype(info.dtype))
    flat = out.reshape(-1).view(np.uint8)
    if flat.nbytes and not ckpt.read_into(stored, flat.data):
        flat[:] = np.frombuffer(ckpt.raw(stored), dtype=np.uint8)
    return out


def same_values(ckpt: Checkpoint, a: Entry, b: Entry) -> bool:
    """Whether two names hold the same dtype, shape and bits (views included).

    Bits, not numbers: a NaN equals itself, and ``-0.0`` differs from ``0.0``.
    """
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        return False
    return bool(np.array_equal(_words(ckpt.raw(a.stored), a), _words(ckpt.raw(b.stored), b)))


def dtype_name(dtype: Any) -> str | None:
    """The safetensors name of a numpy or ``ml_dtypes`` dtype (either byte order), or
    ``None`` if safetensors has none.

    Example:
        >>> dtype_name(np.dtype(">f4")), dtype_name(ml_dtypes.bfloat16), dtype_name(object)
        ('F32', 'BF16', None)
    """
    try:
        return BY_FRAMEWORK_NAME.get(np.dtype(dtype).name)
    except TypeError:  # no numpy dtype at all, such as a JAX PRNG key's
        return None


def array_bytes(a: Any) -> memoryview:
    """The bytes of array ``a`` as safetensors stores them: C order, little-endian."""
    if a.size == 0:
        return memoryview(b"")
    c = np.ascontiguousarray(a)
    if c.dtype.byteorder == ">":
        c = c.astype(c.dtype.newbyteorder("<"))
    out: memoryview = c.reshape(-1).view(np.uint8).data
    return out


def _f8_table(exp_bits: int, man_bits: int, bias: int, fn: bool, uz: bool = False) -> Any:
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


#: Float8 layouts as ``(exponent bits, mantissa bits, bias, finite-only, unsigned zero)``.
_F8 = {
    "F8_E4M3": (4, 3, 7, True, False),
    "F8_E5M2": (5, 2, 15, False, False),
    "F8_E4M3FNUZ": (4, 3, 8, True, True),
    "F8_E5M2FNUZ": (5, 2, 16, True, True),
}


def as_numpy(ckpt: Checkpoint, name: str) -> Any:
    """The values of ``name`` for a diff: float64 for 8- and 16-bit floats, needing no
    ``ml_dtypes``; other dtypes as themselves.
    """
    e = ckpt.entry(name)
    words = _words(ckpt.raw(e.stored), e)
    if e.dtype == "BF16":
        return (words.astype(np.uint32) << 16).view("<f4").astype(np.float64)
    if e.dtype in _F8:
        return _f8_table(*_F8[e.dtype])[words]
    if e.dtype == "F8_E8M0":
        return np.where(words == 255, np.nan, np.exp2(words.astype(np.float64) - 127))
    return words.view(numpy_dtype(e.dtype))
