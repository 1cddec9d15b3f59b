"""Moving checkpoints between vaults: push and pull, sending only what the receiver lacks.

A transfer copies checkpoint records from a source vault to a receiving one, and before
each record every object it needs that the receiver does not hold. Both vaults name an
object by the blake3 of its raw bytes, so "the receiver holds it" is one lookup, and an
object is sent as its file is stored (raw bytes, a compressed frame, or a delta on a base
the receiver then needs too): nothing is decoded and encoded again, with one exception.

**Deltas whose anchor does not travel.** A checkpoint's changed tensor is usually a delta
on its anchor, a whole object of an older checkpoint (see :mod:`..upkeep.compact`); a
vault chained by an older compactor holds longer chains. Pulled alone, a delta would
bring its anchor (or every link) too. When the links that no checkpoint being sent names
and the receiver lacks add up to more than the tensor's raw size, the object is sent
**whole** instead: decoded on the sender, its blake3 checked, and stored as the compactor
stores a whole weight (raw, unless compression saves a quarter). So a checkpoint pulled
alone costs about what it would cost saved alone.

**What the receiver is guaranteed.** The receiving side follows the commit protocol of
:mod:`..writing.commit`, as a save does:

1. An intent naming every object the transfer will reference is written first, before
   the receiver is asked what it holds; bases found while following deltas are added to
   it (it is rewritten, never absent) before they are looked up, and it is rewritten
   after every batch so it never ages into one gc expires. A gc on the receiver
   therefore frees nothing the transfer relies on (:mod:`..upkeep.gc`).
2. Every object is checked before it is written: its file, exactly as it will be
   stored, decoded (a delta on its base's raw bytes) and hashed against its name. A
   damaged source object is reported, not sent, and no checkpoint needing it is
   committed.
3. Objects are written durable and **never replace** an object the receiver holds (an
   exclusive link on a local disk, ``If-None-Match`` on S3): the receiver's own encoding
   of a name, and the deltas its compactor built on it, stay as they are.
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

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..._base.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    FormatError,
    SourceDamagedError,
)
from ..._base.pools import each, workers
from ..objects.address import object_key
from ..objects.codec import CODECS, DEFAULT, Codec
from ..objects.encoding import Parts
from ..records.todo import mark
from ..store.backend import Store
from ..store.identity import require_vault
from ..writing.commit import begin, commit_record, release
from .deliver import write_new
from .plan import Plan
from .select import Checkpoint, already, check_receiver, open_checkpoint, wanted_names
from .send import fetch, prepare

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
    check_receiver(dest)
    wanted = wanted_names(source, names)

    todo: list[Checkpoint] = []
    present: list[Checkpoint] = []
    opened: list[Checkpoint] = []
    for name in wanted:
        try:
            ckpt = open_checkpoint(source, name)
        except CheckpointNotFoundError:
            continue  # deleted on the source meanwhile
        except FormatError as e:
            report.damaged.append(f"{name}: {e}")
            continue
        opened.append(ckpt)
        (present if already(dest, ckpt) else todo).append(ckpt)
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
        plan = Plan(source, dest, intent, tops)
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


def _sending(progress: Progress | None, plan: Plan, todo: Iterable[Checkpoint]) -> None:
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
    plan: Plan,
    todo: list[Checkpoint],
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
    plan: Plan,
    ckpt: Checkpoint,
    batch: list[str],
    bad: dict[str, str],
    report: TransferReport,
    progress: Progress | None,
    codec: Codec,
) -> bool:
    """Check and write one batch; whether any object arrived raw."""
    source = plan.source
    stored = [d for d in batch if d not in plan.whole]
    files = fetch(source, stored)
    labels = {d: label for label, d in ckpt.objects.items()}

    def checked(digest: str) -> Parts | None:
        try:
            return prepare(plan, digest, files.get(digest), codec)
        except FormatError as e:
            where = f"{source.url}/{object_key(digest)}"
            if digest in labels:
                where += f" ({ckpt.name}: {labels[digest]!r})"
            bad[digest] = f"{where}: {e}"
        report.damaged.append(bad[digest])
        return None

    prepared = each(workers(), checked, batch)
    files_out = {d: p for d, p in zip(batch, prepared, strict=True) if p is not None}
    written = write_new(plan.dest, files_out, plan.sizes)
    raw = False
    for digest, nbytes in written.items():
        report.objects_sent += 1
        report.bytes_sent += nbytes
        report.whole += digest in plan.whole
        raw |= nbytes == plan.sizes[digest]  # a frame is never as long as its raw bytes
        if progress is not None:
            progress(nbytes)
    return raw


def _commit(dest: Store, ckpt: Checkpoint, report: TransferReport) -> None:
    """Create ``ckpt``'s record on ``dest`` (its objects are durable there)."""
    try:
        commit_record(dest, ckpt.doc, ckpt.name)
    except CheckpointExistsError:
        # Another transfer (or a save) took the name between our check and now.
        if not already(dest, ckpt):
            raise
        report.checkpoints.append(ckpt.name)
        return
    report.checkpoints.append(ckpt.name)
    report.committed.append(ckpt.name)
