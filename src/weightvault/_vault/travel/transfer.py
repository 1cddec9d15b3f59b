"""Moving checkpoints between vaults: push and pull, sending only what the receiver lacks.

A transfer copies checkpoint records from a source vault to a receiving one, and before
each record every object it needs that the receiver does not hold. Both vaults name an
object by the blake3 of its raw bytes, so "the receiver holds it" is one lookup, and an
object is sent as its file is stored (raw bytes, a compressed frame, or a delta on a base
the receiver then needs too): nothing is decoded and encoded again, with one exception.

**Long chains.** An older checkpoint's changed tensor is a delta on the next one's, and
so on up to a full object (see :mod:`.compact`). Pulled alone, it would bring every link.
When the links of an object's chain that no checkpoint being sent names and the
receiver lacks add up to more than the tensor's raw size, the object is sent **whole**
instead: decoded on the sender, its blake3 checked, compressed as the compactor would a
newest object. So a checkpoint pulled alone costs about what it would cost saved alone.

**What the receiver is guaranteed.** The receiving side follows the commit protocol of
:mod:`.commit`, as a save does:

1. An intent naming every object the transfer will reference is written first, before
   the receiver is asked what it holds; bases found while following chains are added to
   it (it is rewritten, never absent) before they are looked up, and it is rewritten
   after every batch so it never ages into one gc expires. A gc on the receiver
   therefore frees nothing the transfer relies on (:mod:`.gc`).
2. Every object is checked before it is written: its file, exactly as it will be
   stored, decoded (a delta on its base's raw bytes) and hashed against its name. A
   damaged source object is reported, not sent, and no checkpoint needing it is
   committed.
3. Objects are written durable and **never replace** an object the receiver holds (an
   exclusive link on a local disk, ``If-None-Match`` on S3): the receiver's own encoding
   of a name, and the chains its compactor built on it, stay as they are.
4. The record is created last, exclusively, once everything it needs is durable. A
   name the receiver already has is left alone when it is the same checkpoint (the same
   record, or one a retention made weights-only on either side), and refused with
   :class:`~weightvault.CheckpointExistsError` otherwise: never overwritten.
5. A checkpoint whose objects arrived raw is left to the receiver's compactor
   (``compact/<name>.todo``), as a save leaves it.

Killed at any moment, a transfer leaves committed checkpoints that load, objects no
record names yet (which a rerun reuses, and gc frees once the intent is an hour old),
and nothing else. DCP checkpoints travel the same way: their records name every chunk and
chunk table, all of them objects.

Example:
    >>> report = transfer(local.store, open_store("s3://bucket/run1"), None)
    >>> report.bytes_sent <= report.bytes_sent + report.bytes_skipped
    True
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..._base.atomic import batch_sync_ok, sync_paths
from ..._base.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    FormatError,
    SourceDamagedError,
)
from ..objects.access import (
    content_hash,
    is_temp,
    object_file,
    object_frame,
    object_key,
    read_object,
)
from ..objects.codec import CODECS, DEFAULT, Codec
from ..objects.encoding import Parts, encode_full, size_of, stored_depth
from ..objects.frame import HEADER_SIZE, Frame, is_frame, parse_frame_header
from ..records.checkpoint import open_record
from ..records.intents import encode_intent
from ..records.record import check_name, read_doc, record_key, record_names, resolve
from ..records.todo import mark
from ..store.backend import Store
from ..store.identity import holds_vault, require_vault
from ..store.pack import pack_table
from ..writing.commit import begin, commit_record, each, release, workers

__all__ = ["BATCH_BYTES", "TransferReport", "transfer"]

#: File bytes read from the source and checked before they are written as one batch.
BATCH_BYTES = 64 << 20

Progress = Callable[[int], None]


@dataclass
class TransferReport:
    """What a push or pull did.

    Attributes:
        checkpoints: The checkpoints asked for that the receiver now holds, oldest first.
        committed: Those this transfer committed (the others were there already).
        objects_sent: Objects written to the receiver.
        bytes_sent: Their file bytes: the payload that moved.
        bytes_skipped: File bytes (on the source) of objects the checkpoints need that
            the receiver already held, so were not sent.
        whole: Objects sent whole instead of as a long delta chain (see the module).
        marked: Checkpoints left to the receiver's compactor (objects arrived raw).
        damaged: One line per damaged source object or record (nothing of it was sent).
        seconds: Wall time.
    """

    checkpoints: list[str] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)
    objects_sent: int = 0
    bytes_sent: int = 0
    bytes_skipped: int = 0
    whole: int = 0
    marked: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Checkpoint:
    """One source checkpoint to send: its record and the objects it names."""

    name: str
    doc: dict[str, Any]
    created: float
    objects: dict[str, str]  # label -> digest
    sizes: dict[str, int]  # label -> raw bytes


def _check_receiver(store: Store) -> None:
    """Refuse a receiver that holds something other than a vault.

    Raises:
        FormatError: It is a file, another ``vault.json``, or a folder of other files.
    """
    if holds_vault(store):
        return
    others = [b.key for b in store.list("")][:4]
    if others:
        raise FormatError(
            f"{store.url}: holds other data ({', '.join(others)}), not a vault; push into "
            "an empty folder, a new prefix, or an existing vault"
        )


def _wanted(store: Store, names: Sequence[str] | None) -> list[str]:
    """The checkpoint names asked for (``latest`` resolved), each checked to exist."""
    if names is None:
        return record_names(store)
    out: list[str] = []
    for name in names:
        resolved = resolve(store, check_name(name, store.url, latest=True))
        if not store.exists(record_key(resolved)):
            read_doc(store, resolved)  # raises CheckpointNotFoundError, naming what exists
        if resolved not in out:
            out.append(resolved)
    return out


def _open(store: Store, name: str) -> _Checkpoint:
    """Checkpoint ``name`` of ``store`` with the objects it names.

    Raises:
        FormatError: Its record is damaged or of an unknown version.
        CheckpointNotFoundError: It was deleted meanwhile.
    """
    doc = read_doc(store, name)
    with open_record(store, name, doc) as ckpt:
        objects = dict(ckpt.objects)
        sizes = {label: ckpt.object_nbytes(label) for label in objects}
        return _Checkpoint(name, doc, ckpt.record.created, objects, sizes)


def _same(a: _Checkpoint, b: _Checkpoint) -> bool:
    """Whether ``a`` and ``b`` are one checkpoint: the same record, or one of them made
    weights-only by a retention (same creation, its objects a subset of the other's).
    Labels do not count: a mark moves without changing the checkpoint."""
    if _unlabelled(a.doc) == _unlabelled(b.doc):
        return True
    if a.created != b.created:
        return False
    small, big = (a, b) if a.doc.get("weights_only") is True else (b, a)
    if small.doc.get("weights_only") is not True:
        return False
    return small.objects.items() <= big.objects.items()


def _unlabelled(doc: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "labels"}


def _listed(store: Store) -> dict[str, int]:
    """``{digest: file size}`` of every object in ``store``'s ``objects/`` and packs
    (one listing of each; a packed object's file is its raw bytes)."""
    out = {}
    table = pack_table(store)
    table.refresh(store)
    for index in table.packs().values():
        out.update({d: p.size for d, p in index.items()})
    for blob in store.list("objects"):
        if not is_temp(blob.key):
            out[blob.key.rsplit("/", 1)[-1]] = blob.size
    return out


class _Plan:
    """What to send: the receiver's holdings, each missing object's frame, and which
    objects go whole. Built after the receiver's intent is visible."""

    def __init__(self, source: Store, dest: Store, intent: str, tops: Mapping[str, int]):
        self.source, self.dest, self.intent = source, dest, intent
        self.sizes = dict(tops)  # digest -> raw bytes, for everything named so far
        self.tops = set(tops)
        self.src_files = _listed(source)
        self.have: set[str] = set()
        self.frames: dict[str, Frame | None] = {}
        self.whole: set[str] = set()
        self._present(list(tops))
        self._walk([d for d in tops if d not in self.have])
        self._choose()

    def named(self) -> list[str]:
        """Every object the transfer may reference (what its intent names)."""
        return sorted(self.sizes)

    def refresh(self) -> None:
        """Rewrite the intent with everything named so far (and a fresh time)."""
        self.dest.put(self.intent, encode_intent(self.named(), time.time()))

    def file_size(self, digest: str) -> int:
        size = self.src_files.get(digest)
        if size is None:  # in a gc's trash on the source, or gone
            frame = self.frames.get(digest)
            size = self.sizes.get(digest, 0) if frame is None else frame.raw_size
        return size

    def _present(self, digests: list[str]) -> None:
        """Add to :attr:`have` what the receiver holds in ``objects/`` as an object of
        the right raw size; only ever called once the intent names ``digests``."""
        listed = _listed(self.dest)
        unsure = [d for d in digests if d in listed and listed[d] != self.sizes[d]]
        depths = each(workers(), lambda d: stored_depth(self.dest, d, self.sizes[d]), unsure)
        self.have |= {d for d in digests if listed.get(d) == self.sizes[d]}
        self.have |= {d for d, depth in zip(unsure, depths, strict=True) if depth is not None}

    def _walk(self, level: list[str]) -> None:
        """Read the source frame of each missing object, level by level down its chain,
        until a link the receiver holds, one being sent anyway, or a full object."""
        for _ in range(64 + 1):  # a chain longer than a reader follows is refused later
            if not level:
                return
            frames = each(workers(), lambda d: object_frame(self.source, d), level)
            found = []
            for digest, frame in zip(level, frames, strict=True):
                self.frames[digest] = frame
                if frame is not None and frame.base is not None and frame.base not in self.sizes:
                    self.sizes[frame.base] = frame.raw_size
                    found.append(frame.base)
            if found:
                self.refresh()  # named before the receiver is asked about them
                self._present(found)
            level = [d for d in found if d not in self.have]

    def extra(self, digest: str) -> list[str]:
        """The links of ``digest``'s chain that only it needs: named by no checkpoint
        being sent, and missing on the receiver."""
        out, seen = [], {digest}
        frame = self.frames.get(digest)
        while frame is not None and frame.base is not None:
            base = frame.base
            if base in self.tops or base in self.have or base in seen:
                break
            out.append(base)
            seen.add(base)
            frame = self.frames.get(base)
        return out

    def _choose(self) -> None:
        """Send whole each missing delta whose own extra links outweigh its raw size."""
        for digest in self.tops - self.have:
            links = self.extra(digest)
            if links and sum(self.file_size(d) for d in [digest, *links]) > self.sizes[digest]:
                self.whole.add(digest)

    def closure(self, ckpt: _Checkpoint, sent: set[str]) -> list[str]:
        """What ``ckpt`` still needs sent, every base before the delta built on it."""
        out: list[str] = []
        seen: set[str] = set()

        def visit(digest: str) -> None:
            if digest in self.have or digest in sent or digest in seen:
                return
            seen.add(digest)
            frame = self.frames.get(digest)
            if digest not in self.whole and frame is not None and frame.base is not None:
                visit(frame.base)
            out.append(digest)

        for digest in sorted(set(ckpt.objects.values())):
            visit(digest)
        return out


def _fetch(store: Store, digests: list[str]) -> dict[str, bytes | memoryview]:
    """The files of ``digests`` on the source, wherever a gc holds them; missing ones are
    left out (the check reports them)."""
    out: dict[str, bytes | memoryview] = {}
    rest = list(digests)
    if not store.local and rest:
        with contextlib.suppress(FileNotFoundError):
            got = store.get_many([object_key(d) for d in rest])
            out = {k.rsplit("/", 1)[-1]: v for k, v in got.items()}
            rest = []
    for digest in rest:
        with contextlib.suppress(FileNotFoundError):
            out[digest] = object_file(store, digest)
    return out


def _check(source: Store, digest: str, nbytes: int, data: bytes | memoryview) -> str | None:
    """What is wrong with ``data`` as the file of object ``digest``, or ``None``: it is
    decoded as a reader of the receiver would (a delta on its base's raw bytes, read
    from the source by name) and hashed."""
    try:
        raw = read_object(source, digest, nbytes, files={digest: data})
    except FileNotFoundError:
        return "its delta base is missing"
    except FormatError as e:
        return str(e)
    if raw.nbytes != nbytes or content_hash(raw) != digest:
        return "its bytes do not match its name (blake3)"
    return None


def _whole(source: Store, digest: str, nbytes: int, frame: Frame | None, codec: Codec) -> Parts:
    """Object ``digest`` as one full object, from its raw bytes on the source (checked).

    Raises:
        FormatError: Its chain does not decode, or its bytes do not match its name.
    """
    try:
        raw = read_object(source, digest, nbytes)
    except FileNotFoundError:
        raise FormatError("it is missing") from None
    if content_hash(raw) != digest:
        raise FormatError("its bytes do not match its name (blake3)")
    parts = encode_full(raw, frame.itemsize if frame is not None else 4, codec)
    # Checked as every sent file is: a codec fault must not reach the receiver.
    why = _check(source, digest, nbytes, b"".join(parts))
    if why is not None:
        raise FormatError(f"encoded whole, {why}")
    return parts


def _write_new(dest: Store, files: Mapping[str, Parts], raw: Mapping[str, int]) -> dict[str, int]:
    """Write ``files`` (``{digest: parts}``, standing for ``raw[digest]`` bytes) durably,
    never replacing an object the receiver holds; return ``{digest: bytes}`` of those
    this call created."""
    if not files:
        return {}
    if not dest.local:
        # Each conditional PUT is durable and whole on its own (If-None-Match: *).
        def put(item: tuple[str, Parts]) -> int:
            digest, parts = item
            created = dest.put(object_key(digest), b"".join(parts), exclusive=True)
            return size_of(parts) if created else -1

        sizes = each(workers(), put, list(files.items()))
        return {d: n for d, n in zip(files, sizes, strict=True) if n >= 0}
    staged = {object_key(d): dest.stage(object_key(d), parts) for d, parts in files.items()}
    created: dict[str, int] = {}
    root = dest.local_path("")
    assert root is not None
    try:
        nbytes = sum(size_of(p) for p in files.values())
        batch = batch_sync_ok(nbytes)
        sync_paths(root, staged.values(), batch=batch)  # durable before any name shows it
        for digest, parts in files.items():
            key = object_key(digest)
            final = dest.local_path(key)
            assert final is not None
            try:
                os.link(staged[key], final)  # never replaces what is there
                created[digest] = size_of(parts)
            except FileExistsError:
                if stored_depth(dest, digest, raw[digest]) is None:
                    os.replace(staged[key], final)  # what is there is no such object
                    created[digest] = size_of(parts)
        folders = {os.path.dirname(dest.local_path(object_key(d)) or "") for d in created}
        sync_paths(root, folders, batch=batch and len(folders) > 1)
    finally:
        dest.discard(staged)
    return created


def transfer(
    source: Store,
    dest: Store,
    names: Sequence[str] | None = None,
    *,
    progress: Progress | None = None,
    gc_wait: float = 600.0,
    codec: Codec | None = None,
    pause: Callable[[], None] | None = None,
) -> TransferReport:
    """Send checkpoints ``names`` (all by default) from ``source`` to ``dest``, with only
    the objects ``dest`` lacks (see the module docstring for what ``dest`` is promised).

    Args:
        source: The sending vault's store.
        dest: The receiving vault's store; made a vault if it is empty.
        names: Checkpoint names (``latest`` allowed), or ``None`` for every checkpoint.
        progress: Called with the file bytes of each object written. One with a
            ``phase(label, total)`` method (a progress bar) is told the total first.
        gc_wait: How long to wait for a gc running on ``dest``.
        codec: How objects sent whole are compressed (blosc2 by default).
        pause: Called before each batch of objects; it may block (a mirror waits there
            while the sending vault saves or loads, so training never waits for it).

    Returns:
        What was sent and what the receiver now holds.

    Raises:
        VaultNotFoundError: ``source`` holds no vault.
        FormatError: Either side is not a vault of a format version this code knows, or
            ``dest`` holds other data.
        CheckpointNotFoundError: A name in ``names`` is not on ``source``.
        CheckpointExistsError: ``dest`` holds a different checkpoint of one of the names.
        SourceDamagedError: Some source objects or records are damaged: the checkpoints
            that need them were not sent (the others were); ``.report`` says what was.
    """
    start = time.monotonic()
    report = TransferReport()
    if source.url == dest.url:
        raise ValueError(f"{source.url}: a vault cannot be pushed to itself")
    require_vault(source)
    _check_receiver(dest)
    wanted = _wanted(source, names)

    todo: list[_Checkpoint] = []
    present: list[_Checkpoint] = []
    opened: list[_Checkpoint] = []
    for name in wanted:
        try:
            ckpt = _open(source, name)
        except CheckpointNotFoundError:
            continue  # deleted on the source meanwhile
        except FormatError as e:
            report.damaged.append(f"{name}: {e}")
            continue
        opened.append(ckpt)
        (present if _already(dest, ckpt) else todo).append(ckpt)
    report.checkpoints = [c.name for c in present]
    # Newest first: older checkpoints' deltas are built on newer ones' objects, which
    # are then on the receiver already.
    todo.sort(key=lambda c: (c.created, c.name), reverse=True)

    tops: dict[str, int] = {}
    for ckpt in todo:
        for label, digest in ckpt.objects.items():
            tops[digest] = ckpt.sizes[label]
    intent = begin(dest, tops, gc_wait=gc_wait)
    try:
        plan = _Plan(source, dest, intent, tops)
        # What the receiver held: objects of checkpoints it had, and of those sent.
        skipped = {d for c in present for d in c.objects.values()}
        skipped |= {d for c in todo for d in c.objects.values() if d in plan.have}
        report.bytes_skipped = sum(plan.file_size(d) for d in skipped)
        _sending(progress, plan, todo)
        _send(plan, todo, report, progress, codec or CODECS[DEFAULT], pause)
    finally:
        release(dest, [intent])
    created = {c.name: (c.created, c.name) for c in opened}
    report.checkpoints.sort(key=created.__getitem__)
    report.committed.sort(key=created.__getitem__)
    report.seconds = time.monotonic() - start
    if report.damaged:
        raise SourceDamagedError(
            f"{source.url}: {len(report.damaged)} damaged object(s) or record(s), so "
            f"{len(wanted) - len(report.checkpoints)} checkpoint(s) were not sent (the "
            f"others were): {report.damaged[0]}; run 'weightvault vault {source.url} "
            "verify'",
            report,
        )
    return report


def _already(dest: Store, ckpt: _Checkpoint) -> bool:
    """Whether ``dest`` holds checkpoint ``ckpt`` already.

    Raises:
        CheckpointExistsError: It holds another checkpoint of that name.
    """
    if not dest.exists(record_key(ckpt.name)):
        return False
    try:
        theirs = _open(dest, ckpt.name)
    except CheckpointNotFoundError:
        return False  # deleted meanwhile
    except FormatError as e:
        raise CheckpointExistsError(
            f"{dest.url}: checkpoint {ckpt.name!r} exists there with a damaged record "
            f"({e}); delete it there first"
        ) from e
    if _same(ckpt, theirs):
        return True
    raise CheckpointExistsError(
        f"{dest.url}: checkpoint {ckpt.name!r} exists there with other content; delete it "
        "there first, or send the others by name"
    )


def _sending(progress: Progress | None, plan: _Plan, todo: Iterable[_Checkpoint]) -> None:
    """Tell a progress bar how many bytes are about to be sent (an estimate: objects sent
    whole count their raw size)."""
    phase = getattr(progress, "phase", None)
    if phase is None:
        return
    sent: set[str] = set()
    total = 0
    for ckpt in todo:
        for digest in plan.closure(ckpt, sent):
            sent.add(digest)
            total += plan.sizes[digest] if digest in plan.whole else plan.file_size(digest)
    phase(str(getattr(progress, "label", "sending")), total)


def _send(
    plan: _Plan,
    todo: list[_Checkpoint],
    report: TransferReport,
    progress: Progress | None,
    codec: Codec,
    pause: Callable[[], None] | None = None,
) -> None:
    """Send each checkpoint's missing objects, bases first, in checked batches, then
    commit its record."""
    sent: set[str] = set()
    bad: dict[str, str] = {}
    for ckpt in todo:
        needed = plan.closure(ckpt, sent)
        raw_arrived = False
        batch: list[str] = []
        batch_bytes = 0
        for digest in [*needed, None]:
            if digest is not None and digest not in bad:
                batch.append(digest)
                batch_bytes += plan.file_size(digest)
            if batch and (digest is None or batch_bytes >= BATCH_BYTES):
                if pause is not None:
                    pause()
                raw_arrived |= _send_batch(plan, ckpt, batch, bad, report, progress, codec)
                sent.update(d for d in batch if d not in bad)
                plan.refresh()  # the intent never ages into one gc expires
                batch, batch_bytes = [], 0
        lost = [d for d in needed if d in bad]
        if lost:
            continue
        _commit(plan.dest, ckpt, report)
        if raw_arrived:
            mark(plan.dest, ckpt.name)
            report.marked.append(ckpt.name)


def _send_batch(
    plan: _Plan,
    ckpt: _Checkpoint,
    batch: list[str],
    bad: dict[str, str],
    report: TransferReport,
    progress: Progress | None,
    codec: Codec,
) -> bool:
    """Check and write one batch; whether any object arrived raw."""
    source = plan.source
    stored = [d for d in batch if d not in plan.whole]
    files = _fetch(source, stored)
    labels = {d: label for label, d in ckpt.objects.items()}

    def prepare(digest: str) -> Parts | None:
        where = f"{source.url}/{object_key(digest)}"
        if digest in labels:
            where += f" ({ckpt.name}: {labels[digest]!r})"
        nbytes = plan.sizes[digest]
        try:
            if digest in plan.whole:
                return _whole(source, digest, nbytes, plan.frames.get(digest), codec)
            data = files.get(digest)
            why = "it is missing" if data is None else _check(source, digest, nbytes, data)
            if why is None and data is not None:
                frame = plan.frames.get(digest)
                if _base_of(data, nbytes) != (frame.base if frame is not None else None):
                    # Its source's compactor re-encoded it since it was planned: its new
                    # base is not named by the intent, so it goes whole.
                    return _whole(source, digest, nbytes, frame, codec)
                return [data]
        except FormatError as e:
            why = str(e)
        bad[digest] = f"{where}: {why}"
        report.damaged.append(bad[digest])
        return None

    prepared = each(workers(), prepare, batch)
    files_out = {d: p for d, p in zip(batch, prepared, strict=True) if p is not None}
    written = _write_new(plan.dest, files_out, plan.sizes)
    raw = False
    for digest, nbytes in written.items():
        report.objects_sent += 1
        report.bytes_sent += nbytes
        report.whole += digest in plan.whole
        raw |= nbytes == plan.sizes[digest]  # a frame is never as long as its raw bytes
        if progress is not None:
            progress(nbytes)
    return raw


def _base_of(data: bytes | memoryview, nbytes: int) -> str | None:
    """The delta base file ``data`` names, or ``None`` for raw bytes or a full frame."""
    view = memoryview(data).cast("B")
    if not is_frame(view) or view.nbytes == nbytes:
        return None
    return parse_frame_header(view[:HEADER_SIZE]).base


def _commit(dest: Store, ckpt: _Checkpoint, report: TransferReport) -> None:
    """Create ``ckpt``'s record on ``dest`` (its objects are durable there)."""
    try:
        commit_record(dest, ckpt.doc, ckpt.name)
    except CheckpointExistsError:
        # Another transfer (or a save) took the name between our check and now.
        if not _already(dest, ckpt):
            raise
        report.checkpoints.append(ckpt.name)
        return
    report.checkpoints.append(ckpt.name)
    report.committed.append(ckpt.name)
