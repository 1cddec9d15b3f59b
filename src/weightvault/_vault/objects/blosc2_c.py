"""Decoding blosc2 blocks through C-Blosc2's own library, without importing python-blosc2.

A resume in a new process is what users run after a crash or at the start of an
evaluation, and its first compressed block used to import python-blosc2: 180-210 ms in a
process that has imported torch and transformers (the package imports most of itself,
and the allocations set off a full garbage collection), against 31 ms for the whole
load of the 13 MB GPT-2 of docs/benchmarks-log.md (section 22). Decoding needs three
functions of the C library that the wheel ships beside the package (``blosc2/lib``), so
this module loads that library with :mod:`ctypes` (2-9 ms) and calls them directly.
ctypes releases the GIL for each call, so a load's threads decode on every core, as
python-blosc2 does when told to.

The library is found without running the package (:func:`importlib.util.find_spec`),
only a C-Blosc2 of a known major version is used (:data:`_MAJORS`: the layout of the
decompression parameters passed by value), and a block of known bytes must decode
before anything else does. Anything else (no library beside the package, as in builds
that link a system C-Blosc2; an unknown version; a failed check) leaves :func:`decoder`
returning ``None``, and :mod:`.codec` decodes through python-blosc2 as before.
Compression always goes through python-blosc2: it runs in the compactor, after a save.

Example:
    >>> from weightvault._vault.objects.blosc2_c import decoder
    >>> d = decoder()
    >>> d is None or d.sizes(_PROBE) == (len(_PROBE_RAW), len(_PROBE))
    True
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from typing import Any

__all__ = ["Decoder", "decoder"]

#: C-Blosc2 major versions whose ``blosc2_dparams`` this module lays out: ``int16
#: nthreads; void *schunk, *postfilter, *postparams; int32 typesize`` (2.x gained the
#: last field during its life; an older library never reads it).
_MAJORS = frozenset({2, 3})

#: 512 bytes (``(i * i) % 13``), byte planes of 4 + zstd 1, as python-blosc2 4.15 wrote
#: them: decoded once before the library is trusted.
_PROBE = bytes.fromhex(
    "050185040002000000020000a800000001000000000005000000000000000000240000001d00000028b52f"
    "fd2080a500006800030c01090a04040a09010c03010010d2f9051d00000028b52ffd2080a5000068010c03"
    "00030c01090a04040a09010010d2f9051d00000028b52ffd2080a5000068040a09010c0300030c01090a04"
    "010010d2f9051d00000028b52ffd2080a5000068090a04040a09010c0300030c01010010d2f905"
)
_PROBE_RAW = bytes((i * i) % 13 for i in range(512))


class _DParams(ctypes.Structure):
    _fields_ = [
        ("nthreads", ctypes.c_int16),
        ("schunk", ctypes.c_void_p),
        ("postfilter", ctypes.c_void_p),
        ("postparams", ctypes.c_void_p),
        ("typesize", ctypes.c_int32),
    ]


class Decoder:
    """C-Blosc2's decoder, one decompression context per thread (one C thread each)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._local = threading.local()
        i32 = ctypes.POINTER(ctypes.c_int32)
        lib.blosc2_cbuffer_sizes.argtypes = [ctypes.c_void_p, i32, i32, i32]
        lib.blosc2_cbuffer_sizes.restype = ctypes.c_int
        lib.blosc2_create_dctx.argtypes = [_DParams]
        lib.blosc2_create_dctx.restype = ctypes.c_void_p
        lib.blosc2_free_ctx.argtypes = [ctypes.c_void_p]
        lib.blosc2_free_ctx.restype = None
        lib.blosc2_decompress_ctx.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int32,
            ctypes.c_void_p,
            ctypes.c_int32,
        ]
        lib.blosc2_decompress_ctx.restype = ctypes.c_int

    def sizes(self, src: bytes | memoryview) -> tuple[int, int]:
        """``(raw bytes, compressed bytes)`` as the block's header says (at least 32
        bytes of ``src``: the caller checks its length first).

        Raises:
            ValueError: The header is not a blosc2 header.
        """
        nbytes, cbytes, blocksize = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
        rc = _call(
            src,
            None,
            lambda s, _: self._lib.blosc2_cbuffer_sizes(
                s, ctypes.byref(nbytes), ctypes.byref(cbytes), ctypes.byref(blocksize)
            ),
        )
        if rc < 0:
            raise ValueError(f"not a blosc2 block header (error {rc})")
        return nbytes.value, cbytes.value

    def decompress(self, src: bytes | memoryview, out: memoryview) -> None:
        """Fill ``out`` (writable, exactly the block's raw size) from block ``src``.

        Raises:
            ValueError: The block does not decompress to exactly ``out.nbytes`` bytes.
        """
        ctx = self._context()
        n = src.nbytes if isinstance(src, memoryview) else len(src)
        rc = _call(src, out, lambda s, d: self._lib.blosc2_decompress_ctx(ctx, s, n, d, out.nbytes))
        if rc != out.nbytes:
            # A context that failed on a damaged block is not used again: a new one next.
            self._local.ctx = None
            raise ValueError(f"it decompressed to {rc} bytes, expected {out.nbytes}")

    def _context(self) -> int:
        held = getattr(self._local, "ctx", None)
        if held is None:
            ctx = self._lib.blosc2_create_dctx(_DParams(1, None, None, None, 8))
            if not ctx:
                raise ValueError("C-Blosc2 could not make a decompression context")
            # Freed when the thread ends and its locals go.
            held = self._local.ctx = _Context(self._lib, ctx)
        return held.ctx


