"""The compactor's view of the records: the checkpoints, oldest first, and their tensors.

One :class:`Records` is read per compaction pass: records are ordered from their starts
and read whole only when their tensors are needed.

Example:
    >>> records = Records(vault.store)
    >>> records.names
    ['000001', '000002']
"""

from __future__ import annotations

from typing import Any

from ..._base.errors import CheckpointNotFoundError, FormatError
from ..records.names import record_key, record_names
from ..records.order import creation_order
from ..records.reading import read_doc
from ..records.record import object_digests
from ..store.backend import Store

__all__ = ["Records", "Tensors"]


#: ``{stored name: (digest, dtype, shape, nbytes)}`` of one checkpoint.
Tensors = dict[str, tuple[str, str, tuple[int, ...], int]]


class Records:
    """The checkpoints, oldest first, and their tensors, read once per compaction."""

    def __init__(self, store: Store) -> None:
        self.store = store
        listed = record_names(store)
        self.listed = set(listed)  # damaged ones too: what a second listing sees
        # Ordered from the start of each record; a record is read whole only when its
        # tensors are needed (every record whole cost each pass 0.23 ms per checkpoint
        # the vault holds: docs/benchmarks-log.md, section 26). A record damaged past its
        # start is listed, and its tensors are None: its objects stay as they are, and
        # the checkpoints on either side of it are not paired (verify reports it).
        order = creation_order(store, listed, skip_damaged=True)
        self.names = [name for _, name in order]
        self._tensors: dict[str, Tensors | None] = {}
        self._frozen: dict[str, set[str]] = {}
        #: Each record's size when its tensors were read (see :meth:`still_named`).
        self._sizes: dict[str, int | None] = {}

    def oldest(self) -> str | None:
        """The oldest checkpoint whose tensors the compactor handles (not DCP's)."""
        return next((n for n in self.names if self.tensors(n) is not None), None)

    def still_named(self, name: str, tensor: str, digest: str) -> bool:
        """Whether checkpoint ``name``'s record still names ``digest`` for ``tensor``.

        A retain may drop a checkpoint's training state while it is being compacted
        (a loop's ``training_state_last`` does so right after each save): its objects are
        then about to be freed, and rewriting them would only leave garbage. The record is
        read again only when its file's size changed (one ``stat``).
        """
        size = self.store.size(record_key(name))
        if size is None:
            return False
        if size != self._sizes.get(name):
            self._tensors.pop(name, None)
            self._sizes[name] = size
        tensors = self.tensors(name)
        entry = tensors.get(tensor) if tensors else None
        return entry is not None and entry[0] == digest

    def naming(self, packed: dict[str, str]) -> dict[str, tuple[str, str, int]]:
        """``{digest: (checkpoint, tensor, nbytes)}`` for each object of ``packed``
        (``{digest: its pack}``) that a record names.

        Records are read newest first, and an object is looked for no further back than
        the record whose save wrote its pack: none older can name an object first written
        after it (two saves at once write such an object into a pack each, and the other
        copy is found). So a pass reads the records of the newest saves, not every one (4
        ms each for a 70-tensor model with its AdamW: 0.6 s a pass after 150 saves), even
        for the objects a retain left unnamed.
        """
        out: dict[str, tuple[str, str, int]] = {}
        left = dict(packed)
        for name in reversed(self.names):
            if not left:
                break
            try:
                doc = self._doc(name)
            except (FormatError, CheckpointNotFoundError):
                continue
            packs = doc.get("packs")
            hit = not (object_digests(doc) or set()).isdisjoint(left)
            if hit and name not in self._tensors:
                self._tensors[name] = self._parse(name, doc)  # the doc just read, not again
            tensors = self.tensors(name) if hit else None
            for tensor, (digest, _, _, nbytes) in (tensors or {}).items():
                if digest in left:
                    out[digest] = (name, tensor, nbytes)
                    del left[digest]
            if isinstance(packs, list):
                own = {p for p in packs if isinstance(p, str)}
                left = {d: p for d, p in left.items() if p not in own}
        return out

    def tensors(self, name: str) -> Tensors | None:
        """The tensors of ``name``; ``None`` for a DCP record or one that is unreadable
        or gone (its objects are then left as they are)."""
        if name not in self._tensors:
            self._tensors[name] = self._read(name)
        return self._tensors[name]

    def frozen(self, name: str) -> set[str]:
        """The objects of ``name``'s frozen tensors (its record's ``frozen`` list)."""
        self.tensors(name)
        return self._frozen.get(name, set())

    def _doc(self, name: str) -> dict[str, Any]:
        """``name``'s record, its size noted first: a change after that is seen."""
        self._sizes[name] = self.store.size(record_key(name))
        return read_doc(self.store, name)

    def _read(self, name: str) -> Tensors | None:
        try:
            doc = self._doc(name)
        except (FormatError, CheckpointNotFoundError):
            return None
        return self._parse(name, doc)

    def _parse(self, name: str, doc: dict[str, Any]) -> Tensors | None:
        from ..records.checkpoint import VaultCheckpoint

        if doc.get("kind") is not None:
            return None  # weightvault.dcp's chunks: stored as written
        try:
            ckpt = VaultCheckpoint(self.store, name, doc)
        except (FormatError, CheckpointNotFoundError):
            return None
        frozen = set(ckpt.manifest.frozen)
        self._frozen[name] = {d for n, d in ckpt.objects.items() if n in frozen}
        return {n: (ckpt.objects[n], i.dtype, i.shape, i.nbytes) for n, i in ckpt.stored.items()}
