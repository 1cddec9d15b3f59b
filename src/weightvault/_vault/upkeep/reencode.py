"""Re-encoding one object: verified raw bytes in, a full or delta encoding staged out.

:class:`Work` is one compaction's state; :func:`staging` registers the intent that keeps
what a pass touches from gc, and discards what it staged if the pass fails;
:func:`to_full` and :func:`to_delta` stage an object's new encoding once it decodes back
to the raw bytes; :meth:`Work.publish` puts the staged files in place.

Example:
    >>> with staging(work, {digest}) as staged:
    ...     if to_full(work, digest, nbytes, 4, "000001: w", staged):
    ...         work.publish(staged)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..._base.errors import FormatError
from ..._file.checkpoint import new_buffer
from ..objects.address import checksum, content_hash, object_key
from ..objects.encoding import (
    PAYS,
    Parts,
    Storage,
    delta_wins,
    encode_delta,
    encode_full,
    size_of,
)
from ..objects.frame import decode_into, is_frame, parse_frame
from ..objects.read import read_object
from ..store.backend import Store
from ..writing.commit import begin, release
from .probes import _head
from .report import CompactReport

__all__ = ["Buffers", "Damaged", "Staged", "Work", "round_trip", "staging", "to_delta", "to_full"]

#: ``{digest: (staging token, old size, new size)}``: a pass's files not yet in place.
Staged = dict[str, tuple[str, int, int]]


class Damaged(Exception):
    """An object whose bytes do not match its name (or cannot be read)."""


#: ``{(vault URL, digest): pays}``: raw objects this process found not worth compressing
#: at that threshold (an object's bytes never change, so neither does the answer).
_STAYS_RAW: dict[tuple[str, str], float] = {}
_STAYS_RAW_MAX = 1 << 16

#: Verified raw objects a compaction keeps at hand (a tensor's new and old values).
_RECENT = 3


class Buffers:
    """Memory a compaction has touched already, handed out again by size class.

    A compaction reads, and round-trips, every object of its checkpoints in turn; a new
    buffer for each was new memory, which the kernel zeroes page by page before the read
    fills it: on a 2-core machine, ``clear_page`` was 37% of a GPT-2 compaction's samples, and
    the reads made ``compact()`` 1.23-1.28x of what it took when objects were mapped
    (docs/benchmarks-log.md, 37). A buffer is a power of two of at least 64 KiB, and at
    most :data:`_SPARE` free ones of each size (one of 64 MiB or more) are held.

    Example:
        >>> pool = Buffers()
        >>> a = pool.take(100_000)
        >>> pool.give(a)
        >>> pool.take(70_000) is a
        True
    """

    def __init__(self) -> None:
        self._free: dict[int, list[memoryview]] = {}

    def take(self, nbytes: int) -> memoryview:
        """A buffer of at least ``nbytes``, its contents left as they were."""
        size = max(_SMALLEST, 1 << max(0, nbytes - 1).bit_length())
        free = self._free.get(size)
        return free.pop() if free else new_buffer(size)

    def give(self, buffer: memoryview) -> None:
        """Hand ``buffer`` (from :meth:`take`) back; no view of it may be used after."""
        free = self._free.setdefault(buffer.nbytes, [])
        if len(free) < (_SPARE if buffer.nbytes < _LARGE else 1):
            free.append(buffer)


#: Free buffers :class:`Buffers` holds of one size (and of one size of _LARGE or more).
_SPARE = 3
_SMALLEST, _LARGE = 64 << 10, 64 << 20


class Work:
    """One compaction's state: what it read, what it wrote, what it found damaged."""

    def __init__(self, store: Store, storage: Storage, report: CompactReport) -> None:
        self.store, self.storage, self.report = store, storage, report
        self.bad: set[str] = set()
        self._recent: dict[str, memoryview] = {}  # the last few verified raw bytes
        self._buffers: dict[str, memoryview] = {}  # the buffer each of them fills
        #: Memory that reads and round trips fill, handed back once they are done.
        self.buffers = Buffers()
        self._taken: memoryview | None = None  # the buffer of the read in progress

    def raw(self, digest: str, nbytes: int, where: str) -> memoryview:
        """The verified raw bytes of ``digest`` (the last few are kept: an object made
        full is the base of the next delta, which then needs no second decode or hash).

        The bytes are read into memory of :attr:`buffers` that an earlier read filled,
        so the view returned holds them only until :data:`_RECENT` more objects have
        been read: callers use it before asking for more.

        Raises:
            Damaged: They do not decode, or their blake3 is not the name (reported), or
                the object is gone (not reported: a gc freed it since its checkpoint was
                deleted or its training state dropped, which only the intent of the
                newer checkpoint's objects keeps from happening).
        """
        if digest in self.bad:
            raise Damaged(digest)
        if digest in self._recent:
            return self._recent[digest]
        self._taken = None
        try:
            data = read_object(self.store, digest, nbytes, into=self._buffer)
            if data.nbytes == nbytes and content_hash(data) == digest:
                self._recent[digest] = data
                if self._taken is not None:
                    self._buffers[digest], self._taken = self._taken, None
                while len(self._recent) > _RECENT:
                    self._forget(next(iter(self._recent)))
                return data
            why = "its bytes do not match its name (blake3)"
        except FileNotFoundError:
            self.bad.add(digest)
            raise Damaged(digest) from None
        except FormatError as e:
            why = str(e)
        finally:
            if self._taken is not None:  # read, but not kept: the next read may use it
                self.buffers.give(self._taken)
                self._taken = None
        self.bad.add(digest)
        self.report.damaged.append(f"{self.store.url}/{object_key(digest)} ({where}): {why}")
        raise Damaged(digest)

    def _buffer(self, nbytes: int) -> memoryview:
        """``nbytes`` (or more) of memory for :meth:`raw` to read into, taken by the read
        in progress until it is kept."""
        self._taken = self.buffers.take(nbytes)
        return self._taken

    def _forget(self, digest: str) -> None:
        """Stop keeping ``digest``; its buffer goes back to the pool."""
        del self._recent[digest]
        buffer = self._buffers.pop(digest, None)
        if buffer is not None:
            self.buffers.give(buffer)

    def publish(self, staged: dict[str, tuple[str, int, int]]) -> None:
        """Put the staged ``{digest: (token, old size, new size)}`` files in place."""
        if not staged:
            return
        tokens = {object_key(d): t for d, (t, _, _) in staged.items()}
        self.store.publish(tokens, sum(n for _, _, n in staged.values()))
        for _, old, new in staged.values():
            self.report.bytes_before += old
            self.report.bytes_after += new
        staged.clear()

    def stage(
        self,
        digest: str,
        parts: Parts,
        old: int,
        staged: dict[str, Any],
        raw: memoryview,
        base: memoryview | None = None,
    ) -> None:
        """Stage ``parts`` as ``digest``'s new file, once they decode back to ``raw``
        (on ``base``, for a delta): a load then trusts a frame's block sums alone.

        Raises:
            FormatError: They do not (a codec fault): nothing is staged.
        """
        round_trip(parts, raw, base, self.buffers)
        staged[digest] = (self.store.stage(object_key(digest), parts), old, size_of(parts))


