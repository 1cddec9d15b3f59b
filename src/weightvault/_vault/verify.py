"""Checking a whole vault: every record readable, every object present, sized and hashed.

Each object is hashed once however many checkpoints share it (a compressed or delta
object is rebuilt first, so the hash is always of its raw bytes), and an object a gc holds
in its trash still counts (reads find it there, and that gc or the next puts it back).
Damage of any kind is reported, never raised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .._base.errors import CheckpointNotFoundError, FormatError
from .checkpoint import VaultCheckpoint, open_record
from .dcp_record import DcpCheckpoint
from .objects import content_hash, read_object
from .records import read_doc, record_names
from .store import Store

__all__ = ["VaultVerifyReport", "check_object", "verify_vault"]


@dataclass
class VaultVerifyReport:
    """The result of :meth:`Vault.verify`: each problem names the checkpoint and tensor."""

    ok: bool
    problems: list[str] = field(default_factory=list)
    checkpoints: int = 0
    objects: int = 0


def check_object(store: Store, digest: str, expected: int) -> str | None:
    """What is wrong with object ``digest`` (which must hold ``expected`` raw bytes), or
    None. A compressed or delta object is rebuilt (its whole chain) and its raw bytes
    hashed, so the check is the same whatever way the object is stored."""
    try:
        data = read_object(store, digest, expected)
    except FileNotFoundError:
        return f"object {digest[:12]} is missing"
    except FormatError as e:
        return f"object {digest[:12]} is damaged ({e})"
    except OSError as e:
        return f"object {digest[:12]} is unreadable ({e})"
    if data.nbytes != expected:
        return (
            f"object {digest[:12]} holds {data.nbytes} bytes, expected {expected} "
            "(truncated or corrupt)"
        )
    if content_hash(data) != digest:
        return f"object {digest[:12]} is corrupt (hash mismatch)"
    return None


def _check_checkpoint(
    store: Store,
    ckpt: VaultCheckpoint | DcpCheckpoint,
    verdict: dict[str, str | None],
    progress: Callable[[int], None] | None,
) -> list[str]:
    problems = []
    for stored, digest in ckpt.objects.items():
        if digest not in verdict:
            verdict[digest] = check_object(store, digest, ckpt.object_nbytes(stored))
            if progress:
                progress(ckpt.object_nbytes(stored))
        if verdict[digest]:
            problems.append(f"{ckpt.record.name}: tensor {stored!r}: {verdict[digest]}")
    return problems


def verify_vault(store: Store, progress: Callable[[int], None] | None = None) -> VaultVerifyReport:
    """Check every checkpoint's record and every object's size and hash."""
    problems: list[str] = []
    verdict: dict[str, str | None] = {}
    names = record_names(store)
    for name in sorted(names):
        try:
            ckpt = open_record(store, name, read_doc(store, name))
        except (FormatError, CheckpointNotFoundError, OSError) as e:
            problems.append(f"{name}: record unreadable: {e}")
            continue
        with ckpt:
            problems += _check_checkpoint(store, ckpt, verdict, progress)
    return VaultVerifyReport(not problems, problems, len(names), len(verdict))
