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

A checkpoint :mod:`weightvault.dcp` committed (kind ``"dcp"``) loses the chunks of every
tensor outside the model (the optimizer's state) and its non-tensor optimizer values; its
per-rank chunk tables stay as they are (their entries for the dropped tensors are no
longer named by the index, so gc frees those chunks). A training loop whose checkpoints
keep their training state elsewhere than the vault's training section (Lightning's
``optimizer_states``) passes its own :data:`Split`.

The rewrite is one atomic replace of the record, so a SIGKILL leaves either the old
record or the new one, both complete.

Example:
    >>> drop_training_except_last(vault.store, 1)       # what training_state_last=1 does
    ['000001', '000002']
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..._base.errors import CheckpointNotFoundError
from ..._file.header import TensorInfo, encode_header
from ..._file.layout import is_training
from ..._file.manifest import MANIFEST_KEY, Manifest
from ..records.checkpoint import VaultCheckpoint
from ..records.dcp import KIND as DCP, DcpCheckpoint
from ..records.order import creation_order
from ..records.reading import read_doc, rewrite_record
from ..store.backend import Store
from .ends import mark_ends

__all__ = ["Split", "drop_training", "drop_training_except_last", "weights_only_manifest"]

#: What of a plain checkpoint is training state: given the open checkpoint, the stored
#: names to drop and the metadata to keep instead, or ``None`` when it holds none.
Split = Callable[[VaultCheckpoint], "tuple[set[str], dict[str, str]] | None"]


def weights_only_manifest(
    m: Manifest,
    drop: Callable[[str], bool] = is_training,
    metadata: Mapping[str, str] | None = None,
) -> Manifest:
    """``m`` without training state: no training section, no entry naming a dropped
    tensor (names, sums, copies, aliases, views), and ``metadata`` if given."""

    def keep(*names: str) -> bool:
        return not any(drop(n) for n in names)

    return Manifest(
        aliases={a: t for a, t in m.aliases.items() if keep(a, t)},
        copies={c: t for c, t in m.copies.items() if keep(c, t)},
        views={n: v for n, v in m.views.items() if keep(n, v.base)},
        frozen=[f for f in m.frozen if keep(f)],
        names=[n for n in m.names if keep(n)],
        sums={n: s for n, s in m.sums.items() if keep(n)},
        checksum=m.checksum,
        metadata=dict(m.metadata if metadata is None else metadata),
        version=m.version,
        duplicates={d: t for d, t in m.duplicates.items() if keep(d, t)},
        training=None,
    )


def _vault_split(ckpt: VaultCheckpoint) -> tuple[set[str], dict[str, str]] | None:
    """The vault's own training state: its training section and the tensors it names."""
    if ckpt.manifest.training is None:
        return None
    return {n for n in ckpt.stored if is_training(n)}, dict(ckpt.manifest.metadata)


def _weights_doc(
    ckpt: VaultCheckpoint, doc: Mapping[str, Any], dropped: set[str], metadata: dict[str, str]
) -> dict[str, Any]:
    """The record ``doc`` without the stored tensors ``dropped``, offsets laid out again."""
    m = ckpt.manifest
    gone = {*dropped, *(c for c, t in m.copies.items() if t in dropped)}
    kept = sorted((i for n, i in ckpt.stored.items() if n not in gone), key=lambda i: i.start)
    infos, position = [], 0
    for i in kept:
        infos.append(TensorInfo(i.name, i.dtype, i.shape, position, position + i.nbytes))
        position += i.nbytes
    lost = sum(i.nbytes for n, i in ckpt.stored.items() if n in gone)
    lost += sum(ckpt.stored[t].nbytes for c, t in m.copies.items() if c in gone)
    meta = {"format": ckpt.framework} if ckpt.framework else {}
    manifest = weights_only_manifest(m, gone.__contains__, metadata)
    meta[MANIFEST_KEY] = manifest.encode()
    out = dict(doc)
    out.update(
        header=encode_header(infos, meta)[8:].decode("utf-8").rstrip(" "),
        objects={i.name: ckpt.objects[i.name] for i in kept},
        stored_bytes=position,
        logical_bytes=max(0, ckpt.record.logical_bytes - lost),
        metadata=dict(metadata),
        tensors=len(manifest.names),
        weights_only=True,
    )
    return out


