"""The ends of a vault: its oldest and its newest checkpoint, which the compactor keeps whole.

A load of the newest (a resume) and a resumable oldest (a restart from the run's start)
read one full object per tensor; every checkpoint between them may be stored as deltas.
So when a deletion or a rewrite moves or changes an end, :func:`mark_ends` leaves the
new end to the compactor (a to-do marker): the next compaction, a save's, :meth:`gc`'s
or :meth:`compact`'s, makes it whole again. No thread is started here: one would race
the gc that usually follows a deletion for the compactor's lock.

Example:
    >>> mark_ends(vault.store, ["000001", "000002", "000003"], {"000003"})
    ['000002']
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ..records.todo import mark
from ..store.backend import Store

__all__ = ["ends", "mark_ends"]


def ends(names: Sequence[str]) -> tuple[str | None, str | None]:
    """The oldest and the newest of ``names`` (oldest first); ``None`` for none."""
    return (names[0], names[-1]) if names else (None, None)


def mark_ends(
    store: Store,
    before: Sequence[str],
    changed: Collection[str],
    *,
    deleted: bool = True,
    newest: bool = True,
) -> list[str]:
    """Leave to the compactor each end of ``before`` (names, oldest first) in ``changed``:
    the end that takes its place when ``changed`` were ``deleted``, the end itself when
    they were rewritten; return the names marked.

    ``newest=False`` looks at the oldest only: a rewrite that drops training state never
    leaves the newest a delta (the compactor keeps it whole anyway), while it turns a
    resumable oldest into history the compactor may store as deltas.
    """
    after = [n for n in before if n not in changed] if deleted else list(before)
    if not after:
        return []
    (first, last), (new_first, new_last) = ends(before), ends(after)
    out = []
    if first in changed and new_first is not None:
        out.append(new_first)
    if newest and last in changed and new_last is not None:
        out.append(new_last)
    for name in out:
        mark(store, name)
    return out
