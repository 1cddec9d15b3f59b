"""Weights-only history: dropping training state from all but the newest checkpoints.

A run that checkpoints often wants the weights of every checkpoint (to evaluate or roll
back to any of them) but only needs to resume from the newest. Optimizer state is most
of a checkpoint (AdamW keeps two moments per weight), so keeping it everywhere triples
the cost of a history. :func:`drop_training` rewrites a checkpoint's record without its
training tensors (optimizer, scheduler, RNG) and without the manifest's training
section; its weights, names, ties and checksums are kept, so it loads exactly as before,
and loading training state from it raises :class:`~weightvault.TrainingStateError`
naming the checkpoint. The dropped objects are freed by the next gc (unless another
checkpoint or a delta still needs them).

The rewrite is one atomic replace of the record, so a SIGKILL leaves either the old
record or the new one, both complete.

Example:
    >>> drop_training_except_last(vault.store, 1)       # what training_state_last=1 does
    ['000001', '000002']
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .._base.errors import CheckpointNotFoundError
from .._file.header import TensorInfo, encode_header
from .._file.layout import is_training
from .._file.manifest import MANIFEST_KEY, Manifest
from .checkpoint import VaultCheckpoint
from .records import list_records, read_doc, record_key
from .store import Store

__all__ = ["drop_training", "drop_training_except_last", "weights_only_manifest"]


def weights_only_manifest(m: Manifest) -> Manifest:
    """``m`` without training state: no training section, no entry naming a training
    tensor (sums, copies, aliases, views)."""

    def keep(*names: str) -> bool:
        return not any(is_training(n) for n in names)

    return Manifest(
        aliases={a: t for a, t in m.aliases.items() if keep(a, t)},
        copies={c: t for c, t in m.copies.items() if keep(c, t)},
        views={n: v for n, v in m.views.items() if keep(n, v.base)},
        frozen=list(m.frozen),
        names=list(m.names),
        sums={n: s for n, s in m.sums.items() if keep(n)},
        checksum=m.checksum,
        metadata=dict(m.metadata),
        version=m.version,
        duplicates={d: t for d, t in m.duplicates.items() if keep(d, t)},
        training=None,
    )


def _weights_doc(ckpt: VaultCheckpoint, doc: Mapping[str, Any]) -> dict[str, Any]:
    """The record ``doc`` without training tensors, offsets laid out again."""
    m = ckpt.manifest
    kept = sorted((i for n, i in ckpt.stored.items() if not is_training(n)), key=lambda i: i.start)
    infos, position = [], 0
    for i in kept:
        infos.append(TensorInfo(i.name, i.dtype, i.shape, position, position + i.nbytes))
        position += i.nbytes
    dropped = sum(i.nbytes for n, i in ckpt.stored.items() if is_training(n))
    dropped += sum(ckpt.stored[t].nbytes for c, t in m.copies.items() if is_training(c))
    meta = {"format": ckpt.framework} if ckpt.framework else {}
    meta[MANIFEST_KEY] = weights_only_manifest(m).encode()
    out = dict(doc)
    out.update(
        header=encode_header(infos, meta)[8:].decode("utf-8").rstrip(" "),
        objects={i.name: ckpt.objects[i.name] for i in kept},
        stored_bytes=position,
        logical_bytes=max(0, ckpt.record.logical_bytes - dropped),
        weights_only=True,
    )
    return out


def drop_training(store: Store, name: str) -> bool:
    """Rewrite checkpoint ``name`` without its training state; False if it had none.

    DCP checkpoints (whose optimizer state is chunked by rank) are left as they are.

    Raises:
        FormatError: The record is damaged (nothing is changed).
    """
    try:
        doc = read_doc(store, name)
    except CheckpointNotFoundError:
        return False  # deleted meanwhile
    if doc.get("kind") is not None or doc.get("weights_only") is True:
        return False
    ckpt = VaultCheckpoint(store, name, doc)
    if ckpt.manifest.training is None:
        return False
    new = _weights_doc(ckpt, doc)
    VaultCheckpoint(store, name, new)  # the rewritten record must read back
    key = record_key(name)
    if not store.exists(key):
        return False  # deleted while we read it: do not bring it back
    store.put(key, json.dumps(new, separators=(",", ":")).encode())
    store.sync([key])
    return True


def drop_training_except_last(store: Store, last: int) -> list[str]:
    """Drop the training state of every checkpoint but the newest ``last``; return the
    names rewritten (oldest first)."""
    records = list_records(store)
    older = records[: max(0, len(records) - last)]
    return [r.name for r in older if not r.weights_only and drop_training(store, r.name)]
