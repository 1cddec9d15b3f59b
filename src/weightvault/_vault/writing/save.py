"""What :meth:`weightvault.Vault.save` does around the commit protocol of :mod:`.commit`.

From a model's sources to a committed record: plan the stored tensors (ties and copies
found, as for a single file), hash each one once on every core, commit through
:mod:`.commit`, and write the record: the header the checkpoint would have as one file,
with the xxh3 checksum of every tensor, which loads check. Objects are written as their
raw bytes, the least work a commit needs: the compactor (:mod:`.compact`) compresses
them, and turns the previous checkpoint's into deltas against them, after the commit.

Checksums cost a pass over the bytes, so they are known by object: a present object's
checksum comes from this process's earlier saves (:class:`Checksums`) or, in its first
save, from the newest records. Other objects are checksummed right after they are
hashed, while their bytes are still in the CPU's caches (in the first save, which reads
the records only once the objects are written, they are checksummed as they are
written, a second pass).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..._base.errors import CheckpointNotFoundError, FormatError
from ..._base.pools import each, each_grouped, workers
from ..._file.header import TensorInfo, encode_header
from ..._file.layout import with_training
from ..._file.manifest import MANIFEST_KEY
from ..._file.sharing import Plan, Source, Stored, plan
from ..._file.writer import layout
from ..objects.address import checksum, content_hash, is_temp
from ..objects.encoding import Encoder
from ..records.checkpoint import VaultCheckpoint
from ..records.reading import read_doc
from ..records.record import VERSION, CheckpointRecord, parse_record
from ..records.todo import mark
from ..store import pack as _pack
from ..store.backend import Store
from ..store.pack import PackWriter
from .commit import begin, commit_record, release, store_missing

__all__ = ["SUM_RECORDS", "Checksums", "Progress", "save_sources"]

#: How many of the newest checkpoint records a save reads to find the checksums of
#: objects the vault already holds; an object none of them names is checksummed again.
SUM_RECORDS = 4

Progress = Callable[[int], None]
Placed = list[tuple[Stored, TensorInfo]]


class Checksums(dict[str, str]):
    """``{blake3 object name: xxh3 checksum}`` of every object a vault instance has seen.

    The checksum is a function of the bytes the name is the hash of, so it never goes
    stale, whatever gc or other writers do to the vault. ``consulted`` says whether the
    records were read for it yet: until then a save leaves the checksums it lacks to
    :meth:`learn`, since a resumed run (a new instance) finds most there.
    """

    consulted: bool = False

    def learn(self, store: Store, wanted: Iterable[str]) -> None:
        """Add what the newest records say about the ``wanted`` objects.

        A record is as trusted as the objects it names: a load checks the same
        checksums. A wrong one here makes the new checkpoint fail its load checks, it
        never hides damage. Unreadable records are skipped (the object is then
        checksummed again).
        """
        wanted = set(wanted) - set(self)
        if not wanted:
            return
        blobs = [
            b for b in store.list("checkpoints") if b.key.endswith(".json") and not is_temp(b.key)
        ]
        blobs.sort(key=lambda b: b.mtime, reverse=True)
        for blob in blobs[:SUM_RECORDS]:
            name = blob.key.rsplit("/", 1)[-1].removesuffix(".json")
            try:
                ckpt = VaultCheckpoint(store, name, read_doc(store, name))
            except (FormatError, CheckpointNotFoundError):
                continue
            for stored, digest in ckpt.objects.items():
                known = ckpt.manifest.sums.get(stored)
                if digest in wanted and known is not None:
                    self[digest] = known
                    wanted.discard(digest)
            if not wanted:
                return


def _address(
    pool: ThreadPoolExecutor,
    placed: Placed,
    sums: Checksums,
    progress: Progress | None,
    writer: PackWriter | None = None,
    fingerprints: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """Every stored tensor's object name: each byte is hashed exactly once, on all cores.

    No tensor is skipped as "unchanged": a version counter misses writes made through
    ``.data``, so only the bytes themselves can say whether a tensor changed. An object
    whose checksum is not known yet is checksummed right after its hash, while its bytes
    are still in the CPU's caches: a second pass when it is written read them all from
    memory again. The first save of a :class:`Checksums` leaves that to :func:`_store`
    (which checksums what it writes) and :func:`_checksum_rest` (the newest records, for
    the objects the vault holds).

    With a ``writer``, an object under :data:`~.pack.PACK_OBJECT` bytes that this vault
    instance has not seen before is written into its pack right after its hash, while
    its bytes are in the caches: the one pass over them a save needs besides the hash.
    A tensor the plan ``fingerprints`` whole already has its checksum (the same xxh3).
    """
    prints = fingerprints or {}
    stored = [s for s, _ in placed]
    done = (lambda s: progress(s.nbytes)) if progress else None
    now = sums.consulted

    def both(s: Stored) -> str:
        view = memoryview(s.data()).cast("B")
        digest = content_hash(view)
        if now and digest not in sums:
            if writer is not None and view.nbytes < _pack.PACK_OBJECT:
                writer.add(digest, view)
            known = prints.get(s.name)
            sums[digest] = checksum(view) if known is None else f"{known:016x}"
        return digest

    hashes = each_grouped(pool, both, stored, lambda s: s.nbytes, done)
    return {s.name: h for s, h in zip(stored, hashes, strict=True)}


def _checksum_rest(
    store: Store,
    pool: ThreadPoolExecutor,
    placed: Placed,
    digests: Mapping[str, str],
    sums: Checksums,
) -> None:
    """Learn the checksums :func:`_address` left out: from the newest records, else by a
    pass over the bytes."""
    first: dict[str, Stored] = {}
    for s, _ in placed:
        first.setdefault(digests[s.name], s)
    sums.learn(store, first)
    sums.consulted = True
    unknown = [d for d in first if d not in sums]
    for digest, value in zip(
        unknown, each(pool, lambda d: checksum(first[d].data()), unknown), strict=True
    ):
        sums[digest] = value


def _store(
    store: Store,
    pool: ThreadPoolExecutor,
    placed: Placed,
    digests: Mapping[str, str],
    sums: Checksums,
    encoder: Encoder,
    progress: Progress | None = None,
    *,
    packs: list[str] | None = None,
    writer: PackWriter | None = None,
) -> tuple[int, int]:
    """Write the objects the vault lacks, the small ones into a pack; return the new raw
    bytes and the bytes their files hold. Checksums :func:`_address` left out are taken
    as the objects are written.

    A ``progress`` with a ``phase`` method (the bar of ``save(progress=True)``) then
    counts the raw bytes compressed and written, from zero; a plain callable hears only
    the hashing.
    """
    first: dict[str, Stored] = {}
    for s, _ in placed:
        first.setdefault(digests[s.name], s)

    def wrote(digest: str, data: memoryview | bytes) -> None:
        if digest not in sums:  # a first save: the bytes just written, read once
            sums[digest] = checksum(data)

    phase = getattr(progress, "phase", None)  # a bar counts the writing from zero

    def writing(missing: Sequence[str]) -> None:
        if phase is not None:
            label = str(getattr(progress, "label", "saving")).split(":")[0]
            phase(f"{label}: writing", sum(first[d].nbytes for d in missing))

    def written(digest: str) -> None:
        if phase is not None and progress is not None:
            progress(first[digest].nbytes)

    new = store_missing(
        store,
        {d: (s.nbytes, s.data) for d, s in first.items()},
        pool=pool,
        wrote=wrote,
        encoder=encoder,
        writing=writing,
        written=written,
        pack=True,
        packs=packs,
        writer=writer,
    )
    return sum(first[d].nbytes for d in new), sum(new.values())


def _record_doc(
    p: Plan,
    placed: Placed,
    digests: Mapping[str, str],
    sums: Mapping[str, str],
    framework: str | None,
    metadata: Mapping[str, str] | None,
    new_bytes: int,
) -> dict[str, Any]:
    # The same fast checksums a single file carries: what load(verify=True) checks.
    manifest = p.manifest(
        dict(metadata or {}), sums={s.name: sums[digests[s.name]] for s, _ in placed}
    )
    meta = {"format": framework} if framework else {}
    meta[MANIFEST_KEY] = manifest.encode()
    header = encode_header([info for _, info in placed], meta)[8:].decode("utf-8")
    return {
        "version": VERSION,
        "created": time.time(),
        "framework": framework,
        "metadata": dict(metadata or {}),
        "logical_bytes": p.logical_bytes,
        "stored_bytes": p.stored_bytes,
        "new_bytes": new_bytes,
        "tensors": len(p.names),
        "header": header.rstrip(" "),
        "objects": {s.name: digests[s.name] for s, _ in placed},
    }


def save_sources(
    store: Store,
    sources: list[Source],
    training: dict[str, Any] | None,
    *,
    name: str | None,
    framework: str | None,
    metadata: Mapping[str, str] | None,
    progress: Progress | None,
    sums: Checksums,
    gc_wait: float,
    to_compact: bool = False,
) -> CheckpointRecord:
    """Commit ``sources`` (and ``training``'s section) as one checkpoint; with
    ``to_compact``, leave it to the compactor (:func:`~.todo.mark`).

    Raises:
        CheckpointExistsError: Another writer took ``name`` first.
        VaultBusyError: A gc kept running for ``gc_wait`` seconds.
    """
    p = with_training(plan(sources), training)
    placed = layout(p.stored)
    pool = workers()
    # From a vault instance's second save on, what it has not seen is new: written into
    # the save's pack as it is hashed (the first save, as a resumed run's, finds most of
    # its objects in the vault, and would write them for nothing).
    writer = PackWriter(store) if store.local and sums.consulted else None
    try:
        digests = _address(pool, placed, sums, progress, writer, p.fingerprints)
        intent = begin(store, digests.values(), gc_wait=gc_wait)
        try:
            # Raw bytes: compression and deltas are the compactor's, after the commit.
            # Small new objects go into one pack file, which the compactor takes apart
            # (without compression too, as soon as the save has committed).
            packs: list[str] = []
            new_bytes, written = _store(
                store, pool, placed, digests, sums, Encoder(), progress,
                packs=packs, writer=writer,
            )  # fmt: skip
            _checksum_rest(store, pool, placed, digests, sums)
            doc = _record_doc(p, placed, digests, sums, framework, metadata, new_bytes)
            doc["written_bytes"] = written
            if packs:
                doc["packs"] = packs  # whose packs they are: the compactor leaves the newest's
            name = commit_record(store, doc, name)
            if to_compact:
                # A crash just here leaves the checkpoint raw (loadable, only larger), and
                # the next checkpoint's compaction still encodes its objects.
                mark(store, name)
        finally:
            release(store, [intent])
    finally:
        if writer is not None:
            writer.discard()  # a no-op once published; a failed save leaves nothing
    return parse_record(name, doc, name)
