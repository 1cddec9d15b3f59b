"""Lossless compression of one block of an object: byte planes, then zstd (through blosc2).

A float's bytes differ in kind: the sign and exponent byte of trained weights takes few
values, the low mantissa bytes are close to noise. Grouping byte ``i`` of every element
into plane ``i`` (blosc2's ``SHUFFLE`` filter, with the dtype's item size) puts alike
bytes together, and zstd then squeezes the exponent planes and leaves the noise as it is.
blosc2 does the shuffle in C (SIMD); docs/benchmarks.md (section "Compressed objects")
has the comparison with numpy planes + ``zstandard`` that chose it. python-blosc2 holds
the GIL while it (de)compresses unless told otherwise, so both calls here tell it to
release it while they run (:class:`_ReleasedGil`, which puts the caller's setting back
after the last one): the save's threads then compress small objects side by side and
write others meanwhile (measured on two cores: the 156 objects of a 13 MB GPT-2 and its AdamW
state, delta + compress, in 39 ms on six threads against 69 ms holding the GIL). A
block of 1 MiB or more is also split over blosc2's own C threads, one per core
(:data:`THREADS`): on two cores, alone, 1.6x faster than one thread; a save of GPT-2
small took 1.13 s against 1.20 s. Decoding
stays on one blosc2 thread per call: alone it is 3.4x faster on two, but inside a load
(whose own threads overlap reads, checks and copies) one thread measured faster (10.3 ms
against 12.4 ms for the 13 MB model of docs/benchmarks-log.md section 11); without the GIL,
the load's threads decode on every core.

Decoding calls C-Blosc2's library directly where it can (:mod:`.blosc2_c`), so a resume
in a new process does not import python-blosc2 (about 0.2 s beside torch), and falls back
to python-blosc2 elsewhere; compression always goes through python-blosc2.

Decoding is bounded: a block is decompressed only into a buffer of the size the frame
and the checkpoint record agree on, and only after blosc2's own header says exactly that
size (python-blosc2's ``decompress2`` trusts that header for the destination's size, so
the check here is what keeps a lying block from writing past the buffer).

Example:
    >>> data = memoryview(bytes(4096))
    >>> packed = compress_block(CODECS["blosc2"], data, 4)
    >>> out = bytearray(4096)
    >>> decompress_block(CODECS["blosc2"].id, packed, memoryview(out), 4)
    >>> bytes(out) == bytes(data)
    True
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..._base.errors import BackendNotInstalled
from ..._base.pools import LazyPool
from .blosc2_c import decoder

__all__ = [
    "BLOCK",
    "CODECS",
    "DEFAULT",
    "DELTAS",
    "READABLE",
    "STORED",
    "THREADS",
    "Codec",
    "codec_named",
    "codec_pool",
    "compress_block",
    "decompress_block",
    "preload",
]

#: Raw bytes per block: blocks compress independently, on all cores, and a ranged read
#: (a DCP box) decodes only the blocks it covers.
BLOCK = 4 << 20
#: blosc2's C threads per call: every core (see the module docstring).
THREADS = max(1, min(os.cpu_count() or 1, 16))
#: blosc2 refuses buffers of 2 GiB or more; blocks stay far below.
_BLOSC_MAX_OVERHEAD = 32


@dataclass(frozen=True)
class Codec:
    """One way to compress blocks.

    Attributes:
        name: What ``Vault(compression=...)`` accepts.
        id: The byte an object frame records (see :mod:`.frame`); never reused.
        level: The compression level (zstd's).
    """

    name: str
    id: int
    level: int


#: Blocks kept as they are (id 0); written only for raw bytes that look like a frame.
STORED = Codec("stored", 0, 0)
#: The codecs ``Vault(compression=...)`` names; every id here can be read.
CODECS = {"blosc2": Codec("blosc2", 1, 1)}
DEFAULT = "blosc2"
#: What the compactor codes the words of a delta with (id 2): pcodec, an entropy coder
#: for numbers. It codes each difference's bit length and sends the bits below as they
#: are, which is what the noise of a trained update leaves to a lossless coder: on the
#: lm run's zigzag differences 0.548 of raw at lr 3e-5 and 0.697 at lr 1e-3, where
#: blosc2 takes 0.571 and 0.709, and it decodes at 2.3 GB/s on one core against
#: blosc2's 1.0-1.5 (docs/benchmarks-log.md, section 18). Level 8, its strongest: a level 4
#: block was 0.573. Only for 2-, 4- and 8-byte words, which pcodec reads as unsigned
#: integers; other deltas stay on blosc2.
DELTAS = Codec("pcodec", 2, 8)
#: Every codec id a reader decodes.
READABLE = frozenset({STORED.id, *(c.id for c in CODECS.values()), DELTAS.id})
#: numpy's names of the unsigned words pcodec codes, by item size.
_WORDS = {2: "<u2", 4: "<u4", 8: "<u8"}


def _threads(nbytes: int) -> int:
    """blosc2 threads for a block of ``nbytes``: starting them costs more than a small
    block takes on one core."""
    return THREADS if nbytes >= _PARALLEL_BYTES else 1


#: Blocks at least this large are split over :data:`THREADS`.
_PARALLEL_BYTES = 1 << 20


def delta_codec(codec: Codec, itemsize: int, nbytes: int) -> Codec:
    """The codec for a delta payload of ``nbytes`` in words of ``itemsize`` bytes, in a
    vault that compresses with ``codec``: :data:`DELTAS` for whole 2-, 4- and 8-byte
    words, else ``codec`` itself."""
    if codec.id == STORED.id or itemsize not in _WORDS or nbytes % itemsize:
        return codec
    return DELTAS


def codec_named(name: str | None, where: str) -> Codec | None:
    """The codec ``Vault(compression=name)`` asks for; ``None`` keeps objects raw.

    Raises:
        ValueError: No codec has that name.
    """
    if name is None:
        return None
    if name not in CODECS:
        raise ValueError(
            f"{where}: unknown compression {name!r}; use one of {sorted(CODECS)} or None"
        )
    return CODECS[name]


#: Threads that (de)compress blocks and read objects, one per core; they never wait on
#: other work.
codec_pool = LazyPool(os.cpu_count() or 1, "weightvault-codec")


def preload() -> None:
    """Import python-blosc2 now, in the calling thread, leaving Python's ``random`` as it
    was.

    Its first import draws from ``random``. Left to the compactor, it happens in the
    compactor's thread after a save, and what training draws from then on (a data
    augmentation's numbers) differs from a run without the vault; restoring the state
    there would race the training thread's own draws. The training-loop integrations call
    this before training begins; a save does not, since the import takes 0.3-0.5 s.
    """
    if "blosc2" in sys.modules:
        return
    state = random.getstate()
    try:
        with contextlib.suppress(ImportError):  # _blosc2 says so when it is needed
            import blosc2  # noqa: F401
    finally:
        random.setstate(state)


def _blosc2() -> Any:
    try:
        import blosc2
    except ImportError:
        raise BackendNotInstalled(
            "compressed vault objects need blosc2: pip install blosc2 (a weightvault "
            "dependency; reinstall weightvault)"
        ) from None
    return blosc2


def _pcodec() -> Any:
    try:
        from pcodec import ChunkConfig, standalone  # type: ignore[import-untyped]
    except ImportError:
        raise BackendNotInstalled(
            "vault deltas need pcodec: pip install pcodec (a weightvault dependency; "
            "reinstall weightvault)"
        ) from None
    return ChunkConfig, standalone


def compress_block(codec: Codec, data: memoryview, itemsize: int) -> bytes | memoryview:
    """``data`` compressed as byte planes of ``itemsize`` (``data`` itself for STORED;
    for :data:`DELTAS`, as unsigned words of ``itemsize``)."""
    if codec.id == STORED.id:
        return data
    if codec.id == DELTAS.id:
        import numpy as np  # not at import: `import weightvault` stays numpy-free

        config, standalone = _pcodec()
        words = np.frombuffer(data, _WORDS[itemsize])
        # pcodec releases the GIL while it codes (measured: two threads 1.8x one).
        return bytes(standalone.simple_compress(words, config(compression_level=codec.level)))
    b = _blosc2()
    # Without the GIL the save's threads compress small objects side by side and write
    # others meanwhile; with it (python-blosc2's default) they took turns. Safe: each
    # compress2 call makes a context of its own.
    with _GIL.released(b):
        packed = b.compress2(
            data,
            typesize=itemsize,
            clevel=codec.level,
            codec=b.Codec.ZSTD,
            filters=[b.Filter.SHUFFLE],
            nthreads=_threads(data.nbytes),  # large blocks on blosc2's own threads too
        )
    return bytes(packed)


def decompress_block(
    codec_id: int, src: bytes | memoryview, out: memoryview, itemsize: int, *, private: bool = False
) -> None:
    """Fill ``out`` (exactly the block's raw size) from block ``src``.

    ``private`` says that nothing else can change ``src`` during the call (the caller
    read it into a buffer of its own); other memory is copied first.

    Raises:
        ValueError: ``src`` is not a block of exactly ``out.nbytes`` raw bytes, or does
            not decompress; the message says which.
    """
    if codec_id == STORED.id:
        if len(src) != out.nbytes:
            raise ValueError(f"a stored block holds {len(src)} bytes, expected {out.nbytes}")
        out[:] = src
        return
    if codec_id == DELTAS.id:
        _decompress_words(src, out, itemsize)
        return
    if codec_id not in READABLE:
        raise ValueError(f"unknown codec {codec_id}")
    # A private copy, so nothing can change it between check and use; bytes, and a view
    # of a buffer the caller filled for this call (a pread), are private already.
    private = (
        private
        or isinstance(src, bytes)
        or (isinstance(src, memoryview) and isinstance(src.obj, bytes | bytearray))
    )
    packed = src if private else bytes(src)
    if len(packed) < _BLOSC_MAX_OVERHEAD:
        raise ValueError(f"a compressed block of {len(packed)} bytes is shorter than its header")
    c = decoder()  # C-Blosc2 itself: no import of python-blosc2 (see .blosc2_c)
    if c is not None:
        nbytes, cbytes = c.sizes(packed)
    else:
        nbytes, cbytes, _ = _blosc2().get_cbuffer_sizes(packed)
    if nbytes != out.nbytes or cbytes != len(packed):
        raise ValueError(
            f"a compressed block claims {nbytes} raw bytes in {cbytes}, expected "
            f"{out.nbytes} in {len(packed)}"
        )
    if nbytes == 0:
        return
    try:
        # One thread: measured faster inside a load than blosc2's threads (the load's
        # own threads overlap reads, checks and copies with it). Without the GIL, so
        # those threads decode on every core (both buffers are this call's alone).
        if c is not None:
            c.decompress(packed, out)
            return
        b = _blosc2()
        with _GIL.released(b):
            got = b.decompress2(packed, dst=out, nthreads=1)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"a compressed block does not decompress ({e})") from None
    if got is not None:
        raise ValueError("a compressed block decompressed to an unexpected buffer")


def _decompress_words(src: bytes | memoryview, out: memoryview, itemsize: int) -> None:
    """Fill ``out`` from a pcodec block of exactly ``out.nbytes // itemsize`` words.

    pcodec checks its input as it reads (bounds, magic, bit widths) and writes only into
    the array it is given, which is ``out`` itself; a block that holds fewer or more
    words than ``out`` is refused after the call (``out`` is then garbage, as for any
    block that fails).
    """
    if itemsize not in _WORDS or out.nbytes % itemsize:
        raise ValueError(f"a pcodec block of {out.nbytes} bytes in {itemsize}-byte words")
    import numpy as np  # not at import: `import weightvault` stays numpy-free

    _, standalone = _pcodec()
    words = np.frombuffer(out, _WORDS[itemsize])
    try:
        # pcodec takes only bytes: a view is copied (a compressed block, not the tensor).
        packed = src if isinstance(src, bytes) else bytes(src)
        done = standalone.simple_decompress_into(packed, words)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"a pcodec block does not decompress ({e})") from None
    if done.n_processed != words.size or not done.finished:
        raise ValueError(f"a pcodec block holds other than the {words.size} words its table gives")


class _ReleasedGil:
    """Lets python-blosc2 release the GIL while weightvault compresses or decodes.

    python-blosc2 holds the GIL through a (de)compression unless its process-wide
    ``set_releasegil`` is on, so a save's or a load's threads took turns. Turned on while
    any call runs and back to what it was after the last one, it lets them run in
    parallel: the 35 blocks of the 13 MB GPT-2 of docs/benchmarks-log.md (section 11) took
    2.8 ms on two threads against 4.0 ms on one, and no slower than one when the other
    core was busy. Other code that calls blosc2 at the same moment releases the GIL
    too, which only lets its threads run meanwhile.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._before = False

    @contextmanager
    def released(self, blosc2: Any) -> Iterator[None]:
        with self._lock:
            if not self._active:
                self._before = bool(blosc2.set_releasegil(True))
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    blosc2.set_releasegil(self._before)


_GIL = _ReleasedGil()