def round_trip(
    parts: Parts, raw: memoryview, base: memoryview | None, buffers: Buffers | None = None
) -> None:
    """Check that the file ``parts`` decodes to ``raw`` (applied on ``base`` for a delta),
    decoding into memory of ``buffers`` when given."""
    data = memoryview(parts[0] if len(parts) == 1 else b"".join(parts)).cast("B")
    if not is_frame(data) or data.nbytes == raw.nbytes:
        if bytes(data) != bytes(raw):
            raise FormatError("an encoded object does not hold its raw bytes")
        return
    frame = parse_frame(data, raw.nbytes)
    pool = buffers or Buffers()
    whole = pool.take(raw.nbytes)
    try:
        with whole[: raw.nbytes] as out:
            if frame.base is not None and base is not None:
                out[:] = base.cast("B")  # a delta applies to its base's bytes
            decode_into(data, frame, out, 0)
            same = checksum(out) == checksum(raw)
    finally:
        pool.give(whole)
    if not same:
        raise FormatError("an encoded object does not decode to its raw bytes (codec fault)")


@contextlib.contextmanager
def staging(work: Work, names: set[str]) -> Iterator[Staged]:
    """Register an intent naming ``names``, then give the dict that :meth:`Work.stage`
    fills; on any error what is staged there is discarded, and the intent goes in any
    case (what is published stays).

    Example:
        >>> with staging(work, {digest}) as staged:
        ...     work.stage(digest, parts, old, staged, raw)
        ...     work.publish(staged)
    """
    intent = begin(work.store, names, gc_wait=3600.0)
    staged: Staged = {}
    try:
        yield staged
    except BaseException:
        work.store.discard({object_key(d): t for d, (t, _, _) in staged.items()})
        raise
    finally:
        release(work.store, [intent])