class _Context:
    def __init__(self, lib: Any, ctx: int) -> None:
        self._lib, self.ctx = lib, ctx

    def __del__(self) -> None:
        self._lib.blosc2_free_ctx(self.ctx)


def _call(src: bytes | memoryview, out: memoryview | None, fn: Any) -> int:
    """``fn(address of src, address of out)``; every view of the buffers made here is
    gone when it returns, so the caller may release them (a ``with memoryview``) even as
    an error propagates."""
    if isinstance(src, bytes):
        s: Any = src  # ctypes passes a bytes object's own buffer
    elif not src.readonly:
        s = (ctypes.c_char * src.nbytes).from_buffer(src.cast("B"))
    else:
        s = bytes(src)  # a read-only view (a fetched file): its copy
    d = None if out is None else (ctypes.c_char * out.nbytes).from_buffer(out)
    try:
        return int(fn(s, d))
    finally:
        del s, d


def _library() -> Any:
    """C-Blosc2 as shipped beside python-blosc2, or ``None``."""
    import glob  # once per process: not at import

    spec = importlib.util.find_spec("blosc2")
    if spec is None or spec.origin is None:
        return None
    where = os.path.join(os.path.dirname(spec.origin), "lib")
    names = [
        p
        for pattern in ("libblosc2.so*", "libblosc2*.dylib", "*blosc2*.dll")
        for p in sorted(glob.glob(os.path.join(where, pattern)))
    ]
    for path in names:
        try:
            # Once through PyDLL, which holds the GIL: blosc2_init must not run beside
            # python-blosc2's own, which its import makes under the GIL.
            ctypes.PyDLL(path).blosc2_init()
            lib = ctypes.CDLL(path)
        except (OSError, AttributeError):
            continue
        lib.blosc2_get_version_string.restype = ctypes.c_char_p
        version = lib.blosc2_get_version_string() or b""
        major = version.split(b".")[0]
        if major.isdigit() and int(major) in _MAJORS:
            return lib
    return None


def _load() -> Decoder | None:
    lib = _library()
    if lib is None:
        return None
    d = Decoder(lib)
    out = bytearray(len(_PROBE_RAW))
    try:
        if d.sizes(_PROBE) != (len(_PROBE_RAW), len(_PROBE)):
            return None
        d.decompress(_PROBE, memoryview(out))
    except (ValueError, OSError):
        return None
    return d if bytes(out) == _PROBE_RAW else None


_lock = threading.Lock()
_decoder: list[Decoder | None] = []


def decoder() -> Decoder | None:
    """The C decoder, loaded and checked on first use; ``None`` where it cannot be used
    (then decode through python-blosc2). ``WEIGHTVAULT_BLOSC2_CTYPES=0`` turns it off."""
    if not _decoder:
        with _lock:
            if not _decoder:
                off = os.environ.get("WEIGHTVAULT_BLOSC2_CTYPES") == "0"
                _decoder.append(None if off else _load())
    return _decoder[0]
