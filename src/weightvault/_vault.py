"""The vault: a checkpoint store that keeps every distinct tensor once across a run.

Layout under the root (a folder, or any fsspec URL such as ``s3://bucket/run1``)::

    vault.json                    format marker
    objects/<h[:2]>/<h>           one tensor's raw bytes, named by their blake3 hash
    checkpoints/<name>.json       a committed checkpoint: the safetensors header it would
                                  have as a single file, plus the object of each stored tensor
    intents/<id>.json             objects an in-flight save is about to reference
    gc/<id>.json                  a gc in progress

**Commit protocol.** A save hashes its tensors, registers an intent naming their objects,
waits while a gc is running, writes only the objects that are missing (each durable before
the next step), then creates ``checkpoints/<name>.json`` exclusively: that single create is
the commit. A save killed at any moment leaves at most unreferenced objects, which gc frees.

**gc safety.** gc first announces itself, then reads every checkpoint and every intent,
and deletes only objects that none of them names. A save that registered its intent before
gc read the intents is protected by it; a save that registers later sees gc's marker and
waits, so it never reuses an object gc is about to delete.
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import blake3
import xxhash

from ._errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    FormatError,
    WeightvaultError,
    capped,
)
from ._header import TensorInfo, encode_header, parse_header
from ._manifest import MANIFEST_KEY, read_manifest
from ._plan import Plan, Stored, plan
from ._reader import Checkpoint, read_fully
from ._reports import LoadReport
from ._store import Store, open_store
from ._writer import layout, write

if TYPE_CHECKING:
    from ._dcp_record import DcpCheckpoint

FORMAT = "weightvault-vault"
VERSION = 1
#: An intent or temporary file older than this belongs to a process that died.
STALE_SECONDS = 3600.0
#: A running gc rewrites its marker this often; one not rewritten for GC_STALE_SECONDS
#: belongs to a gc that died, and saves stop waiting for it.
GC_HEARTBEAT_SECONDS = 10.0
GC_STALE_SECONDS = 60.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

Progress = Callable[[int], None]


def content_hash(data: memoryview | bytes) -> str:
    """The blake3 hex digest that names an object (multithreaded for large buffers)."""
    view = memoryview(data).cast("B")
    threads = blake3.blake3.AUTO if view.nbytes >= 1 << 22 else 1
    return blake3.blake3(view, max_threads=threads).hexdigest()


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
            self.store.put(self.key, json.dumps({"created": now}).encode())
            self.last = now


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
        raw = header_text.encode("utf-8")
        header = parse_header(raw, 8 + len(raw) + _data_size(raw, where), where)
        manifest = read_manifest(header.metadata, header.tensors, where)
        if set(objects) != set(header.tensors) or not all(
            isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h) for h in objects.values()
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
            size = self.store.size(_object_key(self.objects[name]))
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
        except FileNotFoundError as e:
            lost = [n for k, n in keys.items() if str(e).endswith(k)] or list(keys.values())
            raise FormatError(
                f"{self.path}: tensor {lost[0]!r}: its object is missing; the vault is "
                "damaged, run 'weightvault vault ROOT verify'"
            ) from e
        for key, data in got.items():
            self._cache[keys[key]] = memoryview(bytearray(data))

    def raw(self, stored: str) -> memoryview:
        if stored not in self._cache:
            try:
                self._cache[stored] = self.store.view(_object_key(self.objects[stored]))
            except FileNotFoundError:
                raise FormatError(
                    f"{self.path}: tensor {stored!r}: its object is missing; "
                    "the vault is damaged, run 'weightvault vault ROOT verify'"
                ) from None
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
            return xxhash.xxh3_64(self.raw(stored)).hexdigest() == expected
        return content_hash(self.raw(stored)) == self.objects[stored]


def _open_record(
    store: Store, name: str, doc: Mapping[str, Any]
) -> VaultCheckpoint | DcpCheckpoint:
    # weightvault.dcp commits records of kind "dcp": tensors kept as shard chunks.
    if doc.get("kind") == "dcp":
        from ._dcp_record import DcpCheckpoint

        return DcpCheckpoint(store, name, doc)
    return VaultCheckpoint(store, name, doc)


def _data_size(raw: bytes, where: str) -> int:
    # The header's own offsets say how big the data would be; parse_header then checks them.
    try:
        doc = json.loads(raw)
        ends = [v["data_offsets"][1] for k, v in doc.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, RecursionError) as e:
        raise FormatError(f"{where}: checkpoint header is malformed") from e
    if not all(isinstance(e, int) and e >= 0 for e in ends):
        raise FormatError(f"{where}: checkpoint header has bad offsets")
    return max(ends, default=0)


def _record(name: str, doc: Mapping[str, Any], where: str) -> CheckpointRecord:
    try:
        return CheckpointRecord(
            name=name,
            created=float(doc["created"]),
            logical_bytes=int(doc["logical_bytes"]),
            stored_bytes=int(doc["stored_bytes"]),
            new_bytes=int(doc["new_bytes"]),
            metadata={str(k): str(v) for k, v in dict(doc.get("metadata", {})).items()},
            framework=doc.get("framework"),
            tensors=int(doc.get("tensors", 0)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{where}: checkpoint record is malformed ({e})") from e


def _adapter(model: Any) -> Any:
    """The adapter module for ``model``'s framework, imported only when needed."""
    kinds = [c.__module__.split(".")[0] for c in type(model).__mro__]
    if isinstance(model, Mapping) and model:
        kinds = [type(next(iter(model.values()))).__module__.split(".")[0]]
    # Keras first: on KERAS_BACKEND=torch a Keras model is also a torch.nn.Module.
    for framework, module in (("keras", "weightvault.keras"), ("torch", "weightvault.torch")):
        if framework in kinds:
            return importlib.import_module(module)
    raise TypeError(
        f"the vault does not know how to save a {type(model).__name__}; pass a PyTorch "
        "nn.Module or a dict of tensors"
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
    ) -> CheckpointRecord:
        """Commit a checkpoint of ``model``, writing only tensors the vault lacks.

        Every tensor is hashed (blake3) on every save: no shortcut that could miss an
        in-place change is taken. Only objects not already present are written.

        Args:
            model: A model of any installed adapter (a PyTorch ``nn.Module`` or tensor dict).
            name: The checkpoint's name; by default the next number (``000001``, ...).
            metadata: Your ``str -> str`` metadata.
            progress: Called with a byte count as tensors are hashed and written.

        Raises:
            CheckpointExistsError: ``name`` is already taken.
        """
        if name is not None:
            self._check_name(name)
            if self.store.exists(f"checkpoints/{name}.json"):
                raise CheckpointExistsError(
                    f"{self.url}: checkpoint {name!r} already exists; pick another name "
                    "or delete it first with vault.delete(name)"
                )
        adapter = _adapter(model)
        sources, _ = adapter._sources(model)
        p = plan(sources)
        placed = layout(p.stored)
        digests: dict[str, str] = {}
        sums: dict[str, str] = {}
        for s, _ in placed:
            data = s.data()
            digests[s.name] = content_hash(data)
            sums[s.name] = xxhash.xxh3_64(data).hexdigest()
            if progress:
                progress(s.nbytes)

        intent = f"intents/{uuid.uuid4().hex}.json"
        self.store.put(
            intent,
            json.dumps({"created": time.time(), "objects": sorted(set(digests.values()))}).encode(),
        )
        try:
            self._wait_for_gc()
            new_bytes, written = 0, []
            for s, _ in placed:
                key = _object_key(digests[s.name])
                if self.store.size(key) == s.nbytes:
                    continue
                self.store.put(key, s.data())
                new_bytes += s.nbytes
                written.append(key)
            self.store.sync(written)
            doc = self._record_doc(p, placed, digests, sums, adapter, metadata, new_bytes)
            name = self._commit(doc, name)
        finally:
            self.store.delete(intent)
        return _record(name, doc, name)

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
        raise WeightvaultError(f"{self.url}: could not find a free checkpoint name")

    def _next_name(self) -> str:
        # Deleted checkpoints leave a tombstone, so a number is never handed out twice.
        gone = [b.key.rsplit("/", 1)[-1].removesuffix(".json") for b in self.store.list("deleted")]
        numbers = [int(n) for n in [*self._names(), *gone] if n.isdigit()]
        return f"{max(numbers, default=0) + 1:06d}"

    def _check_name(self, name: str) -> None:
        if not _NAME.match(name) or name == "latest":
            raise ValueError(
                f"checkpoint name {name!r} is not allowed; use letters, digits, '.', '_' "
                "and '-', starting with a letter or digit (and not 'latest')"
            )

    def _wait_for_gc(self) -> None:
        deadline = time.monotonic() + self.gc_wait
        delay = 0.01
        while True:
            now = time.time()
            running = [
                b
                for b in self.store.list("gc")
                if not _is_temp(b.key) and now - b.mtime < GC_STALE_SECONDS
            ]
            if not running:
                return
            if time.monotonic() > deadline:
                raise WeightvaultError(
                    f"{self.url}: a gc has been running for over {self.gc_wait:.0f} s "
                    f"({running[0].key}); retry later, or delete that marker if no gc runs"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    # -- reading -----------------------------------------------------------------------

    def _names(self) -> list[str]:
        out = []
        for b in self.store.list("checkpoints"):
            base = b.key.rsplit("/", 1)[-1]
            if base.endswith(".json") and not base.startswith("."):
                out.append(base[: -len(".json")])
        return out

    def _doc(self, name: str) -> dict[str, Any]:
        key = f"checkpoints/{name}.json"
        try:
            raw = self.store.get(key)
        except FileNotFoundError:
            known = self._names()
            raise CheckpointNotFoundError(
                f"{self.url}: no checkpoint named {name!r}; it has {capped(known) or 'none'}"
            ) from None
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{self.url}/{key}: checkpoint record is not valid JSON") from e
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
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
        if name != "latest":
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

    def load(
        self, model: Any, name: str = "latest", *, verify: bool = True, **options: Any
    ) -> LoadReport:
        """Fill ``model`` from checkpoint ``name``, through the adapter's ``load``.

        Every option of the adapter's ``load`` works (``rules``, ``strict``,
        ``restore_frozen``, ...). ``verify`` (on by default) checks every object's hash
        before anything is copied, so a damaged vault never loads wrong values.
        """
        adapter = _adapter(model)
        with self.open(name) as ckpt:
            report: LoadReport = adapter.load(model, ckpt, verify=verify, **options)
        return report

    def delete(self, name: str) -> None:
        """Remove checkpoint ``name``; its objects are freed by the next :meth:`gc`."""
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

        Raises:
            FormatError: A checkpoint record is unreadable, so gc cannot know which objects
                it needs; nothing is deleted. Fix or remove that record first.
        """
        marker = f"gc/{uuid.uuid4().hex}.json"
        beat = _Heartbeat(self.store, marker)
        try:
            objects = self.store.list("objects")
            now = time.time()
            live: set[str] = set()
            # Intents before checkpoints: a save that commits and drops its intent between
            # the two reads is then still seen, as a checkpoint.
            for blob in self.store.list("intents"):
                if _is_temp(blob.key):
                    continue  # an intent still being written; its save then waits for us
                if now - blob.mtime > STALE_SECONDS:
                    self.store.delete(blob.key)
                    continue
                try:
                    doc = json.loads(self.store.get(blob.key))
                    live |= {str(h) for h in doc["objects"]}
                except FileNotFoundError:
                    continue  # its save finished; its checkpoint is read below
                except (ValueError, KeyError, TypeError) as e:
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
            freed = 0
            for blob in objects:
                base = blob.key.rsplit("/", 1)[-1]
                if _is_temp(blob.key):
                    continue
                if base not in live:
                    self.store.delete(blob.key)
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
            self.store.delete(marker)

    def verify(self, *, progress: Progress | None = None) -> VaultVerifyReport:
        """Check every checkpoint's record and every object's size and hash.

        Each object is hashed once however many checkpoints share it.
        """
        problems: builtins.list[str] = []
        verdict: dict[str, str | None] = {}
        names = self._names()
        for name in sorted(names):
            try:
                ckpt = _open_record(self.store, name, self._doc(name))
            except (FormatError, CheckpointNotFoundError) as e:
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
        key = _object_key(digest)
        size = self.store.size(key)
        expected = ckpt.object_nbytes(stored)
        if size is None:
            return f"object {digest[:12]} is missing"
        if size != expected:
            return f"object {digest[:12]} holds {size} bytes, expected {expected} (truncated)"
        if content_hash(self.store.view(key)) != digest:
            return f"object {digest[:12]} is corrupt (hash mismatch)"
        return None

    def export(self, name: str, path: str | os.PathLike[str]) -> int:
        """Write checkpoint ``name`` as a standalone file any safetensors reader opens."""
        with self.open(name) as ckpt:
            ckpt.verify()
            m = ckpt.manifest
            order = {n: i for i, n in enumerate(m.names)}
            stored = [
                Stored(n, info.dtype, info.shape, _reader(ckpt, n), order.get(n, i))
                for i, (n, info) in enumerate(ckpt.stored.items())
            ]
            p = Plan(stored, m.aliases, m.copies, m.views, m.frozen, m.names)
            return write(path, p, framework=ckpt.framework, metadata=m.metadata)

    def disk_bytes(self) -> int:
        """Bytes the vault occupies: every object and record."""
        return sum(b.size for b in self.store.list(""))

    def __repr__(self) -> str:
        return f"Vault({self.url!r})"


def _reader(ckpt: Checkpoint, name: str) -> Callable[[], memoryview]:
    return lambda: ckpt.raw(name)