def to_full(
    work: Work,
    digest: str,
    nbytes: int,
    itemsize: int,
    where: str,
    staged: dict[str, Any],
    pays: float = PAYS,
) -> bool:
    """Make ``digest`` a full object (compressed from raw bytes or a delta, if that is at
    most ``pays`` of them, else raw) if it is not; whether it was a delta (then publish
    before anything names it as a base)."""
    found = _head(work.store, digest)
    if found is None:
        return False  # a gc holds it, or it is gone: nothing to rewrite
    size, frame = found
    if frame is not None and frame.base is None:
        return False  # a full frame already
    if frame is None and size != nbytes:
        return False  # not an object of this size: the load reports it
    tried = (work.store.url, digest)
    if frame is None and _STAYS_RAW.get(tried, 0.0) >= pays:
        # Found not to pay before: a frozen backbone shared by every save is not read,
        # hashed and compressed again by each save's compaction.
        return False
    try:
        raw = work.raw(digest, nbytes, where)
    except Damaged:
        return False
    parts = encode_full(raw, itemsize, work.storage.codec, pays=pays)
    if frame is None and size_of(parts) >= size:
        if len(_STAYS_RAW) >= _STAYS_RAW_MAX:
            _STAYS_RAW.clear()
        _STAYS_RAW[tried] = pays
        return False  # raw, and compression does not pay
    work.stage(digest, parts, size, staged, raw)
    work.report.full += 1
    return frame is not None


def to_delta(
    work: Work,
    digest: str,
    base: str,
    nbytes: int,
    itemsize: int,
    where: str,
    base_where: str,
    staged: dict[str, Any],
    *,
    onto_chain: bool = False,
) -> bool:
    """Make ``digest`` a delta on ``base`` if that is smaller; whether it was handled.
    ``where`` and ``base_where`` name the checkpoint and tensor of each, for reports.
    ``onto_chain``: the caller checked that ``base``'s chain is short enough and never
    reaches ``digest``, so ``base`` may be a delta itself."""
    found, found_base = _head(work.store, digest), _head(work.store, base)
    if found is None or found_base is None:
        return False
    size, frame = found
    if frame is not None and frame.base == base:
        return True  # done by an earlier compaction
    if not onto_chain and found_base[1] is not None and found_base[1].base is not None:
        return False  # the base is itself a delta: a chain through it could cycle
    codec = work.storage.codec
    assert codec is not None
    try:
        raw = work.raw(digest, nbytes, where)
        base_raw = work.raw(base, nbytes, base_where)
    except Damaged:
        return digest in work.bad  # damaged: left as it is
    if not delta_wins(codec, raw, base_raw, itemsize):
        return False
    parts = encode_delta(raw, base_raw, base, itemsize, codec)
    full_size = size if frame is not None and frame.base is None else None
    if size_of(parts) > 0.95 * nbytes or (full_size is not None and size_of(parts) >= full_size):
        return False
    work.stage(digest, parts, size, staged, raw, base_raw)
    work.report.deltas += 1
    return True
