"""How a save stores an object: raw, compressed, or as a delta against the parent checkpoint.

A tensor that changed since the parent checkpoint (the newest one, the same name, dtype
and shape) is usually close to its old value: the sign, the exponent and the high
mantissa bits of most elements are unchanged, so ``new XOR old`` is mostly zero bits,
and it compresses far better than the tensor itself (the delta is a zigzag integer
difference, see :mod:`.diff`). :class:`Encoder` compresses either the delta or the
plain object, whichever compresses smaller on a sample of both (small objects try both
in full), and keeps it unless the raw bytes are nearly as small (compression must save
at least 1 - :data:`PAYS` of an object to be kept).

Chains stay short: a delta's depth is its base's plus one, so a load reads at most
``max_chain + 1`` objects per tensor. When the parent's object is already at depth
``max_chain``, the delta is taken against the full object its chain ends at (the chain's
*key object*, as a video codec refers back to its last key frame) and starts a new chain
at depth 1, once per key object; it becomes a full object when that delta does not
compress smaller, or the key object already served a restart (:func:`delta_base`). On
the trained run of docs/benchmarks.md section 11, 180 steps from the key object the
difference still compresses to 0.81 of the tensor (0.85 in full).

A base must be in ``objects/`` when the save looks (after its intent names the base, as
:mod:`.commit` requires); gc keeps every base a live object's frame names (see
:mod:`.gc`).

The base's raw bytes come from :class:`BaseCache`, which keeps the raw bytes of the
previous save's objects within a byte budget, or else from the store (its chain decoded).
The cache also remembers the depth and chain of each object the vault wrote, so a save
reads no frame header back while the base's file keeps the size it was written with.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .._base.errors import CheckpointNotFoundError, FormatError
from .._file.layout import is_training
from .codec import STORED, Codec, compress_block
from .diff import delta_kind, make_delta
from .frame import MAX_DEPTH, encode_frame, is_frame
from .objects import object_frame, object_key, read_object
from .store import Store

__all__ = [
    "CACHE_BYTES",
    "DELTA_CHAIN",
    "PAYS",
    "BaseCache",
    "Encoder",
    "Storage",
    "Tensors",
    "chain_digests",
    "newest_tensors",
    "stored_depth",
]

#: The deepest delta chain written by default (measured: docs/benchmarks.md, section 11).
DELTA_CHAIN = 8
#: A frame is kept only if it is at most this fraction of the raw bytes.
PAYS = 0.95
#: Raw bytes of the previous save's objects a vault keeps as delta bases, at most.
CACHE_BYTES = 1 << 30


#: An object's file as the parts written one after another.
Parts = list[bytes | memoryview]

#: What a vault knows of an object it wrote: ``(file bytes, chain depth, bases down its
#: chain)``. Trusted only while the object's file still has that size.
Chain = tuple[int, int, frozenset[str]]


class BaseCache:
    """Raw bytes of recently written objects, kept to XOR the next save's tensors against.

    Bounded by ``budget`` bytes; only the objects of the newest save are kept (their
    digests are what the next save's bases will be).
    """

    def __init__(self, budget: int = CACHE_BYTES) -> None:
        self.budget = budget
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        #: ``{digest: (file bytes, depth, bases down its chain)}`` of objects this vault
        #: wrote, so the next save need not read their frame headers back.
        self.chains: dict[str, Chain] = {}

    def get(self, digest: str) -> bytes | None:
        with self._lock:
            return self._items.get(digest)

    def put(self, digest: str, raw: memoryview) -> None:
        """Keep a copy of ``raw`` (the caller's buffer may change after the save)."""
        if raw.nbytes > self.budget:
            return
        with self._lock:
            if digest in self._items or self._size + raw.nbytes > self.budget:
                return
        copy = bytes(raw)
        with self._lock:
            if digest not in self._items:
                self._items[digest] = copy
                self._size += len(copy)

    def __getstate__(self) -> dict[str, int]:
        # A pickled vault (sent to a worker process) starts with an empty cache.
        return {"budget": self.budget}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["budget"])  # type: ignore[misc]

    def keep_only(self, digests: set[str]) -> None:
        """Drop everything but ``digests`` (the objects the newest save named)."""
        with self._lock:
            for d in [d for d in self._items if d not in digests]:
                self._size -= len(self._items.pop(d))
            self.chains = {d: c for d, c in self.chains.items() if d in digests}

    def learn(self, digest: str, chain: Chain) -> None:
        with self._lock:
            self.chains[digest] = chain


#: A checkpoint's tensors: ``{stored name: (object digest, dtype, shape)}``.
Tensors = dict[str, tuple[str, str, tuple[int, ...]]]


@dataclass
class Storage:
    """How a vault stores the objects of its saves (one per :class:`~weightvault.Vault`).

    Attributes:
        codec: How objects are compressed; ``None`` keeps them raw.
        max_chain: The deepest delta written; 0 writes no deltas.
        training_deltas: Whether training state may be stored as deltas. A vault that
            drops old training state (``training_state_last``) stores it in full, or
            every dropped state would stay as the base of the next one.
        training: Which stored names are training state, for ``training_deltas``:
            ``Vault.save``'s own training section by default; a loop that stores its
            optimizer under names of its own (Lightning's ``optimizer_states/...``) sets
            a module-level function (the vault pickles with it).
        cache: Raw bytes of the previous save's objects, the next save's delta bases.
        parent: The tensors of this vault's previous save (read from the newest record
            when unknown).
        history: The tensors of this process's last saves, oldest first (at most
            ``max_chain + 1``): what tells a chain that may restart from its key object
            from one that already did (:func:`delta_base`).
    """

    codec: Codec | None
    max_chain: int = DELTA_CHAIN
    training_deltas: bool = True
    training: Callable[[str], bool] = is_training
    cache: BaseCache = field(default_factory=BaseCache)
    parent: Tensors | None = None
    history: list[Tensors] = field(default_factory=list)

    def __getstate__(self) -> dict[str, object]:
        # Another process reads the newest record again: this one's memory is not its.
        return {**self.__dict__, "parent": None, "history": []}

    def saved(self, tensors: Tensors) -> None:
        """Remember a save's tensors: the next save's parent, and its history."""
        self.parent = tensors
        self.history = [*self.history, tensors][-(self.max_chain + 1) :]

    def before_parent(self) -> Tensors | None:
        """The tensors of the save ``max_chain`` saves before the parent, if this process
        made them all (a chain that long then ran through this process's own saves)."""
        if self.max_chain <= 0 or len(self.history) < self.max_chain + 1:
            return None
        if self.history[-1] is not self.parent:
            return None
        return self.history[-1 - self.max_chain]

    def parent_tensors(self, store: Store) -> Tensors:
        """The tensors deltas are taken against: the previous save's, or the newest record's."""
        if self.parent is None:
            self.parent = newest_tensors(store)
        return self.parent


def newest_tensors(store: Store) -> Tensors:
    """The tensors of the newest checkpoint (none if it is unreadable or a DCP one)."""
    from .checkpoint import VaultCheckpoint
    from .records import list_records, read_doc

    try:
        records = list_records(store)
        if not records:
            return {}
        ckpt = VaultCheckpoint(store, records[-1].name, read_doc(store, records[-1].name))
    except (FormatError, CheckpointNotFoundError):
        return {}  # no bases: this save writes full objects
    return {n: (ckpt.objects[n], i.dtype, i.shape) for n, i in ckpt.stored.items()}


def stored_depth(store: Store, digest: str, nbytes: int) -> int | None:
    """The chain depth of object ``digest`` in ``objects/`` (0 for a full or raw one), or
    ``None`` if it is not there as an object of ``nbytes`` raw bytes.

    Only ``objects/`` is looked at, never a gc's trash: like :func:`~.commit.store_missing`,
    a save may rely only on what it sees there after its intent is visible.
    """
    from .frame import parse_frame_header

    key = object_key(digest)
    size = store.size(key)
    if size is None:
        return None
    if size == nbytes:
        return 0
    try:
        head = store.get_range(key, 0, 64)
        frame = parse_frame_header(memoryview(head)) if is_frame(head) else None
    except (FileNotFoundError, FormatError):
        return None
    return frame.depth if frame is not None and frame.raw_size == nbytes else None


def delta_base(
    store: Store,
    cache: BaseCache | None,
    parent: str,
    nbytes: int,
    max_chain: int,
    earlier: str | None = None,
) -> str | None:
    """The object a delta of a changed tensor is taken against: the parent checkpoint's
    object ``parent`` while its chain is shallower than ``max_chain``, else the full
    object that chain ends at; ``None`` (a full object) if neither is in ``objects/`` as
    an object of ``nbytes`` raw bytes.

    A key object serves two chains at most, its own and one restart, so that a tensor
    still gets a full object at least every ``2 * max_chain + 1`` saves and damage to one
    object reaches no more checkpoints than that: the restart is taken only when
    ``earlier`` (the tensor's object ``max_chain`` saves before the parent) is the key
    object itself, which means the parent's chain is the key's own. A restarted chain's
    save that far back holds a delta, so it ends in a full object.

    Called before the save's intent is written, so that the intent names the object
    returned and a gc keeps it while the save reads it.
    """
    # Trusted without a stat (a round trip on a remote store): only a choice of base,
    # which the Encoder checks again once the save's intent is written.
    known = cache.chains.get(parent) if cache is not None else None
    chain: frozenset[str] | set[str] | None = None
    if known is not None:
        depth: int | None = known[1]
        chain = known[2]
    else:
        depth = stored_depth(store, parent, nbytes)
    if depth is None or depth < max_chain:
        return parent if depth is not None else None
    if earlier is None or earlier == parent:
        return None
    # The only full object on the parent's chain is the one the chain ends at.
    if earlier not in (chain if chain is not None else chain_digests(store, parent)):
        return None
    return earlier if stored_depth(store, earlier, nbytes) == 0 else None


def chain_digests(store: Store, digest: str) -> set[str]:
    """The bases object ``digest``'s frames name, down its chain (from frame headers)."""
    out: set[str] = set()
    for _ in range(MAX_DEPTH):
        frame = object_frame(store, digest)
        if frame is None or frame.base is None or frame.base in out:
            break
        digest = frame.base
        out.add(digest)
    return out


@dataclass
class Encoder:
    """Turns an object's raw bytes into the bytes of its file, for one save.

    Attributes:
        store: The vault's store (bases are read from it when not cached).
        codec: How to compress; ``None`` writes raw bytes (``Vault(compression=None)``).
        itemsizes: ``{digest: bytes per element}``; others are split into 4-byte planes.
        bases: ``{digest: the parent checkpoint's object of the same tensor}``.
        cache: Raw bytes of recent objects, to XOR against without reading the store.
        keep: Digests worth caching as the next save's bases.
        max_chain: The deepest delta written (0: no deltas).
    """

    store: Store
    codec: Codec | None
    itemsizes: Mapping[str, int]
    bases: Mapping[str, str]
    cache: BaseCache | None = None
    keep: frozenset[str] = frozenset()
    max_chain: int = DELTA_CHAIN

    def encode(self, digest: str, data: memoryview | bytes) -> memoryview | bytes:
        """What object ``digest``'s file holds: a frame if that pays, else ``data``."""
        parts = self.encode_parts(digest, data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def encode_parts(self, digest: str, data: memoryview | bytes) -> Parts:
        """:meth:`encode` as the parts to write one after another (a frame's header and
        blocks), so that the file's bytes are never joined in memory first."""
        raw = memoryview(data).cast("B")
        if self.cache is not None and digest in self.keep and self.takes_deltas:
            self.cache.put(digest, raw)
        if self.codec is None:
            return self._learn(digest, [_as_raw(raw)], 0, frozenset())
        itemsize = self.itemsizes.get(digest, 4)
        delta = self._delta(digest, raw, itemsize)
        small = raw.nbytes < 8 * _SAMPLE
        if delta is not None and not small and not _delta_wins(self.codec, raw, delta[0], itemsize):
            delta = None
        best: tuple[Parts, int, frozenset[str]] | None = None
        if delta is not None:
            payload, base, kind, depth, chain = delta
            parts = encode_frame(payload, itemsize, self.codec, base=base, kind=kind, depth=depth)
            best = (parts, depth, chain)
        if best is None or small:
            # Small objects try both: it costs little, and a sample could mislead.
            full = encode_frame(raw, itemsize, self.codec)
            if best is None or _size(full) < _size(best[0]):
                best = (full, 0, frozenset())
        if _size(best[0]) <= PAYS * raw.nbytes:
            return self._learn(digest, *best)
        return self._learn(digest, [_as_raw(raw)], 0, frozenset())

    @property
    def takes_deltas(self) -> bool:
        """Whether the next save may take deltas against these objects (else their raw
        bytes are not worth a copy)."""
        return self.codec is not None and self.max_chain > 0

    def _learn(self, digest: str, parts: Parts, depth: int, chain: frozenset[str]) -> Parts:
        if self.cache is not None and digest in self.keep:
            self.cache.learn(digest, (_size(parts), depth, chain))
        return parts

    def _chain(self, base: str, nbytes: int) -> tuple[int, frozenset[str]] | None:
        """``(depth, bases down its chain)`` of object ``base``, or ``None`` if it is not
        in ``objects/`` as an object of ``nbytes`` raw bytes.

        What this vault wrote itself is known without reading the frame back, as long as
        the file still has the size written (a file only changes when another writer
        stores the same bytes anew, in another form and so another size).
        """
        known = self.cache.chains.get(base) if self.cache is not None else None
        if known is not None and self.store.size(object_key(base)) == known[0]:
            return known[1], known[2]
        depth = stored_depth(self.store, base, nbytes)
        if depth is None:
            return None
        return depth, frozenset(chain_digests(self.store, base)) if depth else frozenset()

    def _delta(
        self, digest: str, raw: memoryview, itemsize: int
    ) -> tuple[memoryview, str, int, int, frozenset[str]] | None:
        """``(delta bytes, base, kind, depth, chain)`` against the parent's object, or
        ``None`` if there is none to take."""
        base = self.bases.get(digest)
        if base is None or self.max_chain <= 0 or self.codec is None:
            return None
        found = self._chain(base, raw.nbytes)
        if found is None or found[0] >= self.max_chain:
            return None  # absent: write in full; at the deepest: a full object restarts
        depth, chain = found
        if digest == base or digest in chain:
            # The tensor went back to an old value that a gc holds in its trash while
            # this save rewrites it: a delta on a chain through itself would be a cycle.
            return None
        old = self.cache.get(base) if self.cache is not None else None
        if old is None:
            try:
                old = bytes(read_object(self.store, base, raw.nbytes))
            except (FileNotFoundError, FormatError):
                return None
        if len(old) != raw.nbytes:
            return None
        kind = delta_kind(itemsize, raw.nbytes)
        payload = memoryview(make_delta(raw, old, kind, itemsize))
        return payload, base, kind, depth + 1, chain | {base}


#: Bytes of each sample slice; objects of at least 8 slices choose on a sample (4
#: slices compressed) rather than compressing both candidates in full (2 x the object).
_SAMPLE = 16 << 10


def _delta_wins(codec: Codec, raw: memoryview, delta: memoryview, itemsize: int) -> bool:
    """Whether the delta will compress smaller than the object itself.

    Decided on two slices of each (its start and its middle), so that a save compresses
    each object once: compressing both in full doubled a save's compression work on
    optimizer moments, whose deltas are about as large as they are. Small objects are
    try both in full (:meth:`Encoder.encode`).
    """
    planes = itemsize if 0 < itemsize < 256 and raw.nbytes % itemsize == 0 else 1
    mid = (raw.nbytes // 2) // planes * planes
    spans = [(0, _SAMPLE), (mid, mid + _SAMPLE)]
    size_full = sum(len(compress_block(codec, raw[a:b], planes)) for a, b in spans)
    size_delta = sum(len(compress_block(codec, delta[a:b], planes)) for a, b in spans)
    return size_delta < size_full


def _size(parts: Parts) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def _as_raw(raw: memoryview) -> memoryview | bytes:
    """``raw`` itself, unless it starts like a frame: then a stored frame, so that every
    reader can tell (see :mod:`.frame`)."""
    if is_frame(raw):
        return b"".join(encode_frame(raw, 1, STORED))
    return raw
