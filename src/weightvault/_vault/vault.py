"""The vault: a checkpoint store that keeps every distinct tensor once across a run.

Layout under the root (a folder, or any fsspec URL such as ``s3://bucket/run1``)::

    vault.json                    format marker
    objects/<h[:2]>/<h>           one tensor's raw bytes, named by their blake3 hash
    checkpoints/<name>.json       a committed checkpoint: the safetensors header it would
                                  have as a single file, plus the object of each stored tensor
    intents/<id>.json             objects an in-flight save is about to reference
    gc/<id>.json                  a gc in progress (its heartbeat: pid, host, time)
    trash/<id>/<h>                objects gc <id> took out of objects/ and may still put back

**Commit protocol.** A save hashes its tensors, registers an intent naming their objects,
waits while a gc is running, writes only the objects that are missing (each durable before
the next step), then creates ``checkpoints/<name>.json`` exclusively: that single create is
the commit. A save killed at any moment leaves at most unreferenced objects, which gc frees.

**gc safety.** gc never deletes a key a save may have just decided to reuse. It first
picks candidates (objects no intent or checkpoint names), then *moves* each one into its
trash, then reads every intent and checkpoint again: objects someone now names go back,
only the rest are deleted, from the trash. A save checks an object after its intent is
visible; if that check came before the move, the intent (or the checkpoint it became) is
visible to the re-read, which puts the object back; if it came after, the save found the
object missing and wrote it again. However long gc stalls at any point, no checkpoint
loses an object. Reads find an object in a gc's trash while it sits there, and the trash
of a gc that died is put back by the next gc or by :meth:`Vault.break_gc_lock`. The
marker gc keeps fresh (a heartbeat) only makes saves wait, to avoid churn; it is not what
keeps objects safe.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import blake3
import xxhash

from .._base.background import SaveHandle, SnapshotPool
from .._base.errors import (
    CheckpointExistsError,
    CheckpointNameError,
    CheckpointNotFoundError,
    FormatError,
    VaultBusyError,
    capped,
)
from .._file.checkpoint import Checkpoint, read_fully
from .._file.header import TensorInfo, encode_header, parse_header
from .._file.layout import is_training, with_training
from .._file.manifest import MANIFEST_KEY, read_manifest
from .._file.sharing import Plan, Source, Stored, plan
from .._file.writer import check_names, layout
from .._tools.convert import rewrite
from .adapters import adapter_for
from .store import Blob, Store, open_store

if TYPE_CHECKING:
    from .dcp_record import DcpCheckpoint

FORMAT = "weightvault-vault"
VERSION = 1
#: An intent or temporary file older than this belongs to a process that died.
STALE_SECONDS = 3600.0
#: A running gc rewrites its marker this often; one not rewritten for GC_STALE_SECONDS
#: belongs to a gc that died or stalls, and saves stop waiting for it. Neither number
#: matters for safety (see the module docstring), only for how long a save may wait.
GC_HEARTBEAT_SECONDS = 10.0
GC_STALE_SECONDS = 60.0
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
#: The largest count a record may hold (byte counts, tensor counts).
_MAX_COUNT = 2**63 - 1
#: Record times must lie between the epoch and the end of year 9999 (what dates can show).
_MAX_TIME = 253402128000.0

log = logging.getLogger("weightvault")
#: Threads a save hashes and writes with. blake3 and xxhash release the GIL, so hashing
#: uses every core; the extra threads overlap fsyncs (and object-store round trips).
WORKERS = min(32, (os.cpu_count() or 1) + 4)
#: How many of the newest checkpoint records a save reads to find the checksums of
#: objects the vault already holds; an object none of them names is checksummed again.
SUM_RECORDS = 4

Progress = Callable[[int], None]
T = TypeVar("T")
U = TypeVar("U")


def content_hash(data: memoryview | bytes) -> str:
    """The blake3 hex digest that names an object (multithreaded for large buffers)."""
    view = memoryview(data).cast("B")
    threads = blake3.blake3.AUTO if view.nbytes >= 1 << 22 else 1
    return blake3.blake3(view, max_threads=threads).hexdigest()


def check_name(name: object, where: str, *, latest: bool = False) -> str:
    """``name`` itself if it may name a checkpoint; the one check every entry point uses.

    A name becomes a key under ``checkpoints/`` (and ``deleted/``), so anything that could
    reach outside the vault (``..``, ``/``, a trailing newline) is refused here.

    Args:
        name: What the caller passed.
        where: The vault, for the message.
        latest: Also accept ``"latest"`` (reads resolve it to the newest checkpoint).

    Raises:
        CheckpointNameError: ``name`` is not 1 to 128 ASCII letters, digits, ``.``, ``_``
            and ``-`` starting with a letter or digit, or is ``latest`` where not allowed.
    """
    if isinstance(name, str) and (
        (latest and name == "latest") or (name != "latest" and _NAME.fullmatch(name))
    ):
        return name
    shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
    raise CheckpointNameError(
        f"{where}: checkpoint name {shown} is not allowed; use 1 to 128 letters, digits, "
        "'.', '_' and '-', starting with a letter or digit"
        + ("" if latest else " (and not 'latest')")
    )


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _workers() -> ThreadPoolExecutor:
    """This process's save threads, started once (a thread start costs milliseconds)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WORKERS, "weightvault-save")
        return _pool


def _forget_workers() -> None:
    # A forked child inherits the pool object but none of its threads (nor a lock state
    # that means anything): it starts its own when it first saves.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


