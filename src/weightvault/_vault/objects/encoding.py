"""How a vault object is encoded: raw, a compressed full object, or a delta on an anchor.

A save writes raw bytes only (the least work a commit needs, see :mod:`..writing.save`);
the compactor (:mod:`..upkeep.compact`) encodes them afterwards. A tensor that changed between two
checkpoints is usually close to its old value: the sign, the exponent and the high
mantissa bits of most elements are unchanged, so the difference of the two bit patterns
(a zigzag integer difference, see :mod:`.transforms`) compresses far better than the tensor.
Deltas are built on **anchors**, as video is on key frames: a whole object of the same
tensor in an older checkpoint, never a delta itself. The newest checkpoint's objects are
whole, so a resume reads one object per tensor and any other checkpoint at most two; a
delta 80 steps away from its anchor costs little more than one 10 steps away (trained
weights at lr 3e-5: 0.63 of raw against 0.54), so one anchor serves up to
:data:`DELTA_CHAIN` deltas. Training state is never a delta (retention drops the oldest
state first).

:func:`encode_full` and :func:`encode_delta` turn raw bytes into an object's file; a
frame is kept only when it saves at least 1 - :data:`PAYS` of the raw bytes, and a delta
only when it is smaller than the full object (decided on a sample, :func:`delta_wins`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash

from ..._base.errors import FormatError
from ..store.backend import Store
from ..store.pack import find, pack_key
from .address import object_key
from .codec import DELTAS, STORED, Codec, compress_block, delta_codec
from .frame import encode_frame, is_frame
from .probe import probe
from .transforms import delta_kind, make_delta

__all__ = [
    "ANCHOR_PAYS",
    "DELTA_CHAIN",
    "PAYS",
    "SHARED_PAYS",
    "SMALL",
    "Encoder",
    "Parts",
    "Storage",
    "delta_wins",
    "encode_delta",
    "encode_full",
    "stored_depth",
]

#: The most deltas of one tensor on one anchor (a whole object): a new anchor starts
#: after that many (chain lengths measured: docs/benchmarks-log.md, 11).
DELTA_CHAIN = 9
#: A frame is kept only if it is at most this fraction of the raw bytes.
PAYS = 0.95
#: The same for an object that checkpoints share unchanged (a frozen weight): every
#: resume of each of them decodes it, where compressing it saves a part of one copy (the
#: vault stores it once already). On trained fp32 weights blosc2 reaches about 0.84, and
#: decoding made a frozen-backbone fine-tune's resume 1.6-2.9x of plain files
#: (docs/benchmarks-log.md, section 25); such weights stay raw. bf16 weights (about 0.7) and
#: constant buffers (masks, position ids) are still compressed.
SHARED_PAYS = 0.75
#: The same for a tensor's whole object that deltas may point at (an anchor: every read
#: of a delta on it reads it too) and for the newest (read by a resume, and the anchor
#: of the checkpoints after it): trained fp32 weights (about 0.84) stay raw, so such a
#: read is a copy, not a decode. bf16 weights (about 0.7) are compressed.
ANCHOR_PAYS = SHARED_PAYS

#: Full objects smaller than this stay raw. Decoding one cost a load 20-30 us more than
#: reading it raw (opening the frame, a call into blosc2), and compressing it to about
#: 0.84 saves no 4 KiB block of the disk: on the 13 MB GPT-2 of docs/benchmarks-log.md
#: (section 21), 103 of the newest's 157 objects (layer norms and biases, all 4 KiB or
#: less), 2.8 ms of a 32 ms resume for 37 KB of its 291 MB.
SMALL = 16 << 10

#: An object's file as the parts written one after another.
Parts = list[bytes | memoryview]


@dataclass
class Storage:
    """How a vault encodes its objects (one per :class:`~weightvault.Vault`).

    Attributes:
        codec: How objects are compressed; ``None`` keeps them raw (no compaction).
        max_chain: The most deltas of one tensor on one anchor (a whole object): a load
            of any checkpoint reads at most 2 objects per tensor. 0 writes no deltas.
    """

    codec: Codec | None
    max_chain: int = DELTA_CHAIN


def stored_depth(
    store: Store, digest: str, nbytes: int, *, refresh_packs: bool = True
) -> int | None:
    """The frame depth of object ``digest`` in ``objects/`` or a pack under ``packs/`` (0
    for a full or raw one), or ``None`` if it is not there as an object of ``nbytes`` raw
    bytes. ``refresh_packs=False`` trusts a listing of ``packs/`` the caller made.

    Only ``objects/`` and ``packs/`` are looked at, never a gc's trash: like
    :func:`~..writing.commit.store_missing`, a writer may rely only on what it sees there after its
    intent is visible.
    """
    key = object_key(digest)
    size = store.size(key)
    if size is None:
        packed = find(store, digest, refresh=refresh_packs)
        if packed is None or packed.size != nbytes:
            return None
        # The table may remember a pack a gc freed since: only one seen there now counts.
        return 0 if store.size(pack_key(packed.pack)) is not None else None
    if size == nbytes:
        return 0
    try:
        frame = probe(store, key)
    except (FileNotFoundError, FormatError):
        return None
    return frame.depth if frame is not None and frame.raw_size == nbytes else None


def encode_full(
    raw: memoryview, itemsize: int, codec: Codec | None, *, pays: float = PAYS
) -> Parts:
    """Object ``raw``'s file as a full object: a compressed frame if that is at most
    ``pays`` of the raw bytes, else raw (always raw under :data:`SMALL` bytes)."""
    raw = raw.cast("B")
    if codec is not None and raw.nbytes >= SMALL:
        parts = encode_frame(raw, itemsize, codec)
        if size_of(parts) <= pays * raw.nbytes:
            return parts
    return [as_raw(raw)]


def encode_delta(
    raw: memoryview, base: memoryview, digest: str, itemsize: int, codec: Codec
) -> Parts:
    """Object ``raw``'s file as a delta against object ``digest`` (raw bytes ``base``)."""
    kind = delta_kind(itemsize, raw.nbytes)
    payload = memoryview(make_delta(raw.cast("B"), base.cast("B"), kind, itemsize))
    # The base's own sum, so a load checks a raw base by reading it once (see .frame).
    base_sum = xxhash.xxh3_64_intdigest(base)
    # Whole words of 2, 4 or 8 bytes may go to pcodec (see .codec: DELTAS), others to codec.
    if delta_codec(codec, itemsize, raw.nbytes) is not DELTAS:
        return encode_frame(
            payload, itemsize, codec, base=digest, kind=kind, depth=1, base_sum=base_sum
        )
    sample = payload[: PCODEC_SAMPLE - PCODEC_SAMPLE % itemsize]
    ours, theirs = (compress_block(c, sample, itemsize) for c in (DELTAS, codec))
    coder, packed = (DELTAS, ours) if len(ours) <= PCODEC_PAYS * len(theirs) else (codec, theirs)
    # A payload no longer than the sample is coded already: its one block, not again.
    whole = packed if 0 < payload.nbytes == sample.nbytes else None
    return encode_frame(
        payload, itemsize, coder, base=digest, kind=kind, depth=1, base_sum=base_sum,
        compressed=whole,
    )  # fmt: skip


