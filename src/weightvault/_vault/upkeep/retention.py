"""Retention: which checkpoints a vault deletes, and whose training state it drops.

:class:`Retention` holds what one :class:`~weightvault.Vault` remembers between calls:
the checkpoints a mirror spares (:mod:`.sparing`), the last retention those held back
(applied again once the mirror has pushed them), and, per split of training state, the
checkpoints already seen without it (their records are not read again). Deleting goes
through :func:`delete_checkpoints`, which re-marks the ends (:mod:`.ends`); dropping
training state through :func:`~.retain.drop_training_except_last`.

Example:
    >>> Retention(lambda: vault.store).retain(vault.list, keep_last=2, compacts=True)
    ['000001']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..._base.errors import FormatError
from ..records.marks import protected
from ..records.reading import delete_record, list_records
from ..records.record import CheckpointRecord
from ..store.backend import Store
from .ends import mark_ends
from .retain import Split, drop_training_except_last
from .sparing import Spared

__all__ = ["Retention", "delete_checkpoints", "doomed"]


def delete_checkpoints(
    store: Store,
    names: Sequence[str],
    before: Sequence[CheckpointRecord] | None = None,
    *,
    compacts: bool,
) -> None:
    """Delete the records ``names``; if the oldest or the newest goes, its successor is
    marked for the compactor (``compacts``: the vault compresses), which makes it whole
    (it keeps neither as deltas, see compact.py). ``before``: the records as the caller
    just listed them."""
    if not names:
        return
    if before is None:
        try:
            before = list_records(store)
        except FormatError:
            before = []  # a damaged record (perhaps the one going): nothing is asked
    for name in names:
        delete_record(store, name)
    if compacts:
        mark_ends(store, [r.name for r in before], set(names))


def doomed(
    records: Sequence[CheckpointRecord],
    keep_last: int | None,
    keep_every: int | None,
    keep: set[str],
) -> list[str]:
    """The names of ``records`` (oldest first) that are not among the last ``keep_last``,
    every ``keep_every``-th, nor in ``keep``."""
    kept = set(keep)
    if keep_last:
        kept |= {r.name for r in records[-keep_last:]}
    if keep_every:
        kept |= {r.name for i, r in enumerate(records) if (i + 1) % keep_every == 0}
    return [r.name for r in records if r.name not in kept]


class Retention:
    """One vault's retention: what it deletes and drops, and what it must remember."""

    def __init__(self, store: Callable[[], Store]) -> None:
        # Asked for on each call: the vault's store may be replaced after it was made.
        self._store = store
        #: Checkpoints a mirror has queued and not pushed yet: left whole until it has.
        self.spared = Spared()
        self._deferred: dict[str, Any] | None = None
        #: Checkpoints (name, created) whose training state is gone, by the split that
        #: told it apart (None: the vault's own): not read again.
        self._done: dict[Any, set[tuple[str, float]]] = {}

    @property
    def store(self) -> Store:
        """The vault's store, as it is now."""
        return self._store()

    def retain(
        self,
        listing: Callable[[], list[CheckpointRecord]],
        keep_last: int | None = None,
        keep_every: int | None = None,
        training_state_last: int | None = None,
        *,
        compacts: bool,
    ) -> list[str]:
        """What :meth:`Vault.retain` does, with ``listing`` its records; ``compacts``: the
        vault compresses (its ends are then re-marked)."""
        spared = self.spared.names()
        if spared and (keep_last is not None or keep_every is not None or training_state_last):
            # Applied again, as asked, once the mirror has them (Mirror.wait).
            self._deferred = {"keep_last": keep_last, "keep_every": keep_every,
                              "training_state_last": training_state_last}  # fmt: skip
        deleted: list[str] = []
        if keep_last is not None or keep_every is not None:
            records = listing()  # every record whole: only what deleting needs
            # A marked checkpoint goes only by name.
            keep = protected(self.store) | spared
            deleted = doomed(records, keep_last, keep_every, keep)
            delete_checkpoints(self.store, deleted, records, compacts=compacts)
        if training_state_last is not None:
            if training_state_last < 0:
                raise ValueError(f"{self.store.url}: training_state_last must be >= 0")
            # The checkpoints this Vault saw without training state are not read again:
            # a loop's trim after every save (the integrations) read every older record,
            # 37-68 ms a save after 300 checkpoints (docs/benchmarks.md).
            self.drop_training(training_state_last, spare=spared)
        return deleted

    def drop_training(
        self, last: int, split: Split | None = None, *, spare: frozenset[str] | None = None
    ) -> list[str]:
        """Drop the training state of all but the newest ``last`` checkpoints, except the
        spared ones (``spare``: as listed by the caller), see
        :func:`drop_training_except_last`; return the names rewritten."""
        done = self._done.setdefault(split, set())
        spare = self.spared.names() if spare is None else spare
        return drop_training_except_last(self.store, last, split, spare=spare, done=done)

    def apply_deferred(
        self, retain: Callable[..., list[str]], training_state_last: int | None
    ) -> bool:
        """Apply the last retention that spared checkpoints (through ``retain``, the
        vault's), now that none is spared, and the vault's own ``training_state_last``;
        return whether a gc should follow."""
        if self.spared.names():
            return False
        asked, self._deferred = self._deferred, None
        changed = asked is not None and bool(retain(**asked))
        if training_state_last is not None:
            changed |= bool(
                drop_training_except_last(
                    self.store, training_state_last, done=self._done.setdefault(None, set())
                )
            )
        return bool(changed or asked)