def _each(
    pool: ThreadPoolExecutor,
    fn: Callable[[U], T],
    items: Sequence[U],
    done: Callable[[U], object] | None = None,
) -> list[T]:
    """``fn`` over ``items`` on ``pool``, results in order, ``done(item)`` as each arrives.

    On any error it still waits for every call to finish, so a failed save leaves nothing
    running behind it.
    """
    futures = [pool.submit(fn, item) for item in items]
    try:
        out = []
        for item, future in zip(items, futures, strict=True):
            out.append(future.result())
            if done is not None:
                done(item)
        return out
    finally:
        wait(futures)


def checksum(data: memoryview | bytes) -> str:
    """The xxh3-64 hex digest a manifest records for a stored tensor (what loads check)."""
    return xxhash.xxh3_64(data).hexdigest()


def _is_temp(key: str) -> bool:
    # LocalStore writes "<dir>/.<random>.tmp" and renames it into place.
    return key.rsplit("/", 1)[-1].startswith(".")


class _Heartbeat:
    """A gc's marker, rewritten now and then so saves can tell a live gc from a dead one."""

    def __init__(self, store: Store, key: str) -> None:
        self.store, self.key = store, key
        self.last = 0.0
        self()

    def __call__(self) -> None:
        now = time.time()
        if now - self.last >= GC_HEARTBEAT_SECONDS:
            pid = os.getpid()
            owner = {"pid": pid, "host": socket.gethostname(), "started": _started(pid)}
            self.store.put(self.key, json.dumps({"created": now, **owner}).encode())
            self.last = now


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), to tell a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # Field 22, counted after the command name, which may itself hold spaces.
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _owner_gone(doc: object) -> bool:
    """Whether a marker's process has provably exited (same host, pid gone or reused)."""
    if not isinstance(doc, dict) or doc.get("host") != socket.gethostname():
        return False  # another machine's gc: only its heartbeat can tell
    pid = doc.get("pid")
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, owned by someone else
    started = doc.get("started")
    now_started = _started(pid)
    return type(started) is int and now_started is not None and now_started != started


def _object_key(digest: str) -> str:
    return f"objects/{digest[:2]}/{digest}"


@dataclass(frozen=True)
class CheckpointRecord:
    """One committed checkpoint.

    Attributes:
        name: Its name in the vault.
        created: When it was committed (seconds since the epoch).
        logical_bytes: What its tensors take with every name written out.
        stored_bytes: Its distinct tensor bytes (what a deduplicated single file holds).
        new_bytes: Bytes this checkpoint added to the vault when it was saved.
        metadata: Your metadata.
    """

    name: str
    created: float
    logical_bytes: int
    stored_bytes: int
    new_bytes: int
    metadata: dict[str, str] = field(default_factory=dict)
    framework: str | None = None
    tensors: int = 0


@dataclass
class VaultVerifyReport:
    """The result of :meth:`Vault.verify`: each problem names the checkpoint and tensor."""

    ok: bool
    problems: list[str] = field(default_factory=list)
    checkpoints: int = 0
    objects: int = 0


class VaultCheckpoint(Checkpoint):
    """One vault checkpoint, read through the same interface as a single file."""

    def __init__(self, store: Store, name: str, doc: Mapping[str, Any]) -> None:
        where = f"{store.url}/checkpoints/{name}.json"
        self.record = _record(name, doc, where)
        header_text = doc.get("header")
        objects = doc.get("objects")
        if not isinstance(header_text, str) or not isinstance(objects, dict):
            raise FormatError(f"{where}: checkpoint record lacks its header or objects")
        try:
            raw = header_text.encode("utf-8")
            header = parse_header(raw, 8 + len(raw) + _data_size(raw, where), where)
            manifest = read_manifest(header.metadata, header.tensors, where)
        except FormatError:
            raise
        except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
                RecursionError, MemoryError) as e:  # fmt: skip
            # A record is input like any file: whatever the header parser trips over is
            # damage to report, never a crash of verify() or the CLI.
            raise FormatError(f"{where}: checkpoint header is malformed ({e!r:.100})") from e
        if set(objects) != set(header.tensors) or not all(
            isinstance(h, str) and _DIGEST.fullmatch(h) for h in objects.values()
        ):
            raise FormatError(f"{where}: objects do not match the stored tensors")
        self.store = store
        self.objects: dict[str, str] = dict(objects)
        self._framework = header.metadata.get("format")
        self._cache: dict[str, memoryview] = {}
        super().__init__(where, header.tensors, manifest)

    @property
    def framework(self) -> str | None:
        return self._framework

    @property
    def container(self) -> str:
        return "vault"

    def missing(self) -> dict[str, str]:
        """``{stored_name: problem}`` for objects that are absent or of the wrong size."""
        out = {}
        for name, info in self.stored.items():
            key = _object_key(self.objects[name])
            size = self.store.size(key)
            if size is None:
                found = _in_trash(self.store, self.objects[name])
                size = None if found is None else self.store.size(found)
            if size is None:
                out[name] = "object missing"
            elif size != info.nbytes:
                out[name] = f"object holds {size} bytes, expected {info.nbytes}"
        return out

    def object_nbytes(self, label: str) -> int:
        """The size the object named under ``label`` in :attr:`objects` must have."""
        return self.stored[label].nbytes

    def fetch(self) -> None:
        """Bring every object into memory now, concurrently (used for remote stores)."""
        keys = {_object_key(h): n for n, h in self.objects.items() if n not in self._cache}
        try:
            got = self.store.get_many(list(keys))
        except FileNotFoundError:
            # Some object is not in objects/: it may sit in a running gc's trash. Fetch
            # one by one so each is looked for there (raw() names the tensor if not).
            got = {}
            for name in keys.values():
                self.raw(name)
        for key, data in got.items():
            self._cache[keys[key]] = memoryview(bytearray(data))

    def _object(self, stored: str) -> memoryview:
        digest = self.objects[stored]
        # objects/ first; then a gc's trash, where a gc may hold it until it puts it back
        # (see the module docstring); then objects/ again, in case it was put back meanwhile.
        for key in (_object_key(digest), None, _object_key(digest)):
            key = key or _in_trash(self.store, digest)
            if key is None:
                continue
            try:
                return self.store.view(key)
            except FileNotFoundError:
                continue
        raise FormatError(
            f"{self.path}: tensor {stored!r}: its object is missing; "
            "the vault is damaged, run 'weightvault vault ROOT verify'"
        )

    def raw(self, stored: str) -> memoryview:
        if stored not in self._cache:
            self._cache[stored] = self._object(stored)
        view = self._cache[stored]
        expected = self.stored[stored].nbytes
        if view.nbytes != expected:
            raise FormatError(
                f"{self.path}: tensor {stored!r}: object holds {view.nbytes} bytes, expected "
                f"{expected}; the vault is damaged, run 'weightvault vault ROOT verify'"
            )
        return view

    def read_into(self, stored: str, buffer: memoryview) -> bool:
        path = self.store.local_path(_object_key(self.objects[stored]))
        if path is None or buffer.nbytes != self.stored[stored].nbytes:
            return False
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # raw() then raises the error that names the tensor
        try:
            if os.fstat(fd).st_size != buffer.nbytes:
                return False
            read_fully(fd, buffer, 0, self.path, stored)
        finally:
            os.close(fd)
        return True

    def check(self, stored: str) -> bool:
        # Loads check the xxh3 sum recorded at save time (about 30 GB/s); vault.verify()
        # re-derives the blake3 object name, which is the authority but ~5x slower.
        expected = self.manifest.sums.get(stored)
        if expected is not None:
            return checksum(self.raw(stored)) == expected
        return content_hash(self.raw(stored)) == self.objects[stored]