#: pcodec codes a delta only if, on a sample of its words, it takes at most this fraction
#: of blosc2's bytes. On trained weights it saves 2-4% and decodes twice as fast; on the
#: differences of barely trained (random) weights it saved 0.5% and decoded at 1.75
#: GB/s against blosc2's 2.2 (docs/benchmarks-log.md, section 19): there blosc2 stays.
PCODEC_PAYS = 0.99
#: The sample both codecs code to choose: the payload's first 256 KiB (pcodec encodes
#: at about 150-200 MB/s, a third of blosc2's speed, so coding whole objects twice
#: nearly doubled the compactor's CPU on GPT-2 6 x 512).
PCODEC_SAMPLE = 256 << 10


@dataclass
class Encoder:
    """Turns an object's raw bytes into its file's bytes as a save writes it.

    Attributes:
        codec: ``None`` (what a save uses: the compactor encodes later), or a codec that
            compresses each object in full when that pays.
        itemsizes: ``{digest: bytes per element}``; others are split into 4-byte planes.
    """

    codec: Codec | None = None
    itemsizes: dict[str, int] = field(default_factory=dict)

    def encode_parts(self, digest: str, data: memoryview | bytes) -> Parts:
        """The parts to write one after another (never joined in memory first)."""
        raw = memoryview(data).cast("B")
        if self.codec is None:
            return [as_raw(raw)]
        return encode_full(raw, self.itemsizes.get(digest, 4), self.codec)


#: Bytes of each sample slice; objects of at least 8 slices choose on a sample (4
#: slices compressed) rather than compressing both candidates in full (2 x the object).
SAMPLE = 16 << 10


def delta_wins(codec: Codec, raw: memoryview, base: memoryview, itemsize: int) -> bool:
    """Whether the delta of ``raw`` on ``base`` will compress smaller than ``raw`` itself.

    Decided on two slices of each (the start and the middle), so that each object is
    compressed once; objects under 8 slices are compared in full.
    """
    raw, base = raw.cast("B"), base.cast("B")
    planes = itemsize if 0 < itemsize < 256 and raw.nbytes % itemsize == 0 else 1
    kind = delta_kind(itemsize, raw.nbytes)
    if raw.nbytes < 8 * SAMPLE:
        spans = [(0, raw.nbytes)]
    else:
        mid = (raw.nbytes // 2) // planes * planes
        spans = [(0, SAMPLE), (mid, mid + SAMPLE)]
    size_full = size_delta = 0
    for a, b in spans:
        size_full += len(compress_block(codec, raw[a:b], planes))
        delta = memoryview(make_delta(raw[a:b], base[a:b], kind, itemsize))
        size_delta += len(compress_block(codec, delta, planes))
    return size_delta < size_full


def size_of(parts: Parts) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def as_raw(raw: memoryview) -> memoryview | bytes:
    """``raw`` itself, unless it starts like a frame: then a stored frame, so that every
    reader can tell (see :mod:`.frame`)."""
    if is_frame(raw):
        return b"".join(encode_frame(raw, 1, STORED))
    return raw
