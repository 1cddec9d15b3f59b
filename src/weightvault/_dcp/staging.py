"""Writing a rank's chunks with at most ``staging_bytes`` of host memory held for them.

An asynchronous save must copy what it has not written yet before the caller may change
the tensors again; copying the whole state (DCP's stager) costs host memory equal to
the state (radixark Megatron #61 ran out of it). With a budget ``N``, the chunks are
written in waves: the last wave, the largest chunks that fit in ``N`` together, is copied
into one host buffer; every earlier wave is written while the caller still waits, from
the tensors themselves where they are contiguous CPU memory, else through a buffer of at
most ``N`` (a chunk larger than ``N`` that needs a copy gets a buffer of its own size).
Once the last wave is copied, the caller goes on, and that wave is written from the copy.

Example:
    >>> earlier, last = waves({0: 6000, 1: 3000, 2: 3000, 3: 1000}, budget=6400)
    >>> last, earlier
    ([0], [[1, 2], [3]])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._torch.tensors import tensor_bytes
from .ranged import host_bytes

__all__ = ["ALIGN", "stage", "wave_bytes", "waves"]

#: Chunks start at multiples of this in a staging buffer (every dtype's alignment).
ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def waves(sizes: Mapping[int, int], budget: int) -> tuple[list[list[int]], list[int]]:
    """Earlier waves (each at most ``budget`` bytes, or one larger chunk), and the last.

    The last wave takes the largest chunks that fit in ``budget`` together (aligned as a
    staging buffer lays them out), so the caller waits for as few bytes as possible.
    """
    last: list[int] = []
    used = 0
    for i in sorted(sizes, key=lambda i: (-sizes[i], i)):
        if used + _aligned(sizes[i]) <= budget:
            last.append(i)
            used += _aligned(sizes[i])
    earlier: list[list[int]] = []
    wave: list[int] = []
    filled = 0
    for i in sorted(set(sizes) - set(last)):
        if wave and filled + _aligned(sizes[i]) > budget:
            earlier.append(wave)
            wave, filled = [], 0
        wave.append(i)
        filled += _aligned(sizes[i])
    if wave:
        earlier.append(wave)
    return earlier, sorted(last)


def stage(
    tensors: Mapping[int, torch.Tensor], which: list[int], *, copy_all: bool
) -> tuple[dict[int, memoryview], Any]:
    """The bytes of chunks ``which``: contiguous CPU tensors as they are (unless
    ``copy_all``), the others copied into one host buffer, returned to keep it alive."""
    direct = {} if copy_all else {i: host_bytes(tensors[i]) for i in which}
    copied = [i for i in which if direct.get(i) is None and tensors[i].numel() > 0]
    total = sum(_aligned(tensors[i].numel() * tensors[i].element_size()) for i in copied)
    buffer = torch.empty(total, dtype=torch.uint8)
    out: dict[int, memoryview] = {}
    offset = 0
    for i in which:
        t = tensors[i]
        view = direct.get(i)
        if view is not None:
            out[i] = view
        elif t.numel() == 0:
            out[i] = tensor_bytes(t)
        else:
            n = t.numel() * t.element_size()
            dst = buffer[offset : offset + n].view(t.dtype).view(t.shape)
            dst.copy_(t.detach())
            out[i] = memoryview(buffer[offset : offset + n].numpy()).cast("B")  # type: ignore[arg-type]
            offset += _aligned(n)
    return out, buffer


def wave_bytes(
    tensors: Mapping[int, torch.Tensor],
    budget: int,
    write: Callable[[dict[int, memoryview], bool], None],
    staged: Callable[[], None],
) -> None:
    """Write ``tensors`` in waves of at most ``budget`` bytes; call ``staged`` once every
    byte still to write is copied (see the module docstring).

    Args:
        tensors: This rank's chunks, by item.
        budget: Host bytes to hold for them at once.
        write: Writes one wave's bytes; its flag says whether it is the last wave.
        staged: Tells the caller it may change the tensors again.
    """
    sizes = {i: t.numel() * t.element_size() for i, t in tensors.items()}
    earlier, last = waves(sizes, budget)
    for wave in earlier:
        chunks, _buffer = stage(tensors, wave, copy_all=False)
        write(chunks, False)
        del chunks, _buffer  # before the next wave's buffer
    chunks, _buffer = stage(tensors, last, copy_all=True)
    staged()
    write(chunks, True)
