"""Moving checkpoints between two vaults, as ``Vault.push`` and ``Vault.pull`` ask.

:func:`moved` resolves the names the caller gave on the sender (``"best"`` is the
sender's label), picks the receiver's codec (the sender's where the receiver keeps raw
bytes), runs one :func:`~.transfer.transfer` with a bar for ``progress=True``, and then
carries the labels of what it sent, so that they name the same checkpoints there.

Example:
    >>> moved(local, remote, ["best"], None, "pushing").checkpoints
    ['000004']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..._base.progress import Progress as Bar
from ..objects.encoding import Storage
from ..records.marks import carry_marks
from ..store.backend import Store
from ..writing.save import Progress
from .transfer import TransferReport, transfer

__all__ = ["Side", "moved"]


class Side(Protocol):
    """What :func:`moved` needs of either vault (a :class:`~weightvault.Vault`)."""

    store: Store
    storage: Storage
    gc_wait: float

    @property
    def url(self) -> str: ...

    def _require(self) -> None: ...

    def resolve(self, name: str = "latest") -> str: ...


def moved(
    sender: Side,
    receiver: Side,
    names: Sequence[str] | None,
    progress: Progress | bool | None,
    label: str,
) -> TransferReport:
    """One transfer from ``sender`` to ``receiver``, with a bar for ``progress=True``;
    the labels of what it sent then name the same checkpoints there."""
    bar = Bar(0, f"{label} to {receiver.url}") if progress is True else progress or None
    codec = receiver.storage.codec or sender.storage.codec
    if names is not None:
        sender._require()
        names = [sender.resolve(n) for n in names]  # "best" is the sender's
    try:
        report = transfer(
            sender.store, receiver.store, names, progress=bar, gc_wait=receiver.gc_wait,
            codec=codec,
        )  # fmt: skip
    finally:
        if isinstance(bar, Bar):
            bar.close()
    carry_marks(sender.store, receiver.store, report.checkpoints)
    return report
