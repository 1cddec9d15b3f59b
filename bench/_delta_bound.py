"""How few bits a lossless delta between two trained checkpoints can take (bench_compress.py
``bound``).

A stored delta is, per fp32 weight, ``d = zigzag(new - old)`` on the words' bits (the
frame's kind 2). Write ``d``'s bit length as ``L`` (0 when the weight did not move). The
``L - 1`` bits below ``d``'s leading one are where the update's noise lives. This module
measures, on the deltas of a really trained run:

- ``H(L, top)``: the empirical entropy of ``L`` together with the ``TOP`` bits just below
  the leading one (a plug-in estimate over millions of weights and at most
  ``33 * 2**TOP`` symbols, so it is close);
- how random the remaining low bits are: the smallest per-bit entropy among them,
  measured bit position by bit position (1.0 is a fair coin);
- the estimate ``H(L, top) + E[max(L - 1 - TOP, 0)]`` bits per weight, as a fraction of 32.

A weight whose delta is longer than ``WIDE`` bits (its sign flipped, or it crossed many
exponents: under 1% of them on this run) is a different kind of change; its low bits are
not counted at all, which only lowers the estimate. If the low bits of the others are
fair coins (they measure at 0.99+), no lossless coder that codes weights one by one can
spend fewer bits than this estimate, whatever its model of ``L``.
A coder may model ``L`` from what the reader already has: ``fraction_with_context`` is the
estimate given the base's exponent and the previous difference's bit length, and
``fraction_length_free`` what would remain were every ``L`` known for free. The ratio
floor of a run follows from them.
"""

from __future__ import annotations

import math

import numpy as np

#: Bits below the leading one that are modelled jointly with the bit length.
TOP = 4
#: Deltas longer than this are counted by their leading bits only (see above).
WIDE = 24


def bits(d: np.ndarray) -> np.ndarray:
    """Bit length of each unsigned word (0 for 0)."""
    out = np.zeros(d.shape, np.int64)
    x = d.astype(np.uint64)
    for shift in (32, 16, 8, 4, 2, 1):
        big = x >= (np.uint64(1) << np.uint64(shift))
        out[big] += shift
        x = np.where(big, x >> np.uint64(shift), x)
    return out + (x > 0)


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def _conditional(symbol: np.ndarray, context: np.ndarray) -> float:
    """Plug-in ``H(symbol | context)``: ``H(symbol, context) - H(context)``."""
    joint = context.astype(np.int64) * (int(symbol.max()) + 1) + symbol
    return _entropy(np.unique(joint, return_counts=True)[1]) - _entropy(
        np.unique(context, return_counts=True)[1]
    )


def context_of(base: bytes, previous: bytes | None) -> np.ndarray:
    """What a reader of a delta already knows about each weight: the base's exponent and
    the bit length of the difference before (when there is one)."""
    exponent = (np.frombuffer(base, "<u4") >> 23).astype(np.int64) & 0xFF
    if previous is None:
        return exponent
    return exponent * 64 + bits(np.frombuffer(previous, "<u4").astype(np.uint64))


def analyse(delta: bytes, wide: int = WIDE, context: np.ndarray | None = None) -> dict[str, float]:
    """The estimate for one buffer of kind-2 fp32 deltas (little-endian uint32 words); for
    a full tensor, pass its magnitudes and ``wide=32`` (every bit counts). With
    ``context`` (one int per weight, see :func:`context_of`), the head's entropy is also
    measured given it."""
    d = np.frombuffer(delta, "<u4").astype(np.uint64)
    length = bits(d)
    below = np.maximum(length - 1, 0)
    top_bits = np.minimum(below, TOP)
    shift = (below - top_bits).astype(np.uint64)
    top = (d >> shift) & ((np.uint64(1) << top_bits.astype(np.uint64)) - np.uint64(1))
    symbol = length * (1 << TOP) + top.astype(np.int64)
    head = _entropy(np.bincount(symbol))
    rest = np.where(length > wide, 0, np.maximum(below - TOP, 0))
    # Each low bit position, among the weights that have it: how close to a fair coin.
    fairness = 1.0
    for j in range(0, 28):
        has = rest > j
        if has.sum() < 10_000:
            break
        p = float(((d[has] >> np.uint64(j)) & np.uint64(1)).mean())
        h = 0.0 if p in (0.0, 1.0) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
        fairness = min(fairness, h)
    per_weight = head + float(rest.mean())
    given = _conditional(symbol, context) if context is not None else head
    # Were each weight's bit length known for free, the bits below it would remain.
    length_free = head - _entropy(np.bincount(length)) + float(rest.mean())
    return {
        "fraction_with_context": (given + float(rest.mean())) / 32,
        "fraction_length_free": length_free / 32,
        "mean_bit_length": float(length.mean()),
        "wide_share": float((length > wide).mean()),
        "head_entropy_bits": head,
        "low_bits_min_entropy": fairness,
        "bits_per_weight": per_weight,
        "fraction": per_weight / 32,
    }
