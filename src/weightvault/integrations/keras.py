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

import math
import warnings
from typing import Any

import numpy as np

from .._base.errors import TrainingStateError, VaultNotFoundError
from .._vault.objects.codec import preload
from .._vault.records.record import CheckpointRecord
from .._vault.vault import Vault, VaultLike, as_vault
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
#: The monitored quantity, its direction (``"min"`` or ``"max"``), this checkpoint's value
#: of it and the best value of the run up to and including this checkpoint.
MONITOR_KEY = "keras.monitor"
MODE_KEY = "keras.mode"
VALUE_KEY = "keras.value"
BEST_KEY = "keras.best"
#: The vault label of the best checkpoint.
BEST = "best"


class VaultCheckpoint(keras.callbacks.Callback):  # type: ignore[misc]
    """Save ``fit``'s model, optimizer and RNG state into a vault, like ``ModelCheckpoint``.

    Checkpoints are named ``epoch-0003`` (the number of epochs completed, as Keras'
    ``{epoch}`` counts) or, with an integer ``save_freq``, ``step-000120`` (batches
    completed since this callback's first batch plus those of earlier epochs skipped by
    ``initial_epoch``). Each records the epoch and step as metadata (``keras.epoch``,
    ``keras.step``), which :func:`restore` reads back.

    The best checkpoint: ``monitor``, ``mode``, ``save_best_only`` and
    ``initial_value_threshold`` mean what they mean to ``ModelCheckpoint``, and the
    callback compares values as it does (strictly, in Keras' ops). Whenever the monitored
    value is in the logs and improves on the best so far, the checkpoint saved is marked
    ``"best"`` in the vault (``vault.load(model, "best")``), whether or not
    ``save_best_only`` is set; retention (``keep``, ``vault.retain``) never deletes it.
    Each checkpoint records the monitor, its direction and the best value up to it
    (``keras.monitor``, ``keras.mode``, ``keras.value``, ``keras.best``), and at
    ``on_train_begin`` the callback takes the best value of the vault's ``"best"``
    checkpoint (or, with none marked, of the newest checkpoint of the same monitor), so a
    ``fit`` resumed with a new callback does not mark or save a worse epoch as the best.

    Args:
        vault: The :class:`~weightvault.Vault` to save into, or its path or URL.
        save_freq: ``"epoch"``, or save every this many batches.
        save_optimizer: Also store ``model.optimizer``'s state (slots, iterations, learning
            rate and configuration) so training resumes exactly.
        monitor: The logged quantity that decides the best checkpoint (``"val_loss"``,
            ``"val_accuracy"``, ...). Missing from the logs, no checkpoint is marked.
        mode: ``"min"``, ``"max"``, or ``"auto"``: ``min`` for a loss, else the direction
            of the compiled metric of that name (``accuracy``, ``auc``: ``max``), as
            ``ModelCheckpoint`` infers it; a name it cannot place raises at the first
            epoch's end, as there.
        save_best_only: Save only when the monitored value improves on the best so far.
            A monitored value missing from the logs (or not a scalar) warns, and the
            checkpoint is saved, as ``ModelCheckpoint`` does.
        initial_value_threshold: The value the first best must beat.
        verbose: ``1`` prints what the callback decides at each save, as
            ``ModelCheckpoint(verbose=1)`` does.
        rng: Also store the Python, numpy, Keras ``SeedGenerator`` and torch RNG states.
        keep: After each save, keep only the last ``keep`` checkpoints of the vault, and
            the one marked ``"best"`` (:meth:`~weightvault.Vault.retain`; it applies to
            every checkpoint of the vault, not only this callback's), then free their
            bytes (``vault.gc()``).
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
            ``keep`` or ``training_state_last`` is below 1; at the first epoch's end,
            ``mode="auto"`` for a ``monitor`` whose direction Keras cannot tell.

    Example:
        >>> best = VaultCheckpoint(vault, monitor="val_loss", save_best_only=True)
        >>> model.fit(x, y, validation_split=0.25, epochs=3, callbacks=[best])
        >>> vault.load(fresh, "best")   # the epoch of the lowest val_loss
    """

    def __init__(
        self,
        vault: VaultLike,
        save_freq: str | int = "epoch",
        save_optimizer: bool = True,
        *,
        monitor: str = "val_loss",
        mode: str = "auto",
        save_best_only: bool = False,
        initial_value_threshold: float | None = None,
        verbose: int = 0,
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
        if mode not in ("auto", "min", "max"):
            # ModelCheckpoint's own warning and fallback (keras MonitorCallback).
            warnings.warn(
                f"{type(self).__name__} mode '{mode}' is unknown, fallback to auto mode.",
                stacklevel=2,
            )
            mode = "auto"
        self.vault = as_vault(vault)
        self.mirror = mirror_for(self.vault, mirror)
        self.save_freq = save_freq
        self.save_optimizer = save_optimizer
        self.monitor = monitor
        self.mode = mode
        self.save_best_only = save_best_only
        self.verbose = verbose
        #: The best monitored value so far (``initial_value_threshold`` until one beats it).
        self.best: float | None = initial_value_threshold
        self.rng = rng
        self.keep = keep
        self.training_state_last = training_state_last
        #: ``"min"`` or ``"max"`` once known (the first comparison, or an epoch's end).
        self._direction: str | None = None if mode == "auto" else mode
        #: ``(value, direction)`` taken from the vault at ``on_train_begin``.
        self._carried: tuple[float, str] | None = None
        self._epoch = 0
        self._step = 0

    def on_train_begin(self, logs: Any = None) -> None:
        preload()  # here, not in the compactor's thread: it draws from ``random``
        self._step = 0
        self._carried = vault_best(self.vault, self.monitor, self.mode)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._step += 1
        if isinstance(self.save_freq, int) and self._step % self.save_freq == 0:
            self._save(f"step-{self._step:06d}", self._epoch, logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._resolve()  # where ModelCheckpoint resolves it: every metric is built by now
        if self.save_freq == "epoch":
            self._save(f"epoch-{epoch + 1:04d}", epoch + 1, logs)

    def on_train_end(self, logs: Any = None) -> None:
        # The run's disk ends compact and trimmed: the last push (a failure was logged,
        # never raised) and the retention first, then the compactor's work (a failure
        # there was logged; it is done later), so no retention after it leaves work undone.
        if self.mirror is not None:
            self.mirror.wait()
        trim(self.vault, keep_last=self.keep, training_state_last=self.training_state_last)
        settle(self.vault)

    def _resolve(self) -> str:
        """The monitor's direction, found once; the vault's best joins ``best`` then."""
        if self._direction is None:
            self._direction = monitor_direction(self.model, self.monitor)
        if self._carried is not None:
            value, direction = self._carried
            self._carried = None
            if direction != self._direction:
                warnings.warn(
                    f"{self.vault.url}: its best {self.monitor} ({value!r}) was taken as "
                    f"{direction!r} (mode), this callback's is {self._direction!r}; its "
                    f"best is ignored. Pass mode={direction!r} to compare against it",
                    stacklevel=2,
                )
            elif self.best is None or _improves(value, self.best, direction):
                self.best = value
        return self._direction

    def _decide(self, logs: Any, name: str, epoch: int) -> tuple[bool, bool]:
        """``(save, mark)`` for the monitored value in ``logs``: ModelCheckpoint's rule."""
        current = (logs or {}).get(self.monitor)
        if current is None:
            if self.save_best_only:
                warnings.warn(
                    f"Can save best model only with {self.monitor} available.", stacklevel=3
                )
            return True, False
        if (isinstance(current, np.ndarray) or keras.ops.is_tensor(current)) and len(
            current.shape
        ) > 0:
            if self.save_best_only:
                warnings.warn(
                    f"Can save best model only when `monitor` is a scalar value. Received: "
                    f"{current}. Falling back to `save_best_only=False`.",
                    stacklevel=3,
                )
            return True, False
        direction = self._resolve()
        before = "None" if self.best is None else f"{self.best:.5f}"
        if self.best is None or _improves(current, self.best, direction):
            self._say(
                f"\nEpoch {epoch}: {self.monitor} improved from {before} to "
                f"{current:.5f}, saving checkpoint {name} to {self.vault.url}"
            )
            self.best = float(current)
            return True, True
        if self.save_best_only:
            self._say(f"\nEpoch {epoch}: {self.monitor} did not improve from {before}")
        else:
            self._say(f"\nEpoch {epoch}: saving checkpoint {name} to {self.vault.url}")
        return not self.save_best_only, False

    def _say(self, text: str) -> None:
        if self.verbose > 0:
            print(text)

    def _save(self, name: str, epoch: int, logs: Any = None) -> None:
        # Keras' message counts epochs from 1, as the name does; a step save is mid-epoch.
        save, best = self._decide(logs, name, epoch if name.startswith("epoch-") else epoch + 1)
        if not save:
            return
        metadata = {EPOCH_KEY: str(epoch), STEP_KEY: str(self._step), MONITOR_KEY: self.monitor}
        if self._direction is not None:
            metadata[MODE_KEY] = self._direction
        current = (logs or {}).get(self.monitor)
        if isinstance(current, (int, float, np.number)):
            metadata[VALUE_KEY] = repr(float(current))
        if self.best is not None:
            metadata[BEST_KEY] = repr(float(self.best))  # repr: the float back bit for bit
        optimizer = self.model.optimizer if self.save_optimizer else None
        self.vault.save(self.model, name, optimizer=optimizer, rng=self.rng, metadata=metadata)
        if best:
            self.vault.mark(name, BEST)  # before the push, so the mirror gets the mark
        if self.mirror is not None:
            self.mirror.after_save(name)  # pushed in the mirror's thread
        trim(self.vault, keep_last=self.keep, training_state_last=self.training_state_last)


def monitor_direction(model: Any, monitor: str) -> str:
    """``"min"`` or ``"max"`` for ``monitor`` with ``mode="auto"``, as Keras infers it.

    ``loss`` (``val_`` prefix or not) is ``min``; a compiled metric of that name is
    ``max`` when its direction is up (accuracies, AUC, precision, recall, R2, ...) and
    ``min`` when it is down, the rule of Keras' ``MonitorCallback._set_monitor_op``.

    Raises:
        ValueError: Neither applies; Keras' own message, which suggests ``mode``.

    Example:
        >>> model.compile(optimizer="adam", loss="mse", metrics=["accuracy"])
        >>> monitor_direction(model, "val_accuracy"), monitor_direction(model, "loss")
        ('max', 'min')
    """
    name = monitor.removeprefix("val_")
    found = "min" if name == "loss" else None
    compiled = []
    for metric in getattr(model, "metrics", None) or []:
        inner = getattr(metric, "metrics", None)  # Keras looks inside the compiled lists only
        if isinstance(inner, list):
            compiled.extend(inner)
    for metric in compiled:
        # ``_direction`` is Keras' own, private but the one thing its rule reads; a Keras
        # without it leaves every metric unplaced, and the error below suggests ``mode``.
        direction = getattr(metric, "_direction", None)
        if getattr(metric, "name", None) == name and direction is not None:
            found = "max" if direction == "up" else "min"
    if found is None:
        raise ValueError(
            f"VaultCheckpoint callback received monitor={monitor}, but Keras isn't able to "
            "automatically determine whether that metric should be maximized or minimized. "
            "Pass `mode='max'` in order to monitor based on the highest metric value, or "
            "pass `mode='min'` in order to use the lowest value."
        )
    return found


def vault_best(vault: Vault, monitor: str, mode: str = "auto") -> tuple[float, str] | None:
    """The best ``monitor`` value a vault's checkpoints recorded, and its direction.

    It is that of the checkpoint marked ``"best"`` when a :class:`VaultCheckpoint` of the
    same ``monitor`` saved it, else that of the newest checkpoint such a callback saved
    (the best of the run up to it); ``None`` when there is none, or when ``mode`` (other
    than ``"auto"``) is not the direction it was recorded with.

    Example:
        >>> vault_best(vault, "val_loss")
        (0.4183, 'min')
    """
    try:
        records = vault.list()
        marked = vault.marks().get(BEST)
    except VaultNotFoundError:
        return None  # nothing saved yet
    ours = [r for r in records if _recorded(r, monitor) is not None]
    chosen = next((r for r in ours if r.name == marked), ours[-1] if ours else None)
    found = None if chosen is None else _recorded(chosen, monitor)
    if found is None or mode not in ("auto", found[1]):
        return None
    return found


def _recorded(record: CheckpointRecord, monitor: str) -> tuple[float, str] | None:
    """``(best, direction)`` a checkpoint of ``monitor`` recorded, if it is one."""
    meta = record.metadata
    if meta.get(MONITOR_KEY) != monitor or meta.get(MODE_KEY) not in ("min", "max"):
        return None
    try:
        best = float(meta[BEST_KEY])
    except (KeyError, ValueError):
        return None
    return (best, meta[MODE_KEY]) if not math.isnan(best) else None


def _improves(current: Any, best: Any, direction: str) -> bool:
    """Whether ``current`` beats ``best``: strictly, in Keras' ops as ``ModelCheckpoint``
    compares them (so in ``floatx``: two values float32 cannot tell apart tie)."""
    op = keras.ops.greater if direction == "max" else keras.ops.less
    return bool(op(current, best))


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