def _dcp_weights_doc(store: Store, name: str, doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The DCP record ``doc`` without what lies outside the model; ``None`` if nothing does.

    Every tensor and value whose name lacks the model's prefix (the optimizer's, under
    ``optim.``) leaves the index; the model's header, ties and chunk tables stay.
    """
    ckpt = DcpCheckpoint(store, name, doc)  # validates, and resolves every chunk
    section = dict(doc["dcp"])
    prefix = ckpt.prefix
    if not prefix:
        return None  # saved by another planner: nothing tells the model from the rest

    def model(fqn: str) -> bool:
        return fqn.startswith(prefix)

    tensors, values = dict(section.get("tensors", {})), dict(section.get("values", {}))
    if all(model(f) for f in [*tensors, *values]):
        return None
    section.update(
        tensors={f: t for f, t in tensors.items() if model(f)},
        values={f: v for f, v in values.items() if model(f)},
        mappings={f: v for f, v in dict(section.get("mappings", {})).items() if model(f)},
        ties={a: c for a, c in dict(section.get("ties", {})).items() if model(a) and model(c)},
    )
    ties = section["ties"]
    chunks = {c.digest: c.nbytes(t.dtype) for f, t in ckpt.tensors.items() if model(f)
              for c in t.chunks}  # fmt: skip
    # Logical: every name's bytes, the tied alias included, as the commit counts them.
    logical = sum(
        c.nbytes(ckpt.tensors[ties.get(f, f)].dtype)
        for f in [*section["tensors"], *ties]
        for c in ckpt.tensors[ties.get(f, f)].chunks
    )
    out = dict(doc)
    out.update(dcp=section, stored_bytes=sum(chunks.values()), logical_bytes=logical)
    out["weights_only"] = True
    return out


def drop_training(store: Store, name: str, split: Split | None = None) -> bool:
    """Rewrite checkpoint ``name`` without its training state; False if it had none.

    Args:
        store: The vault's store.
        name: The checkpoint.
        split: What of a plain checkpoint is training state (the vault's training section
            and the tensors it names, by default). DCP checkpoints drop every tensor and
            value outside the model, whatever ``split`` says.

    Raises:
        FormatError: The record is damaged (nothing is changed).
    """
    try:
        doc = read_doc(store, name)
    except CheckpointNotFoundError:
        return False  # deleted meanwhile
    if doc.get("weights_only") is True:
        return False
    if doc.get("kind") == DCP:
        new = _dcp_weights_doc(store, name, doc)
        if new is None:
            return False
        DcpCheckpoint(store, name, new)  # the rewritten record must read back
    elif doc.get("kind") is None:
        ckpt = VaultCheckpoint(store, name, doc)
        parts = (split or _vault_split)(ckpt)
        if parts is None:
            return False
        new = _weights_doc(ckpt, doc, *parts)
        VaultCheckpoint(store, name, new)
    else:
        return False
    return rewrite_record(store, name, new)  # deleted meanwhile: not brought back


def drop_training_except_last(
    store: Store,
    last: int,
    split: Split | None = None,
    *,
    spare: Collection[str] = (),
    done: set[tuple[str, float]] | None = None,
) -> list[str]:
    """Drop the training state of every checkpoint but the newest ``last``; return the
    names rewritten (oldest first). ``split`` as for :func:`drop_training`; names in
    ``spare`` (a mirror has yet to push them) are left whole for a later call.

    The checkpoints are ordered from the start of each record (:func:`creation_order`).
    ``done`` (a set the caller keeps, such as a ``Vault``'s) remembers each checkpoint
    already without training state by name and creation time, so a loop that calls this
    after every save reads whole only the records that are new since: reading every one
    cost 3 ms per checkpoint the vault held, in every save (0.5 s after 150 saves of a
    70-tensor model with its AdamW)."""
    order = creation_order(store)
    older = order[: max(0, len(order) - last)]
    dropped = []
    for created, name in older:
        if name in spare or (done is not None and (name, created) in done):
            continue
        if drop_training(store, name, split):
            dropped.append(name)
        if done is not None:
            done.add((name, created))  # weights only now, or never held any state
    # The compactor keeps a resumable oldest whole and turns a weights-only one into
    # deltas: a marker makes the next compaction (a save's, gc's) look at it again.
    mark_ends(store, [n for _, n in order], set(dropped), deleted=False, newest=False)
    return dropped
