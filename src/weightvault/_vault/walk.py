"""Loading a run's checkpoints into one model in turn, copying only what changed.

An evaluation over a run (which checkpoint scores best?) loads every checkpoint into the
same model. Between two checkpoints of a frozen-backbone fine-tune only the trained
tensors change, and each record names the object of every stored tensor, so the second
load need not copy the backbone again: the model holds those bytes already.

:func:`walk` loads each checkpoint through the adapter's own ``load`` (the same plan,
strictness, checks and report as :meth:`Vault.load`), handing it a :class:`Walked`
checkpoint that says which stored tensors are :meth:`~Walked.unchanged`: the objects the
previous step loaded into this model, when both checkpoints lay out their names the same
way. The adapter skips assigning those (PyTorch, Keras and numpy do; an adapter that does
not ask copies everything, which is still right), and :meth:`~Walked.stage` reads and
checks only the others before the first copy, so a damaged object fails the step before
the model changes.

Example:
    >>> for name, report in vault.walk(model):
    ...     scores[name] = evaluate(model)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from .._file.checkpoint import Checkpoint
from .records.checkpoint import VaultCheckpoint
from .records.marks import resolve_label
from .records.names import record_key
from .records.order import creation_order
from .records.reading import read_doc
from .store.backend import Store

__all__ = ["Walked", "unchanged_between", "walk", "walk_order"]


class Walked(Checkpoint):
    """An open vault checkpoint whose ``unchanged`` stored tensors the model holds already.

    Everything is read from the checkpoint it wraps; only :meth:`stage` leaves the
    unchanged tensors out (nothing reads them), and :meth:`unchanged` names them.
    """

    def __init__(self, inner: Checkpoint, unchanged: frozenset[str]) -> None:
        # The wrapped checkpoint's own tables: nothing is parsed again.
        self.path, self.stored, self.manifest = inner.path, inner.stored, inner.manifest
        self.entries = inner.entries
        self.inner = inner
        self._unchanged = unchanged

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def framework(self) -> str | None:
        return self.inner.framework

    @property
    def container(self) -> str:
        return self.inner.container

    def unchanged(self, stored: str) -> bool:
        return stored in self._unchanged

    def raw(self, stored: str) -> memoryview:
        return self.inner.raw(stored)

    def mapped(self, stored: str) -> memoryview:
        return self.inner.mapped(stored)

    def check(self, stored: str) -> bool:
        return self.inner.check(stored)

    def read_into(self, stored: str, buffer: memoryview) -> bool:
        return self.inner.read_into(stored, buffer)

    def stage(self, stored: list[str], verify: bool) -> None:
        self.inner.stage([s for s in stored if s not in self._unchanged], verify)

    def close(self) -> None:
        """The walk closes the checkpoint it wraps."""


def unchanged_between(before: Checkpoint | None, after: Checkpoint) -> frozenset[str]:
    """The stored tensors of ``after`` whose object is the one ``before`` stored under the
    same name, if both lay out every name alike (same names, kinds, dtypes, shapes,
    aliases, copies and views); else none, and the step copies everything.

    Example:
        >>> sorted(unchanged_between(vault.open("000001"), vault.open("000002")))
        ['backbone.weight']
    """
    if not (isinstance(before, VaultCheckpoint) and isinstance(after, VaultCheckpoint)):
        return frozenset()
    if before.entries != after.entries or _layout(before) != _layout(after):
        return frozenset()
    was = before.objects
    return frozenset(s for s, digest in after.objects.items() if was.get(s) == digest)


def _layout(ckpt: Checkpoint) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {name: (info.dtype, tuple(info.shape)) for name, info in ckpt.stored.items()}


def walk_order(store: Store, names: Iterable[str] | None) -> list[str]:
    """The checkpoints a walk loads: ``names`` resolved (``"latest"``, ``"best"``), in
    their order, each checked to exist; by default every checkpoint, oldest first.

    Raises:
        CheckpointNotFoundError: A name is no checkpoint (naming those there are).
    """
    if names is None:
        return [name for _, name in creation_order(store)]
    order = [resolve_label(store, name) for name in names]
    for name in order:
        if not store.exists(record_key(name)):
            read_doc(store, name)  # raises CheckpointNotFoundError, naming what exists
    return order


def walk(
    names: list[str],
    opened: Callable[[str], AbstractContextManager[Checkpoint]],
    load: Callable[[Checkpoint], Any],
) -> Iterator[tuple[str, Any]]:
    """Load each checkpoint of ``names`` in turn with ``load``; yield ``(name, report)``.

    Args:
        names: Checkpoint names, resolved, in the order to load them.
        opened: Opens a checkpoint for the ``with`` block.
        load: Fills the model from an open checkpoint (the adapter's ``load``, with the
            caller's options) and returns its report.

    Raises:
        Exception: What a step's load raised, with a note naming the checkpoint and the
            one the model still holds; the walk ends there.
    """
    before: Checkpoint | None = None
    held: str | None = None
    for name in names:
        with opened(name) as ckpt:
            same = unchanged_between(before, ckpt)
            try:
                report = load(Walked(ckpt, same) if same else ckpt)
            except Exception as e:
                still = f"checkpoint {held!r}" if held else "what it held before the walk"
                e.add_note(f"Vault.walk stopped at checkpoint {name!r}; the model holds {still}")
                raise
        before, held = ckpt, name
        yield name, report
