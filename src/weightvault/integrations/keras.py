"""A Keras callback that checkpoints ``fit`` into a vault, and the way back.

``VaultCheckpoint`` takes the place of ``keras.callbacks.ModelCheckpoint``: at the end of
every epoch (or every ``save_freq`` batches) it stores the model, the optimizer's state
by variable path and the RNG states as one vault checkpoint, so frozen layers and
anything else unchanged cost nothing after the first save. :func:`restore` loads a
checkpoint into a compiled model and returns the epoch to pass to ``fit`` as
``initial_epoch``.

Example:
    >>> from weightvault import Vault
    >>> from weightvault.integrations.keras import VaultCheckpoint, restore
    >>> model.fit(x, y, epochs=2, callbacks=[VaultCheckpoint("runs/vault")])
    >>> vault = Vault("runs/vault")
    >>> [r.name for r in vault.list()]
    ['epoch-0001', 'epoch-0002']
    >>> fresh.compile(optimizer="adam", loss="mse")
    >>> start = restore(vault, fresh, "epoch-0001")
    >>> fresh.fit(x, y, epochs=2, initial_epoch=start)
"""

from __future__ import annotations

from typing import Any

from .._base.errors import TrainingStateError
from .._vault.vault import VaultLike, as_vault
from ._common import mirror_for, settle, trim

try:
    import keras
except ImportError as e:  # pragma: no cover - exercised only without keras
    from .._base.errors import BackendNotInstalled

    raise BackendNotInstalled(
        "weightvault.integrations.keras needs Keras 3: pip install 'weightvault[keras]'"
    ) from e

__all__ = ["VaultCheckpoint", "restore"]

#: Metadata keys the callback writes into each checkpoint.
EPOCH_KEY = "keras.epoch"
STEP_KEY = "keras.step"


