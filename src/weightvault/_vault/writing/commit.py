"""The commit protocol: how a checkpoint enters a vault, whole or not at all.

Every writer follows it, :meth:`weightvault.Vault.save` in one process and
:mod:`weightvault.dcp` across ranks (each rank does steps 1 to 3 for its own chunks,
rank 0 does step 4 once every rank is done)::

    intent = begin(store, digests, gc_wait=vault.gc_wait)    # 1. intent, 2. wait for gc
    written = store_missing(store, objects)                  # 3. objects, all durable
    name = commit_record(store, doc, name)                   # 4. the commit
    release(store, [intent])

1. :func:`begin` creates the vault if this is its first write, then registers an intent,
   ``intents/<id>.json``, naming every object the checkpoint will reference: from then
   on gc keeps them (see :mod:`.gc`).
2. It waits while a gc runs, so a save does not rewrite objects gc is about to free.
3. :func:`store_missing` writes only the objects the vault lacks (checked after the
   intent is visible, which is what makes gc safe), all durable before it returns
   (written unsynced, made durable by one filesystem sync, then renamed into place).
4. :func:`commit_record` creates ``checkpoints/<name>.json`` exclusively: that single
   create is the commit.

A writer killed at any moment leaves at most unreferenced objects and an intent, which
gc frees once the intent is an hour old.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..._base.errors import CheckpointExistsError
from ..._base.pools import each, each_grouped, workers
from ..objects.address import object_key
from ..objects.codec import CODECS, DEFAULT
from ..objects.encoding import Encoder, stored_depth
from ..records.intents import new_intent_key, write_intent
from ..records.names import next_name, record_key
from ..records.record import encode_record
from ..store import pack as _pack
from ..store.backend import Store
from ..store.identity import create_vault, upgrade_vault
from ..store.lease import wait_for_gc
from ..store.pack import PackWriter, pack_groups, pack_parts, pack_table

__all__ = ["Data", "begin", "commit_record", "release", "store_missing"]

#: An object to store: its size, and its bytes on demand.
Data = tuple[int, Callable[[], memoryview | bytes]]


def begin(store: Store, digests: Iterable[str], *, gc_wait: float) -> str:
    """Steps 1 and 2: register an intent naming ``digests``, then wait while a gc runs.

    Returns:
        The intent's key; :func:`release` it once the record is committed (or the save
        failed).

    Raises:
        VaultBusyError: A gc kept running for ``gc_wait`` seconds; the intent is gone.
        FormatError: The root holds something that is not a vault.
    """
    create_vault(store)
    intent = new_intent_key()
    # Seen by every gc at once; a crash ends the save, so nothing needs it after one.
    write_intent(store, intent, digests, durable=False)
    try:
        wait_for_gc(store, gc_wait)
    except BaseException:
        store.delete(intent)
        raise
    return intent


def store_missing(
    store: Store,
    objects: Mapping[str, Data],
    *,
    pool: ThreadPoolExecutor | None = None,
    wrote: Callable[[str, memoryview | bytes], object] | None = None,
    encoder: Encoder | None = None,
    writing: Callable[[Sequence[str]], object] | None = None,
    written: Callable[[str], object] | None = None,
    pack: bool = False,
    packs: list[str] | None = None,
    writer: PackWriter | None = None,
) -> dict[str, int]:
    """Step 3: write each object the vault lacks, durably; return ``{digest: file bytes}``
    of those written (a frame's compressed size, see :mod:`.delta`).

    One existence check per object, concurrently: a round trip each on S3, and on a
    network filesystem mounted as a local folder. Call it only
    after :func:`begin`: the check is what a concurrent gc's re-read relies on.

    Args:
        store: The vault's store.
        objects: ``{digest: (nbytes, data)}``; an object of another raw size is rewritten.
        pool: Threads to check and write on (by default this process's save threads).
        wrote: Called with each written object's digest and raw bytes (from those threads).
        encoder: Turns raw bytes into the file's bytes; by default each object is
            compressed in full with the default codec, when that pays.
        writing: Called once with the digests about to be written (for progress).
        written: Called with each digest once it is encoded and staged, on the calling
            thread (for progress).
        pack: Write the objects under :data:`~.pack.PACK_OBJECT` bytes raw into pack
            files (:mod:`.pack`), when there are two or more: one file created instead
            of one each. Only for objects the compactor will take out again.
        packs: Where to add the file name of each pack written (the record names them,
            so that the compactor knows whose they are).
        writer: A pack the objects were written into as they were hashed
            (:class:`~.pack.PackWriter`): the objects it holds are staged with it,
            unchecked, and it is dropped if it holds none. Only with ``pack``.
    """
    pool = pool or workers()
    encoder = encoder or Encoder(CODECS[DEFAULT])
    digests = list(objects)
    # One listing of packs/ after the intent is visible; each lookup then trusts it.
    pack_table(store).refresh(store)

    def depth(digest: str) -> int | None:
        return stored_depth(store, digest, objects[digest][0], refresh_packs=False)

    # What the writer holds needs no check: its pack, published after the intent, holds
    # it whatever the store has (a rare second copy, of an object another process wrote
    # meanwhile, is dropped when the compactor takes the pack apart). It holds only what
    # this vault instance had not seen, so that check would find nothing 157 times.
    held = writer.entries if writer is not None else {}
    ready = [d for d in digests if d in held]
    unchecked = [d for d in digests if d not in held]
    # A local check is a stat: threads cost more than it. A remote one is a round trip.
    sizes = [depth(d) for d in unchecked] if store.local else each(pool, depth, unchecked)
    missing = [d for d, depth in zip(unchecked, sizes, strict=True) if depth is None]
    if writing is not None:
        writing(ready + missing)
    if writer is not None and not ready:
        writer.discard()  # it holds nothing (every object was known)
    packed = [d for d in missing if objects[d][0] < _pack.PACK_OBJECT] if pack else []
    if len(packed) < 2:
        packed = []
    chosen = set(packed)
    missing = [d for d in missing if d not in chosen] + packed
    if packed or ready:
        upgrade_vault(store)

    staged: dict[str, str] = {}
    lock = threading.Lock()

    def put(digest: str) -> int:
        data = objects[digest][1]()
        if wrote is not None:
            wrote(digest, data)
        parts = encoder.encode_parts(digest, data)
        token = store.stage(object_key(digest), parts)
        with lock:
            staged[object_key(digest)] = token
        return sum(memoryview(p).nbytes for p in parts)

    def take(digest: str) -> memoryview | bytes:
        data = objects[digest][1]()
        if wrote is not None:
            wrote(digest, data)
        return data

    try:
        if ready:
            assert writer is not None
            staged[writer.key] = writer.finish()
            if packs is not None:
                packs.append(writer.key.rsplit("/", 1)[-1])
            for d in ready:
                if written is not None:
                    written(d)
        sizes_written = each(pool, put, missing[: len(missing) - len(packed)], written)
        for group in pack_groups([(d, objects[d][0]) for d in packed]):
            if wrote is None:
                parts = [take(d) for d in group]  # views of the tensors: nothing to do
            else:
                parts = each_grouped(pool, take, group, lambda d: objects[d][0])
            key, file = pack_parts(list(zip(group, parts, strict=True)))
            staged[key] = store.stage(key, file)
            if packs is not None:
                packs.append(key.rsplit("/", 1)[-1])
            for d in group:
                sizes_written.append(objects[d][0])
                if written is not None:
                    written(d)
        # Every object durable and in place at once: one journal commit for the whole
        # save, where an fsync per object cost one each (see _base.atomic.batch_sync_ok).
        store.publish(staged, sum(sizes_written) + sum(objects[d][0] for d in ready))
    except BaseException:
        store.discard(staged)
        if writer is not None:
            writer.discard()
        raise
    return {
        **dict(zip(missing, sizes_written, strict=True)),
        **{d: objects[d][0] for d in ready},
    }


def commit_record(store: Store, doc: Mapping[str, Any], name: str | None) -> str:
    """Step 4: create the record exclusively, under ``name`` or the next free number.

    Returns:
        The name committed.

    Raises:
        CheckpointExistsError: Another writer took ``name`` first.
    """
    payload = encode_record(doc)
    for _ in range(1000):
        chosen = name or next_name(store)
        if store.put(record_key(chosen), payload, exclusive=True):
            store.sync([record_key(chosen)])
            return chosen
        if name is not None:
            raise CheckpointExistsError(
                f"{store.url}: checkpoint {name!r} was created by another writer first; "
                "pick another name"
            )
    raise CheckpointExistsError(f"{store.url}: could not find a free checkpoint name")


def release(store: Store, intents: Iterable[str]) -> None:
    """Drop intents: their objects are now named by a record, or no longer wanted."""
    for key in intents:
        store.delete(key)