def _in_trash(store: Store, digest: str) -> str | None:
    """The key of object ``digest`` in some gc's trash, or None."""
    for blob in store.list("trash"):
        if blob.key.rsplit("/", 1)[-1] == digest and not _is_temp(blob.key):
            return blob.key
    return None


def _open_record(
    store: Store, name: str, doc: Mapping[str, Any]
) -> VaultCheckpoint | DcpCheckpoint:
    # weightvault.dcp commits records of kind "dcp": tensors kept as shard chunks.
    if doc.get("kind") == "dcp":
        from .dcp_record import DcpCheckpoint

        where = f"{store.url}/checkpoints/{name}.json"
        return DcpCheckpoint(
            store,
            name,
            doc,
            record=_record(name, doc, where),
            data_size=_data_size,
            content_hash=content_hash,
        )
    return VaultCheckpoint(store, name, doc)


def _data_size(raw: bytes, where: str) -> int:
    # The header's own offsets say how big the data would be; parse_header then checks them.
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{where}: checkpoint header is not valid JSON") from e
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: checkpoint header is {type(doc).__name__}, not an object")
    ends = [0]
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int and 0 <= o <= _MAX_COUNT for o in offsets)
        ):
            raise FormatError(f"{where}: checkpoint header: tensor {name!r:.80} has bad offsets")
        ends.append(offsets[1])
    return max(ends)


_REQUIRED: Any = object()


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _record(name: str, doc: Mapping[str, Any], where: str) -> CheckpointRecord:
    """The record's fields, each checked: a record is hostile input like any file."""

    def field_(key: str, ok: Callable[[Any], bool], expected: str, default: Any = _REQUIRED) -> Any:
        if key not in doc and default is not _REQUIRED:
            return default
        if key not in doc:
            raise FormatError(
                f"{where}: checkpoint record lacks {key!r}; restore the record or delete it"
            )
        value = doc[key]
        if not ok(value):
            raise FormatError(
                f"{where}: checkpoint record field {key!r} is {_shown(value)}, expected "
                f"{expected}; restore the record or delete it"
            )
        return value

    def count(v: Any) -> bool:
        return type(v) is int and 0 <= v <= _MAX_COUNT

    def moment(v: Any) -> bool:
        return type(v) in (int, float) and math.isfinite(v) and 0 <= v <= _MAX_TIME

    def strings(v: Any) -> bool:
        return isinstance(v, dict) and all(
            isinstance(k, str) and isinstance(x, str) for k, x in v.items()
        )

    n = "a byte count"
    return CheckpointRecord(
        name=name,
        created=float(field_("created", moment, "seconds since 1970 before year 10000")),
        logical_bytes=field_("logical_bytes", count, n),
        stored_bytes=field_("stored_bytes", count, n),
        new_bytes=field_("new_bytes", count, n),
        metadata=dict(field_("metadata", strings, "an object of strings", {})),
        framework=field_("framework", lambda v: v is None or isinstance(v, str), "a string", None),
        tensors=field_("tensors", count, "a count", 0),
    )