class VaultCheckpoint(keras.callbacks.Callback):  # type: ignore[misc]
    """Save ``fit``'s model, optimizer and RNG state into a vault, like ``ModelCheckpoint``.

    Checkpoints are named ``epoch-0003`` (the number of epochs completed, as Keras'
    ``{epoch}`` counts) or, with an integer ``save_freq``, ``step-000120`` (batches
    completed since this callback's first batch plus those of earlier epochs skipped by
    ``initial_epoch``). Each records the epoch and step as metadata (``keras.epoch``,
    ``keras.step``), which :func:`restore` reads back.

    Args:
        vault: The :class:`~weightvault.Vault` to save into, or its path or URL.
        save_freq: ``"epoch"``, or save every this many batches.
        save_optimizer: Also store ``model.optimizer``'s state (slots, iterations, learning
            rate and configuration) so training resumes exactly.
        rng: Also store the Python, numpy, Keras ``SeedGenerator`` and torch RNG states.
        keep: After each save, keep only the last ``keep`` checkpoints of the vault
            (:meth:`~weightvault.Vault.retain`; it applies to every checkpoint of the
            vault, not only this callback's). Run ``vault.gc()`` to free their bytes.
        training_state_last: Keep the weights of every checkpoint but the optimizer and
            RNG state of only the newest ``N``: after each save the older ones become
            weights-only (``vault.retain(training_state_last=N)``, over every checkpoint
            of the vault). They still load with ``vault.load(model, name)``;
            :func:`restore` of one raises :class:`~weightvault.TrainingStateError` naming
            it. ``None`` keeps it all.
        mirror: Another vault (a path or a URL) each checkpoint is pushed to once it
            commits, in a background thread (see ``VaultCallback``'s ``mirror``); the end
            of training waits for the last push.

    Raises:
        ValueError: ``save_freq`` is neither ``"epoch"`` nor a positive integer, or
            ``keep`` or ``training_state_last`` is below 1.

    Example:
        >>> model.fit(x, y, epochs=3, callbacks=[VaultCheckpoint(vault, keep=2)])
        >>> [r.name for r in vault.list()]
        ['epoch-0002', 'epoch-0003']
    """

    def __init__(
        self,
        vault: VaultLike,
        save_freq: str | int = "epoch",
        save_optimizer: bool = True,
        *,
        rng: bool = True,
        keep: int | None = None,
        training_state_last: int | None = None,
        mirror: VaultLike | None = None,
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and (
            not isinstance(save_freq, int) or isinstance(save_freq, bool) or save_freq < 1
        ):
            raise ValueError(f"save_freq must be 'epoch' or a positive integer, not {save_freq!r}")
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (or None to keep all), not {keep!r}")
        if training_state_last is not None and training_state_last < 1:
            raise ValueError(
                "training_state_last must be at least 1 (or None to keep all), not "
                f"{training_state_last!r}"
            )
        self.vault = as_vault(vault)
        self.mirror = mirror_for(self.vault, mirror)
        self.save_freq = save_freq
        self.save_optimizer = save_optimizer
        self.rng = rng
        self.keep = keep
        self.training_state_last = training_state_last
        self._epoch = 0
        self._step = 0

    def on_train_begin(self, logs: Any = None) -> None:
        self._step = 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._step += 1
        if isinstance(self.save_freq, int) and self._step % self.save_freq == 0:
            self._save(f"step-{self._step:06d}", self._epoch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.save_freq == "epoch":
            self._save(f"epoch-{epoch + 1:04d}", epoch + 1)

    def on_train_end(self, logs: Any = None) -> None:
        # The run's disk ends compact and trimmed: the last push (a failure was logged,
        # never raised) and the retention first, then the compactor's work (a failure
        # there was logged; it is done later), so no retention after it leaves work undone.
        if self.mirror is not None:
            self.mirror.wait()
        trim(self.vault, keep_last=self.keep, training_state_last=self.training_state_last)
        settle(self.vault)

    def _save(self, name: str, epoch: int) -> None:
        optimizer = self.model.optimizer if self.save_optimizer else None
        self.vault.save(
            self.model,
            name,
            optimizer=optimizer,
            rng=self.rng,
            metadata={EPOCH_KEY: str(epoch), STEP_KEY: str(self._step)},
        )
        if self.mirror is not None:
            self.mirror.after_save(name)  # pushed in the mirror's thread
        trim(self.vault, keep_last=self.keep, training_state_last=self.training_state_last)


def restore(
    vault: VaultLike,
    model: Any,
    name: str = "latest",
    *,
    optimizer: bool = True,
    rng: bool = True,
    **options: Any,
) -> int:
    """Load a :class:`VaultCheckpoint` checkpoint into a compiled ``model``.

    The weights, ``model.optimizer``'s state (built first if ``fit`` has not run yet) and
    the RNG states come back, so ``fit(..., initial_epoch=restore(...))`` continues the
    saved run bit for bit when the data order is the same (``shuffle=False`` or a seeded
    pipeline).

    Args:
        vault: The :class:`~weightvault.Vault` to read, or its path or URL.
        model: A built Keras model, compiled with the same kind of optimizer.
        name: The checkpoint, or ``"latest"``.
        optimizer: Restore ``model.optimizer``'s state too.
        rng: Restore the RNG states too.
        **options: Passed to :meth:`~weightvault.Vault.load` (``strict``, ``rules``, ...).

    Returns:
        The number of epochs the checkpoint had completed: ``fit``'s ``initial_epoch``.

    Raises:
        TrainingStateError: ``optimizer`` is set but the model is not compiled, the
            checkpoint was not written by :class:`VaultCheckpoint` (no epoch recorded), or
            ``optimizer`` or ``rng`` is set and the checkpoint holds weights only (its
            training state was dropped by ``training_state_last``).
        VaultNotFoundError: ``vault`` is a path that holds no vault.

    Example:
        >>> start = restore(vault, model, "epoch-0001")
        >>> model.fit(x, y, epochs=2, initial_epoch=start)
    """
    vault = as_vault(vault)
    resolved = vault.resolve(name)
    record = next((r for r in vault.list() if r.name == resolved), None)
    epoch = None if record is None else record.metadata.get(EPOCH_KEY)
    if epoch is None or not epoch.isdigit():
        raise TrainingStateError(
            f"{vault.url}: checkpoint {resolved!r} records no Keras epoch; it was not "
            "written by VaultCheckpoint. Load it with vault.load(model, name, ...) instead"
        )
    if record is not None and record.weights_only and (optimizer or rng):
        raise TrainingStateError(
            f"{vault.url}: checkpoint {resolved!r} holds weights only: its optimizer and RNG "
            "state were dropped (training_state_last); restore a newer checkpoint, or pass "
            "optimizer=False, rng=False to load its weights alone"
        )
    opt = None
    if optimizer:
        opt = getattr(model, "optimizer", None)
        if opt is None:
            raise TrainingStateError(
                f"{type(model).__name__} has no optimizer to restore into; compile it "
                "first (model.compile(optimizer=..., loss=...)), or pass optimizer=False"
            )
    vault.load(model, resolved, optimizer=opt, rng=rng, **options)
    return int(epoch)
