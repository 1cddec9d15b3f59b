"""Checking a whole vault: everything a load would refuse, reported, never raised.

A load refuses a vault file for one of its checks; ``verify`` makes every one of them,
on every file, in the order a load meets them:

1. ``vault.json``: a vault's marker, of a known version, and its checksum.
2. Every pack index (``packs/`` and a gc's trash): its checks and its checksum.
3. Every intent: its checksum (a damaged intent stops every gc).
4. Every checkpoint record: its checksum (a record written before records were sealed
   has none, which is a note, not a problem), then opened exactly as a load opens it: the
   :class:`~.checkpoint.VaultCheckpoint` or :class:`~.dcp_record.DcpCheckpoint` (the
   header, the manifest, the objects or chunk tables), a DCP record's values and ties,
   and the training state decoded as a load decodes it.
5. Every object a record names, once however many checkpoints share it: present, of the
   size the record says, its raw bytes hashed to its blake3 name (a compressed or delta
   object rebuilt first, its whole chain), the block sums of its frames, and the xxh3
   checksum each record holds for it (what a load checks).

An object a gc holds in its trash still counts (reads find it there, and that gc or the
next puts it back).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..._base.errors import CheckpointNotFoundError, ChecksumError, FormatError, capped
from ..._training.complete import training_state_problems
from ..objects.address import checksum, is_temp
from ..objects.frame import blocks_intact
from ..objects.probe import object_size
from ..objects.read import open_object, read_verified
from ..records.checkpoint import VaultCheckpoint, open_record
from ..records.dcp import DcpCheckpoint, check_section
from ..records.intents import parse_intent
from ..records.names import record_key, record_names
from ..records.reading import read_sealed
from ..store.backend import Store
from ..store.identity import MARKER, holds_vault
from ..store.pack import PACKS, check_pack, is_pack

__all__ = ["VaultVerifyReport", "check_object", "verify_vault"]


@dataclass
class VaultVerifyReport:
    """The result of :meth:`Vault.verify`: each problem names the checkpoint and tensor."""

    ok: bool
    problems: list[str] = field(default_factory=list)
    checkpoints: int = 0
    objects: int = 0
    #: What is sound but unchecked: files written before they carried checksums.
    notes: list[str] = field(default_factory=list)


def check_object(store: Store, digest: str, expected: int) -> str | None:
    """What is wrong with object ``digest`` (which must hold ``expected`` raw bytes), or
    None. A compressed or delta object is rebuilt (its whole chain) and its raw bytes
    hashed, so the check is the same whatever way the object is stored."""
    return _examine(store, digest, expected)[0]


def _examine(store: Store, digest: str, expected: int) -> tuple[str | None, str | None]:
    """What is wrong with object ``digest``, or None, and the xxh3 of its raw bytes."""
    try:
        data = read_verified(store, digest, expected)
    except FileNotFoundError:
        return f"object {digest[:12]} is missing", None
    except ChecksumError:
        # Only a raw object decodes to another size (a frame's is checked): its file's.
        size = object_size(store, digest, expected)
        if size is not None and size != expected:
            return (
                f"object {digest[:12]} holds {size} bytes, expected {expected} "
                "(truncated or corrupt)"
            ), None
        return f"object {digest[:12]} is corrupt (hash mismatch)", None
    except FormatError as e:
        return f"object {digest[:12]} is damaged ({e})", None
    except OSError as e:
        return f"object {digest[:12]} is unreadable ({e})", None
    return _blocks_problem(store, digest, expected), checksum(data)


def _blocks_problem(store: Store, digest: str, expected: int) -> str | None:
    """What a load's check of block sums refuses in object ``digest``'s frames, or None:
    a load reads a chain of version 2 frames against their sums, not decoding them."""
    try:
        with open_object(store, digest, expected) as obj:
            for d, f, frame in obj.links:
                if frame is not None and blocks_intact(f.preadv, f.read, frame) is False:
                    which = "its frame" if d == digest else f"its delta base {d[:12]}"
                    return f"object {digest[:12]}: a block of {which} does not match its sum"
    except FileNotFoundError:
        return f"object {digest[:12]} is missing"
    except (FormatError, OSError) as e:
        return f"object {digest[:12]} is damaged ({e})"
    return None


def _check_objects(
    store: Store,
    ckpt: VaultCheckpoint | DcpCheckpoint,
    verdict: dict[str, tuple[str | None, str | None]],
    progress: Callable[[int], None] | None,
) -> list[str]:
    problems = []
    sums = ckpt.manifest.sums
    for stored, digest in ckpt.objects.items():
        if digest not in verdict:
            verdict[digest] = _examine(store, digest, ckpt.object_nbytes(stored))
            if progress:
                progress(ckpt.object_nbytes(stored))
        problem, found = verdict[digest]
        if problem:
            problems.append(f"{ckpt.record.name}: tensor {stored!r}: {problem}")
        elif stored in sums and found != sums[stored]:
            problems.append(
                f"{ckpt.record.name}: tensor {stored!r}: the record's checksum "
                f"{sums[stored]} does not match its object {digest[:12]} ({found}): the "
                "record is damaged; restore it from a mirror or delete the checkpoint"
            )
    return problems


def _check_record(
    store: Store,
    name: str,
    verdict: dict[str, tuple[str | None, str | None]],
    progress: Callable[[int], None] | None,
    unsealed: list[str],
) -> list[str]:
    """Every problem of checkpoint ``name``: its record, opened as a load opens it, then
    its objects."""
    where = f"{store.url}/{record_key(name)}"
    try:
        doc, sealed = read_sealed(store, name)
        ckpt = open_record(store, name, doc)
    except (FormatError, OSError) as e:  # CheckpointNotFoundError: the caller skips it
        return [f"{name}: record unreadable: {e}"]
    if not sealed:
        unsealed.append(name)
    with ckpt:
        problems = []
        try:
            if isinstance(ckpt, DcpCheckpoint):
                check_section(doc["dcp"], ckpt.tensors, where)
        except FormatError as e:
            problems.append(f"{name}: record unusable: {e}")
        # What a load refuses in the training state, told without a framework.
        training = training_state_problems(ckpt)
        problems += [f"{name}: record unusable: training state: {p}" for p in training]
        problems += _check_objects(store, ckpt, verdict, progress)
    return problems


def _marker_problems(store: Store) -> list[str]:
    try:
        if holds_vault(store):
            return []
        return [f"{MARKER}: missing; no load opens this vault without it"]
    except (FormatError, OSError) as e:
        return [f"{MARKER}: {e}"]


def _pack_problems(store: Store, unsealed: list[str]) -> list[str]:
    """Every pack index that a load would refuse (its objects would count as missing)."""
    problems = []
    for prefix in (PACKS, "trash"):
        for blob in store.list(prefix):
            leaf = blob.key.rsplit("/", 1)[-1]
            if not is_pack(leaf):
                continue
            try:
                _, sealed = check_pack(store, blob.key)
            except FileNotFoundError:
                continue  # deleted meanwhile (the compactor or gc is done with it)
            except (FormatError, OSError) as e:
                problems.append(f"pack {leaf}: its objects count as missing: {e}")
                continue
            if not sealed:
                unsealed.append(leaf)
    return problems


def _intent_problems(store: Store, unsealed: list[str]) -> list[str]:
    """Every intent gc could not read (then it deletes nothing)."""
    problems = []
    for blob in store.list("intents"):
        if is_temp(blob.key) or blob.size == 0:
            continue  # being written, or left empty by a power loss: gc removes it
        leaf = blob.key.rsplit("/", 1)[-1]
        try:
            _, sealed = parse_intent(store.get(blob.key), f"{store.url}/{blob.key}")
        except FileNotFoundError:
            continue  # its save finished
        except (FormatError, OSError) as e:
            problems.append(f"intent {leaf}: {e}")
            continue
        if not sealed:
            unsealed.append(leaf)
    return problems


def _notes(unsealed: Mapping[str, list[str]]) -> list[str]:
    return [
        f"{len(names)} {what} carry no checksum (written before they were sealed; read as "
        f"before): {capped(names)}"
        for what, names in unsealed.items()
        if names
    ]


def verify_vault(store: Store, progress: Callable[[int], None] | None = None) -> VaultVerifyReport:
    """Check everything a load of any checkpoint would check (see the module's text)."""
    unsealed: dict[str, list[str]] = {"records": [], "pack indexes": [], "intents": []}
    problems = _marker_problems(store)
    problems += _pack_problems(store, unsealed["pack indexes"])
    problems += _intent_problems(store, unsealed["intents"])
    verdict: dict[str, tuple[str | None, str | None]] = {}
    checked = 0
    for name in sorted(record_names(store)):
        try:
            problems += _check_record(store, name, verdict, progress, unsealed["records"])
        except CheckpointNotFoundError:
            continue  # deleted meanwhile
        checked += 1
    return VaultVerifyReport(not problems, problems, checked, len(verdict), _notes(unsealed))