class Vault:
    """A checkpoint store that keeps every distinct tensor once across checkpoints.

    Args:
        root: A local folder (created if needed) or an fsspec URL such as
            ``s3://bucket/run1``.
        gc_wait: How long a save waits for a running gc before giving up, in seconds.
        **storage_options: Passed to fsspec for remote roots (endpoint, credentials).

    Example:
        >>> vault = Vault("runs/finetune")
        >>> rec = vault.save(model, metadata={"step": "100"})
        >>> rec.new_bytes < rec.logical_bytes     # the frozen backbone is already there
        True
        >>> vault.load(model, "latest").missing
        []
    """

    def __init__(
        self, root: str | os.PathLike[str], *, gc_wait: float = 600.0, **storage_options: Any
    ) -> None:
        self.store = open_store(root, **storage_options)
        self.gc_wait = gc_wait
        self._pending: SaveHandle[CheckpointRecord] | None = None
        self._snapshots = SnapshotPool()
        # {blake3 object name: xxh3 checksum} of every object this instance has seen. The
        # checksum is a function of the bytes the name is the hash of, so it never goes
        # stale, whatever gc or other writers do to the vault.
        self._sums: dict[str, str] = {}
        marker = {"format": FORMAT, "version": VERSION, "hash": "blake3"}
        if not self.store.exists("vault.json"):
            self.store.put("vault.json", json.dumps(marker).encode(), exclusive=True)
        else:
            try:
                found = json.loads(self.store.get("vault.json"))
                ok = found.get("format") == FORMAT and found.get("version") == VERSION
            except (ValueError, AttributeError):
                ok = False
            if not ok:
                raise FormatError(
                    f"{self.store.url}: vault.json is not a weightvault vault of version "
                    f"{VERSION}; point Vault() at an empty folder or an existing vault"
                )

    @property
    def url(self) -> str:
        return self.store.url

    # -- saving ------------------------------------------------------------------------

    def save(
        self,
        model: Any,
        name: str | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
        progress: Progress | None = None,
        optimizer: Any = None,
        scheduler: Any = None,
        rng: bool = False,
        background: bool = False,
    ) -> Any:
        """Commit a checkpoint of ``model``, writing only tensors the vault lacks.

        Every tensor is hashed (blake3, once, on all cores) on every save: no shortcut
        that could miss an in-place change is taken. Only objects not already present are
        written; the checksums of present ones are reused, so an unchanged byte is read once.

        Args:
            model: Anything an installed adapter owns (see :mod:`._adapters`): a PyTorch
                ``nn.Module`` or tensor dict, a Keras model, an NNX or Equinox module or
                pytree, or a dict of numpy arrays.
            name: The checkpoint's name; by default the next number (``000001``, ...).
            metadata: Your ``str -> str`` metadata.
            progress: Called with a byte count as tensors are hashed and written.
            optimizer: Also store the optimizer's state by parameter name (PyTorch) or
                variable path (Keras).
            scheduler: Also store the LR scheduler's state (PyTorch; a Keras schedule is
                part of its optimizer).
            rng: Also store the RNG states, so a resumed run draws the same numbers.
            background: Copy what training can change now (everything but frozen
                parameters), then hash and write in a thread; returns a
                :class:`~weightvault.SaveHandle` whose ``wait()`` gives the record. A
                later save or load of this ``Vault`` waits for it first.

        Returns:
            The committed checkpoint's record, or with ``background`` a handle to it.

        Raises:
            CheckpointExistsError: ``name`` is already taken.
            CheckpointNameError: ``name`` is not a valid name (see :func:`check_name`).

        Example:
            >>> handle = vault.save(model, optimizer=opt, scheduler=sched, rng=True,
            ...                     background=True)
            >>> opt.step()      # the checkpoint keeps the values at the call
            >>> handle.wait().name
            '000002'
        """
        self._settle()  # a second save waits for the first
        if name is not None:
            check_name(name, self.url)
            if self.store.exists(f"checkpoints/{name}.json"):
                raise CheckpointExistsError(
                    f"{self.url}: checkpoint {name!r} already exists; pick another name "
                    "or delete it first with vault.delete(name)"
                )
        adapter = adapter_for(model)
        training: dict[str, Any] | None = None
        if optimizer is None and scheduler is None and not rng and not background:
            sources, _ = adapter.sources(model)
        else:
            sources, _, training = adapter.checkpoint_sources(
                model,
                optimizer=optimizer,
                scheduler=scheduler,
                rng=rng,
                snapshot=self._snapshots if background else None,
            )
        # Refused now (not in a background thread, nor when the checkpoint is exported to a
        # single file).
        names = [s.name for s in sources if training is None or not is_training(s.name)]
        check_names(names, metadata, self.url)
        if background:

            def work() -> CheckpointRecord:
                try:
                    return self._save_sources(sources, training, name, adapter, metadata, progress)
                finally:
                    self._snapshots.release()  # read in full: the next snapshot may reuse them

            self._pending = SaveHandle(work, f"vault save {name or '(next)'}")
            return self._pending
        return self._save_sources(sources, training, name, adapter, metadata, progress)

    def _settle(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.settle()

    def _save_sources(
        self,
        sources: builtins.list[Source],
        training: dict[str, Any] | None,
        name: str | None,
        adapter: Any,
        metadata: Mapping[str, str] | None,
        progress: Progress | None,
    ) -> CheckpointRecord:
        p = with_training(plan(sources), training)
        placed = layout(p.stored)
        pool = _workers()
        digests = self._address(pool, placed, progress)
        intent = f"intents/{uuid.uuid4().hex}.json"
        self.store.put(
            intent,
            json.dumps({"created": time.time(), "objects": sorted(set(digests.values()))}).encode(),
        )
        try:
            self._wait_for_gc()
            new_bytes, sums = self._store_missing(pool, placed, digests)
            doc = self._record_doc(p, placed, digests, sums, adapter, metadata, new_bytes)
            name = self._commit(doc, name)
        finally:
            self.store.delete(intent)
        return _record(name, doc, name)

    def _address(
        self,
        pool: ThreadPoolExecutor,
        placed: list[tuple[Stored, TensorInfo]],
        progress: Progress | None,
    ) -> dict[str, str]:
        """Every stored tensor's object name: each byte is hashed exactly once, on all cores.

        No tensor is skipped as "unchanged": a version counter misses writes made through
        ``.data``, so only the bytes themselves can say whether a tensor changed.
        """
        stored = [s for s, _ in placed]
        done = (lambda s: progress(s.nbytes)) if progress else None
        hashes = _each(pool, lambda s: content_hash(s.data()), stored, done)
        return {s.name: h for s, h in zip(stored, hashes, strict=True)}

    def _store_missing(
        self,
        pool: ThreadPoolExecutor,
        placed: list[tuple[Stored, TensorInfo]],
        digests: dict[str, str],
    ) -> tuple[int, dict[str, str]]:
        """Write the objects the vault lacks, durably; return the new bytes and checksums.

        The xxh3 checksum a manifest records is a function of the bytes, so for an object
        already present it is taken from this vault's earlier saves or records instead of
        a second pass over the bytes; only new objects (and present ones no recent record
        names) are read again, to checksum them.
        """
        first: dict[str, Stored] = {}
        for s, _ in placed:
            first.setdefault(digests[s.name], s)
        # One existence check per distinct object, concurrently (a round trip on S3).
        digests_of = list(first)
        sizes = dict(
            zip(
                digests_of,
                _each(pool, lambda d: self.store.size(_object_key(d)), digests_of),
                strict=True,
            )
        )
        present = {d for d, s in first.items() if sizes[d] == s.nbytes}
        self._learn_sums(d for d in present if d not in self._sums)

        def store(item: tuple[str, Stored]) -> bool:
            digest, s = item
            if digest in present:
                if digest not in self._sums:
                    self._sums[digest] = checksum(s.data())
                return False
            data = s.data()
            if digest not in self._sums:
                self._sums[digest] = checksum(data)
            self.store.put(_object_key(digest), data)
            # Its folder's entry too. Objects are written (and fsynced) concurrently: the
            # disk then commits many in one journal transaction, about 3x faster than
            # one after another for ten 1 MiB objects on the benchmark machine.
            self.store.sync([_object_key(digest)])
            return True

        wrote = _each(pool, store, list(first.items()))
        new_bytes = sum(s.nbytes for s, new in zip(first.values(), wrote, strict=True) if new)
        sums = {s.name: self._sums[digests[s.name]] for s, _ in placed}
        return new_bytes, sums

    def _learn_sums(self, wanted: Iterable[str]) -> None:
        """Add to ``self._sums`` what the newest records say about the ``wanted`` objects.

        A record is as trusted as the objects it names: a load checks the same checksums.
        A wrong one here makes the new checkpoint fail its load checks, it never hides
        damage. Unreadable records are skipped (the object is then checksummed again).
        """
        wanted = set(wanted)
        if not wanted:
            return
        blobs = [
            b
            for b in self.store.list("checkpoints")
            if b.key.endswith(".json") and not _is_temp(b.key)
        ]
        blobs.sort(key=lambda b: b.mtime, reverse=True)
        for blob in blobs[:SUM_RECORDS]:
            name = blob.key.rsplit("/", 1)[-1].removesuffix(".json")
            try:
                ckpt = VaultCheckpoint(self.store, name, self._doc(name))
            except (FormatError, CheckpointNotFoundError):
                continue
            for stored, digest in ckpt.objects.items():
                known = ckpt.manifest.sums.get(stored)
                if digest in wanted and known is not None:
                    self._sums[digest] = known
                    wanted.discard(digest)
            if not wanted:
                return

    def _record_doc(
        self,
        p: Plan,
        placed: list[tuple[Stored, TensorInfo]],
        digests: dict[str, str],
        sums: dict[str, str],
        adapter: Any,
        metadata: Mapping[str, str] | None,
        new_bytes: int,
    ) -> dict[str, Any]:
        # The same fast checksums a single file carries: what load(verify=True) checks.
        manifest = p.manifest(dict(metadata or {}), sums=sums)
        framework = getattr(adapter, "FRAMEWORK", None)
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

    def _commit(self, doc: dict[str, Any], name: str | None) -> str:
        for _ in range(1000):
            chosen = name or self._next_name()
            payload = json.dumps(doc, separators=(",", ":")).encode()
            if self.store.put(f"checkpoints/{chosen}.json", payload, exclusive=True):
                self.store.sync([f"checkpoints/{chosen}.json"])
                return chosen
            if name is not None:
                raise CheckpointExistsError(
                    f"{self.url}: checkpoint {name!r} was created by another writer first; "
                    "pick another name"
                )
        raise CheckpointExistsError(f"{self.url}: could not find a free checkpoint name")

    def _next_name(self) -> str:
        # Deleted checkpoints leave a tombstone, so a number is never handed out twice.
        gone = [b.key.rsplit("/", 1)[-1].removesuffix(".json") for b in self.store.list("deleted")]
        # isascii: "²".isdigit() holds, but int("²") fails.
        numbers = [int(n) for n in [*self._names(), *gone] if n.isascii() and n.isdigit()]
        return f"{max(numbers, default=0) + 1:06d}"

    def _gc_markers(self) -> builtins.list[tuple[Blob, str | None]]:
        """Each gc marker, with why its gc is dead (None: it may be running)."""
        out: builtins.list[tuple[Blob, str | None]] = []
        now = time.time()
        for blob in self.store.list("gc"):
            if _is_temp(blob.key):
                continue
            age = now - blob.mtime
            if age >= GC_STALE_SECONDS:
                out.append((blob, f"its heartbeat is {age:.0f} s old"))
                continue
            try:
                doc = json.loads(self.store.get(blob.key))
            except FileNotFoundError:
                continue  # that gc just finished
            except (ValueError, RecursionError, OSError):
                doc = None  # a marker being rewritten, or damaged: only its age can tell
            gone = _owner_gone(doc)
            out.append((blob, "its process has exited" if gone else None))
        return out

    def _wait_for_gc(self) -> None:
        # Waiting is not what keeps objects safe (gc re-checks before it deletes anything);
        # it only keeps a save from rewriting objects a running gc is about to free.
        deadline = time.monotonic() + self.gc_wait
        delay = 0.01
        told = False
        while True:
            running = [b for b, dead in self._gc_markers() if dead is None]
            if not running:
                return
            if not told:
                age = max(0.0, time.time() - running[0].mtime)
                log.warning(
                    "%s: waiting for the gc that holds %s (heartbeat %.0f s old): up to "
                    "%.0f s, until its heartbeat is %.0f s old or gc_wait=%.0f s runs out. "
                    "If that gc was killed on another machine, 'weightvault vault ROOT gc "
                    "--break-lock' ends the wait once the heartbeat is stale",
                    self.url,
                    running[0].key,
                    age,
                    min(self.gc_wait, max(0.0, GC_STALE_SECONDS - age)),
                    GC_STALE_SECONDS,
                    self.gc_wait,
                )
                told = True
            if time.monotonic() > deadline:
                raise VaultBusyError(
                    f"{self.url}: a gc has been running for over {self.gc_wait:.0f} s "
                    f"({running[0].key}); retry later, or run 'weightvault vault ROOT gc "
                    "--break-lock' if that gc died"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def break_gc_lock(self) -> builtins.list[str]:
        """Remove the markers of gcs that died, after putting their trash back.

        A gc's marker is dead when its heartbeat is older than the staleness window (a
        minute), or at once when it was written on this machine by a process that has
        exited. Objects such a gc had moved to its trash go back to ``objects/`` (the next
        gc frees them if nothing needs them), so breaking a lock never loses data.

        Returns:
            The markers removed.

        Raises:
            WeightvaultError: A marker's gc may still be running; nothing was changed.
        """
        markers = self._gc_markers()
        alive = [b for b, dead in markers if dead is None]
        if alive:
            age = time.time() - alive[0].mtime
            raise VaultBusyError(
                f"{self.url}: {alive[0].key}: a gc may still be running (heartbeat "
                f"{age:.0f} s old, under {GC_STALE_SECONDS:.0f} s); nothing was changed. Wait "
                "for it to finish, or stop that process and retry once its heartbeat is stale"
            )
        # No gc runs, so all trash is a dead gc's (even one whose marker was removed).
        restored = self._untrash(lambda owner: True)
        broken = []
        for blob, why in markers:
            self.store.delete(blob.key)
            log.warning("%s: removed the marker %s of a dead gc (%s)", self.url, blob.key, why)
            broken.append(blob.key)
        if restored:
            log.warning("%s: put %d objects back from dead gcs' trash", self.url, restored)
        return broken

    def _untrash(
        self, whose: Callable[[str], bool], beat: Callable[[], None] = lambda: None
    ) -> int:
        """Move objects back from the trash of every gc ``whose(id)`` selects."""
        restored = 0
        for blob in self.store.list("trash"):
            parts = blob.key.split("/")
            if len(parts) != 3 or _is_temp(blob.key) or not _DIGEST.fullmatch(parts[2]):
                continue
            if whose(parts[1]) and self.store.rename(blob.key, _object_key(parts[2])):
                restored += 1
                beat()
        return restored

    # -- reading -----------------------------------------------------------------------

    def _names(self) -> list[str]:
        out = []
        for b in self.store.list("checkpoints"):
            folder, _, base = b.key.rpartition("/")
            name = base.removesuffix(".json")
            # Files save() could not have made (nested, or a name check_name refuses) are
            # not checkpoints: they are neither listed nor opened.
            if folder == "checkpoints" and base.endswith(".json") and _NAME.fullmatch(name):
                out.append(name)
        return out

    def _doc(self, name: str) -> dict[str, Any]:
        key = f"checkpoints/{check_name(name, self.url)}.json"
        try:
            raw = self.store.get(key)
        except FileNotFoundError:
            known = self._names()
            raise CheckpointNotFoundError(
                f"{self.url}: no checkpoint named {name!r}; it has {capped(known) or 'none'}"
            ) from None
        except IsADirectoryError:
            raise FormatError(f"{self.url}/{key}: checkpoint record is a folder") from None
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{self.url}/{key}: checkpoint record is not valid JSON") from e
        if (
            not isinstance(doc, dict)
            or type(doc.get("version")) is not int
            or doc["version"] != VERSION
        ):
            raise FormatError(f"{self.url}/{key}: unknown checkpoint record version")
        return doc

    def list(self) -> list[CheckpointRecord]:
        """Every committed checkpoint, oldest first."""
        records = []
        for name in self._names():
            try:
                doc = self._doc(name)
            except CheckpointNotFoundError:
                continue  # deleted while we listed
            records.append(_record(name, doc, f"{self.url}/checkpoints/{name}.json"))
        return sorted(records, key=lambda r: (r.created, r.name))

    def _resolve(self, name: str) -> str:
        if check_name(name, self.url, latest=True) != "latest":
            return name
        records = self.list()
        if not records:
            raise CheckpointNotFoundError(f"{self.url}: the vault has no checkpoints yet")
        return records[-1].name

    def open(self, name: str = "latest") -> VaultCheckpoint | DcpCheckpoint:
        """Open a checkpoint for reading, as a :class:`Checkpoint` any adapter can load."""
        resolved = self._resolve(name)
        ckpt = _open_record(self.store, resolved, self._doc(resolved))
        if not self.store.local:
            ckpt.fetch()
        return ckpt

    def load(self, model: Any, name: str = "latest", *, verify: bool = True, **options: Any) -> Any:
        """Fill ``model`` from checkpoint ``name``, through the adapter's ``load``.

        Every option of the adapter's ``load`` works (``rules``, ``strict``,
        ``restore_frozen``, ``optimizer``, ``scheduler``, ``rng``, ...). ``verify`` (on by
        default) checks every object's hash before anything is copied, so a damaged vault
        never loads wrong values.

        Returns:
            What the adapter's ``load`` returns: a :class:`LoadReport` for PyTorch and
            Keras, ``(model, report)`` for JAX (pytrees come back as new objects).
        """
        adapter = adapter_for(model)
        self._settle()  # "latest" includes a background save still being written
        with self.open(name) as ckpt:
            return adapter.load(model, ckpt, verify=verify, **options)

    def delete(self, name: str) -> None:
        """Remove checkpoint ``name``; its objects are freed by the next :meth:`gc`.

        Raises:
            CheckpointNameError: ``name`` is not a valid name (``latest`` is refused too).
            CheckpointNotFoundError: No checkpoint has that name.
        """
        with contextlib.suppress(FormatError):  # a damaged record can still be removed
            self._doc(name)
        if name.isdigit():
            self.store.put(f"deleted/{name}.json", json.dumps({"deleted": time.time()}).encode())
        self.store.delete(f"checkpoints/{name}.json")

    def retain(
        self, keep_last: int | None = None, keep_every: int | None = None
    ) -> builtins.list[str]:
        """Delete checkpoints except the last ``keep_last`` and every ``keep_every``-th.

        Returns the names deleted. With neither argument, nothing is deleted.
        """
        records = self.list()
        if keep_last is None and keep_every is None:
            return []
        keep: set[str] = set()
        if keep_last:
            keep |= {r.name for r in records[-keep_last:]}
        if keep_every:
            keep |= {r.name for i, r in enumerate(records) if (i + 1) % keep_every == 0}
        deleted = [r.name for r in records if r.name not in keep]
        for name in deleted:
            self.delete(name)
        return deleted

    def gc(self) -> int:
        """Delete objects no checkpoint or in-flight save references; return the object
        bytes freed (stale bookkeeping files are removed too, uncounted).

        gc takes its candidates out of ``objects/`` into its trash, re-reads every intent
        and checkpoint, puts back whatever is now named, and deletes only the rest: a gc
        stalled at any point never deletes an object a newer save relies on (the module
        docstring gives the argument). It first puts back the trash of gcs that died.

        Raises:
            FormatError: A checkpoint record or intent is unreadable, so gc cannot know
                which objects it needs; every object is left in place. Fix or remove that
                record first.
        """
        gc_id = uuid.uuid4().hex
        marker = f"gc/{gc_id}.json"
        beat = _Heartbeat(self.store, marker)
        moved: builtins.list[tuple[Blob, str]] = []
        try:
            running = {
                b.key.rsplit("/", 1)[-1].removesuffix(".json")
                for b, why in self._gc_markers()
                if why is None
            }
            # Trash whose gc has no live marker belongs to a gc that died: put it back, so
            # its objects are judged afresh below.
            self._untrash(lambda owner: owner != gc_id and owner not in running, beat)
            objects = [b for b in self.store.list("objects") if not _is_temp(b.key)]
            now = time.time()
            live = self._live(beat, expire_before=now - STALE_SECONDS)
            for blob in objects:
                digest = blob.key.rsplit("/", 1)[-1]
                if digest not in live and self.store.rename(blob.key, f"trash/{gc_id}/{digest}"):
                    moved.append((blob, digest))
                    beat()
            # The decision: anything named now, after the move, goes back. A save that saw
            # one of these objects before it moved registered its intent before that, so it
            # (or the checkpoint it committed) is visible here.
            live = self._live(beat, expire_before=None)
            freed = 0
            while moved:
                blob, digest = moved.pop()
                if digest in live:
                    self.store.rename(f"trash/{gc_id}/{digest}", blob.key)
                else:
                    self.store.delete(f"trash/{gc_id}/{digest}")
                    freed += blob.size
                beat()
            # Temporary files of writers that died long ago, anywhere in the vault. Like
            # stale intents, bookkeeping files are removed without counting: what gc
            # reports is tensor data freed, that is, bytes under objects/.
            for blob in self.store.list(""):
                if _is_temp(blob.key) and now - blob.mtime > STALE_SECONDS:
                    self.store.delete(blob.key)
                    if blob.key.startswith("objects/"):
                        freed += blob.size
            return freed
        finally:
            # On any error, whatever is still in the trash goes back before gc stops.
            for blob, digest in moved:
                self.store.rename(f"trash/{gc_id}/{digest}", blob.key)
            self.store.delete(marker)

    def _live(self, beat: Callable[[], None], *, expire_before: float | None) -> set[str]:
        """Every object an intent or a checkpoint names; removes intents older than
        ``expire_before`` (their saves died)."""
        live: set[str] = set()
        # Intents before checkpoints: a save that commits and drops its intent between
        # the two reads is then still seen, as a checkpoint.
        for blob in self.store.list("intents"):
            if _is_temp(blob.key):
                continue  # an intent still being written; its save has not looked yet
            if expire_before is not None and blob.mtime < expire_before:
                self.store.delete(blob.key)
                continue
            try:
                doc = json.loads(self.store.get(blob.key))
                live |= {str(h) for h in doc["objects"]}
            except FileNotFoundError:
                continue  # its save finished; its checkpoint is read below
            except (ValueError, KeyError, TypeError, RecursionError) as e:
                raise FormatError(
                    f"{self.url}/{blob.key}: unreadable intent; gc deleted nothing. It "
                    "expires after an hour, or delete it if no save is running"
                ) from e
            beat()
        for name in self._names():
            try:
                ckpt = _open_record(self.store, name, self._doc(name))
            except CheckpointNotFoundError:
                continue
            except FormatError as e:
                raise FormatError(
                    f"{e}; gc deleted nothing, since it cannot tell which objects that "
                    f"checkpoint needs. Remove it with vault.delete({name!r}) or restore it"
                ) from e
            live |= set(ckpt.objects.values())
            beat()
        return live

    def verify(self, *, progress: Progress | None = None) -> VaultVerifyReport:
        """Check every checkpoint's record and every object's size and hash.

        Each object is hashed once however many checkpoints share it. Damage of any kind
        (records, objects) is reported in ``problems``, never raised.
        """
        problems: builtins.list[str] = []
        verdict: dict[str, str | None] = {}
        names = self._names()
        for name in sorted(names):
            try:
                ckpt = _open_record(self.store, name, self._doc(name))
            except (FormatError, CheckpointNotFoundError, OSError) as e:
                problems.append(f"{name}: record unreadable: {e}")
                continue
            for stored, digest in ckpt.objects.items():
                if digest not in verdict:
                    verdict[digest] = self._check_object(ckpt, stored, digest)
                    if progress:
                        progress(ckpt.object_nbytes(stored))
                if verdict[digest]:
                    problems.append(f"{name}: tensor {stored!r}: {verdict[digest]}")
            ckpt.close()
        return VaultVerifyReport(not problems, problems, len(names), len(verdict))

    def _check_object(
        self, ckpt: VaultCheckpoint | DcpCheckpoint, stored: str, digest: str
    ) -> str | None:
        expected = ckpt.object_nbytes(stored)
        for where in (_object_key(digest), None, _object_key(digest)):
            # An object in a gc's trash still counts: reads find it there, and that gc (or
            # the next one) puts it back. The trash is listed only when objects/ lacks it.
            key = where or _in_trash(self.store, digest)
            size = None if key is None else self.store.size(key)
            if key is None or size is None:
                continue
            if size != expected:
                return f"object {digest[:12]} holds {size} bytes, expected {expected} (truncated)"
            try:
                data = self.store.view(key)
            except FileNotFoundError:
                continue  # moved to or from a trash meanwhile
            except OSError as e:
                return f"object {digest[:12]} is unreadable ({e})"
            if content_hash(data) != digest:
                return f"object {digest[:12]} is corrupt (hash mismatch)"
            return None
        return f"object {digest[:12]} is missing"

    def export(
        self, name: str, path: str | os.PathLike[str], *, dedupe_copies: bool = False
    ) -> int:
        """Write checkpoint ``name`` as a standalone file any safetensors reader opens.

        Copies, stored once in the vault, are written under every name by default, so
        plain readers (``safetensors.torch.load_model``, ``from_pretrained``) see the whole
        model; with ``dedupe_copies`` they are stored once, as in the vault. Returns the
        file's size in bytes.
        """
        with self.open(name) as ckpt:
            ckpt.verify()
            metadata = dict(ckpt.manifest.metadata)
            report = rewrite(ckpt, path, metadata=metadata, dedupe_copies=dedupe_copies)
            return report.file_bytes

    def disk_bytes(self) -> int:
        """Bytes the vault occupies: every object and record."""
        return sum(b.size for b in self.store.list(""))

    def __repr__(self) -> str:
        return f"Vault({self.url!r})"


#: What every vault-taking API accepts: a :class:`Vault`, a path, or an fsspec URL.
VaultLike = Vault | str | os.PathLike[str]


def as_vault(vault: VaultLike, **options: Any) -> Vault:
    """``vault`` itself, or the :class:`Vault` at that path or URL.

    Every API that takes a vault (``VaultCallback``, ``checkout``, ``VaultCheckpointIO``,
    ``weightvault.dcp``, Keras' ``VaultCheckpoint``) goes through this, so a path works
    wherever a ``Vault`` does, as ``output_dir`` and ``dirpath`` do.

    Example:
        >>> import tempfile
        >>> as_vault(tempfile.mkdtemp()).list()
        []
    """
    return vault if isinstance(vault, Vault) else Vault(vault, **options)
