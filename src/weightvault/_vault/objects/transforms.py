"""The two delta transforms: what a delta object holds instead of a tensor's bytes.

A delta stores ``raw`` as a function of its base's raw bytes ``base`` (the same tensor in
the parent checkpoint), so that what changed little becomes mostly zero bits:

- :data:`XOR`: ``raw ^ base``, byte by byte.
- :data:`DIFFERENCE`: per element of ``itemsize`` bytes, the integer difference
  ``raw - base`` (modulo 2**bits), zigzag-encoded (0, -1, 1, -2 ... become 0, 1, 2, 3 ...).
  A float that moved by a few units in the last place differs in a few low bits of its
  integer pattern even when a carry flips many bits of its XOR (``0x7fff`` to ``0x8000``
  is a difference of 1 but an XOR of 16 bits). On the trained weights of
  docs/benchmarks.md it compresses 3 to 11% better than XOR, so writers use it.

Both are exact for any bit pattern (NaNs, -0.0, integers): the delta is arithmetic on the
bits, never on values.

Example:
    >>> raw, base = bytes([5, 0, 0, 0]), bytes([3, 0, 0, 0])
    >>> d = make_delta(memoryview(raw), base, DIFFERENCE, 4)
    >>> out = bytearray(base)
    >>> apply_delta(memoryview(out), memoryview(d), DIFFERENCE, 4)
    >>> bytes(out) == raw
    True
"""

from __future__ import annotations

from typing import Any

from ..._base.errors import FormatError

__all__ = ["DIFFERENCE", "KINDS", "XOR", "apply_delta", "delta_kind", "make_delta"]

XOR = 1
DIFFERENCE = 2
KINDS = (XOR, DIFFERENCE)
_WIDTHS = {1: "8", 2: "16", 4: "32", 8: "64"}


def delta_kind(itemsize: int, nbytes: int) -> int:
    """The transform a writer uses for ``nbytes`` of ``itemsize``-byte elements."""
    return DIFFERENCE if itemsize in _WIDTHS and nbytes % itemsize == 0 else XOR


def _words(buf: Any, itemsize: int, signed: bool = False) -> Any:
    import numpy as np

    bits = _WIDTHS.get(itemsize)
    if bits is None or memoryview(buf).nbytes % itemsize:
        raise FormatError(f"a difference delta of {itemsize}-byte items does not fit its bytes")
    return np.frombuffer(buf, np.dtype(f"{'i' if signed else 'u'}{itemsize}"))


def make_delta(raw: memoryview, base: bytes | memoryview, kind: int, itemsize: int) -> bytearray:
    """The bytes a delta of ``kind`` stores for ``raw`` against ``base`` (same length)."""
    import numpy as np

    if kind == XOR:
        out = bytearray(raw)
        _xor(memoryview(out), base)
        return out
    out = bytearray(raw.nbytes)
    diff = _words(out, itemsize)
    # modulo 2**bits: unsigned arithmetic wraps
    np.subtract(_words(raw, itemsize), _words(base, itemsize), out=diff)
    signed = _words(out, itemsize, signed=True)
    sign = signed >> (8 * itemsize - 1)  # all ones for a negative difference
    np.left_shift(signed, 1, out=signed)
    np.bitwise_xor(signed, sign, out=signed)
    return out


def apply_delta(out: memoryview, delta: memoryview, kind: int, itemsize: int) -> None:
    """``out`` holds the base's bytes; make it hold the raw bytes the delta stands for.

    A writable ``delta`` is scratch: a difference is undone in place in it (a read-only
    one is copied first).
    """
    import numpy as np

    if kind == XOR:
        _xor(out, delta)
        return
    if kind != DIFFERENCE:
        raise FormatError(f"unknown delta kind {kind}; upgrade weightvault")
    zig = _words(delta if not delta.readonly else bytearray(delta), itemsize)
    target = _words(out, itemsize)
    if zig.size != target.size:
        raise FormatError(f"a delta of {zig.size} items for {target.size}")
    # Undone in slices that stay in the core's cache, into the delta's own memory and
    # one small mask: whole-block temporaries cost a fresh allocation, and its page
    # faults, per operation (the deepest chain of GPT-2 6 x 512 loaded in 2.8 s with
    # them, 2.3 s without; docs/benchmarks-log.md, section 20).
    mask = np.empty(min(zig.size, _SLICE), zig.dtype)
    for lo in range(0, zig.size, _SLICE):
        z, t = zig[lo : lo + _SLICE], target[lo : lo + _SLICE]
        m = mask[: z.size]
        np.bitwise_and(z, 1, out=m)
        np.negative(m, out=m)  # all ones where the difference is negative (modulo 2**bits)
        np.right_shift(z, 1, out=z)
        np.bitwise_xor(z, m, out=z)
        np.add(t, z, out=t)


#: Items undone at once by :func:`apply_delta` (256 KiB of 4-byte words).
_SLICE = 1 << 16


def _xor(out: memoryview, other: bytes | memoryview) -> None:
    import numpy as np

    a = np.frombuffer(out, np.uint8)
    b = np.frombuffer(other, np.uint8)
    if a.size % 8 == 0:  # as wide words where they line up: several times faster
        a, b = a.view(np.uint64), b.view(np.uint64)
    np.bitwise_xor(a, b, out=a)
