"""The records half of :class:`~weightvault.Vault`: listing, resolving and labelling.

:class:`RecordMethods` is a base of ``Vault``: its methods read and label records
through this folder (:mod:`.reading`, :mod:`.marks`), after the vault checked that it
exists and, for labels, waited for its background save (whose retention rewrites
records too).

Example:
    >>> vault.mark("000004"); vault.resolve("best")
    '000004'
"""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING

from ..store.backend import Store
from .marks import mark as put_mark, marks as find_marks, resolve_label, unmark as take_mark
from .reading import list_records
from .record import CheckpointRecord

__all__ = ["RecordMethods"]


class RecordMethods:
    """What a :class:`~weightvault.Vault` tells of its checkpoints, and how it labels them."""

    store: Store

    if TYPE_CHECKING:

        def _require(self) -> None: ...

        def _settle(self) -> None: ...

    def list(self) -> builtins.list[CheckpointRecord]:
        """Every committed checkpoint, oldest first."""
        self._require()
        return list_records(self.store)

    def resolve(self, name: str = "latest") -> str:
        """The name ``name`` stands for: itself, the newest checkpoint's for ``"latest"``,
        or for ``"best"`` the checkpoint :meth:`mark` labelled so.

        Raises:
            VaultNotFoundError: The path holds no vault.
            CheckpointNameError: ``name`` is not a valid name.
            CheckpointNotFoundError: ``"latest"`` in a vault with no checkpoints, or
                ``"best"`` where none is marked.

        Example:
            >>> vault.resolve("latest")
            '000003'
        """
        self._require()
        return resolve_label(self.store, name)

    def mark(self, name: str, label: str = "best") -> None:
        """Label checkpoint ``name`` (``"latest"`` allowed) ``label``, and take the label
        off the checkpoint that held it: a label names at most one checkpoint.

        Reads then take the label for the checkpoint (``load(model, "best")``, ``open``,
        ``export``, ``walk``, the CLI), retention by count keeps it, and a push carries
        it. The new record is written first and the old one after, so a crash between
        the two leaves both carrying it and the newer mark naming the checkpoint.

        Raises:
            ValueError: ``label`` is not a label (today there is one: ``"best"``).
            CheckpointNotFoundError: No checkpoint has that name.

        Example:
            >>> vault.mark("000004")
            >>> vault.load(model, "best").missing
            []
        """
        self._require()
        self._settle()  # the background save's retention rewrites records too
        put_mark(self.store, name, label)

    def unmark(self, label: str = "best") -> str | None:
        """Take ``label`` off; returns the checkpoint it named, or ``None``."""
        self._require()
        self._settle()
        return take_mark(self.store, label)

    def marks(self) -> dict[str, str]:
        """``{label: checkpoint}`` of every label a checkpoint carries, from the first 512
        bytes of each record (and the marked ones whole).

        Example:
            >>> vault.marks()
            {'best': '000004'}
        """
        self._require()
        return find_marks(self.store)
