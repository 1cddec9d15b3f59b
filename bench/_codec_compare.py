"""The codec comparison of bench_compress.py: numpy byte planes + ``zstandard`` against
blosc2 (its C shuffle + zstd), on the tensors of really trained checkpoints.

Each contender compresses the same buffers in 4 MiB blocks on ONE thread (per-core
speed), splitting each block into byte planes by the dtype's item size, and must give
back the exact bytes. Contenders alternate within each round; the minimum time counts.
Time is the calling thread's CPU time (``time.thread_time``): every contender runs on
that one thread, so this is per-core speed, and other jobs on a shared machine do not
count against it (wall-clock speeds are reported beside it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

BLOCK = 4 << 20

Compress = Callable[[bytes, int], list[bytes]]
Decompress = Callable[[list[bytes], int, int], bytearray]


def _blocks(data: bytes) -> list[bytes]:
    return [data[i : i + BLOCK] for i in range(0, len(data), BLOCK)]


def zstd_planes(level: int) -> tuple[Compress, Decompress]:
    """numpy splits each block into planes (a transpose), zstandard compresses them."""
    import zstandard

    comp = zstandard.ZstdCompressor(level=level)
    dec = zstandard.ZstdDecompressor()

    def c(data: bytes, k: int) -> list[bytes]:
        return [
            comp.compress(np.frombuffer(b, np.uint8).reshape(-1, k).T.copy()) for b in _blocks(data)
        ]

    def d(blocks: list[bytes], k: int, n: int) -> bytearray:
        out = bytearray(n)
        flat = np.frombuffer(out, np.uint8)
        pos = 0
        for b in blocks:
            planes = np.frombuffer(dec.decompress(b), np.uint8)
            m = planes.size
            flat[pos : pos + m].reshape(-1, k)[:] = planes.reshape(k, -1).T
            pos += m
        return out

    return c, d


def zstd_tuned() -> tuple[Compress, Decompress]:
    """numpy planes; each plane through a zstd tuned for speed (``strategy=fast``, a small
    hash table, no search), or kept raw when that saves under 3% (the noise planes)."""
    import zstandard

    params = zstandard.ZstdCompressionParameters(
        window_log=17, hash_log=10, chain_log=10, search_log=1, min_match=7,
        target_length=0, strategy=zstandard.STRATEGY_FAST,
    )  # fmt: skip
    comp = zstandard.ZstdCompressor(compression_params=params)
    dec = zstandard.ZstdDecompressor()

    def c(data: bytes, k: int) -> list[bytes]:
        out = []
        for b in _blocks(data):
            for plane in np.frombuffer(b, np.uint8).reshape(-1, k).T.copy():
                z = comp.compress(plane)
                out.append(z if len(z) < 0.97 * plane.size else plane.tobytes())
        return out

    def d(blocks: list[bytes], k: int, n: int) -> bytearray:
        out = bytearray(n)
        flat = np.frombuffer(out, np.uint8)
        parts = iter(blocks)
        for lo in range(0, n, BLOCK):
            view = flat[lo : min(n, lo + BLOCK)].reshape(-1, k)
            m = view.shape[0]
            for j in range(k):
                z = next(parts)
                raw = z if len(z) == m else dec.decompress(z, max_output_size=m)
                view[:, j] = np.frombuffer(raw, np.uint8)
        return out

    return c, d


def blosc2_shuffle(level: int) -> tuple[Compress, Decompress]:
    """blosc2's SHUFFLE filter splits the planes (SIMD, in C), then zstd."""
    import blosc2

    def c(data: bytes, k: int) -> list[bytes]:
        return [
            blosc2.compress2(
                b, typesize=k, clevel=level, codec=blosc2.Codec.ZSTD,
                filters=[blosc2.Filter.SHUFFLE], nthreads=1,
            )
            for b in _blocks(data)
        ]  # fmt: skip

    def d(blocks: list[bytes], k: int, n: int) -> bytearray:
        out = bytearray(n)
        view = memoryview(out)
        pos = 0
        for b in blocks:
            m = blosc2.get_cbuffer_sizes(b)[0]
            blosc2.decompress2(b, dst=view[pos : pos + m], nthreads=1)
            pos += m
        return out

    return c, d


def contenders() -> dict[str, tuple[Compress, Decompress]]:
    out = {}
    for level in (1, 3):
        with contextlib.suppress(ImportError):  # zstandard is the bench's, not weightvault's
            out[f"numpy planes + zstandard {level}"] = zstd_planes(level)
        out[f"blosc2 shuffle + zstd {level}"] = blosc2_shuffle(level)
    with contextlib.suppress(ImportError):
        out["numpy planes + tuned zstandard"] = zstd_tuned()
    return out


def plane_entropy(data: bytes, k: int) -> float:
    """The order-0 entropy of each byte plane, summed, as a fraction of the raw size: the
    least any coder that codes each plane's bytes independently can reach (zstd on byte
    planes is such a coder, up to the few repeats it finds)."""
    planes = np.frombuffer(data, np.uint8).reshape(-1, k)
    bits = 0.0
    for i in range(k):
        counts = np.bincount(planes[:, i], minlength=256)
        p = counts[counts > 0] / planes.shape[0]
        bits += float(-(p * np.log2(p)).sum())
    return bits / (8 * k)


def compare(data: dict[str, tuple[bytes, int]], rounds: int) -> list[dict[str, Any]]:
    """Ratio and one-core compress/decompress GB/s of every contender on every buffer."""
    rows = []
    every = contenders()
    for label, (buf, k) in data.items():
        times: dict[str, list[tuple[float, float]]] = {n: [] for n in every}
        walls: dict[str, list[tuple[float, float]]] = {n: [] for n in every}
        sizes: dict[str, int] = {}
        names = list(every)
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                c, d = every[name]
                t0, w0 = time.thread_time(), time.perf_counter()
                blocks = c(buf, k)
                t1, w1 = time.thread_time(), time.perf_counter()
                back = d(blocks, k, len(buf))
                t2, w2 = time.thread_time(), time.perf_counter()
                assert bytes(back) == buf, name
                times[name].append((t1 - t0, t2 - t1))
                walls[name].append((w1 - w0, w2 - w1))
                sizes[name] = sum(len(b) for b in blocks)
        bound = plane_entropy(buf, k)
        for name in names:
            rows.append({
                "tensors": label, "codec": name, "mb": len(buf) / 1e6, "plane_bound": bound,
                "ratio": sizes[name] / len(buf),
                "compress_gbs": len(buf) / min(t for t, _ in times[name]) / 1e9,
                "decompress_gbs": len(buf) / min(t for _, t in times[name]) / 1e9,
                "compress_gbs_wall": len(buf) / min(t for t, _ in walls[name]) / 1e9,
                "decompress_gbs_wall": len(buf) / min(t for _, t in walls[name]) / 1e9,
            })  # fmt: skip
    return rows
