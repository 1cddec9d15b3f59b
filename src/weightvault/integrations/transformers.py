"""The Hugging Face ``Trainer`` checkpoints into a vault instead of ``checkpoint-N`` folders.

One line changes in a training script::

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[VaultCallback(vault)])

At every save step the Trainer decides (``save_steps``, ``save_strategy``), the callback
stores the model, the optimizer (by parameter name), the LR scheduler, the RNG states and
the ``TrainerState`` (as JSON) as checkpoint ``checkpoint-{global_step}``, and tells the
Trainer not to write its own folder. Unchanged tensors (a frozen base, a PEFT model's base
weights) are stored once across all checkpoints.

To resume, :func:`checkout` writes a folder in the Trainer's own layout, which
``trainer.train(resume_from_checkpoint=folder)`` reads; :func:`resume` does both in one call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ._common import discard, not_installed

try:
    import torch
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise not_installed("transformers", "transformers and PyTorch") from e

from .. import _training
from .._base.errors import TrainingStateError
from .._file.checkpoint import Checkpoint
from .._torch.tensors import stored_tensor
from .._training import codec as _codec
from .._vault.vault import VaultLike, as_vault
from ..torch import load_file as _load_file, save as _save

__all__ = ["VaultCallback", "checkout", "resume"]

#: The metadata key that holds the ``TrainerState`` as JSON.
STATE_KEY = "trainer_state"


def _unwrap(obj: Any, attr: str) -> Any:
    """The torch optimizer or scheduler inside accelerate's wrapper (which delegates)."""
    inner = getattr(obj, attr, None)
    return inner if type(obj).__name__.startswith("Accelerated") and inner is not None else obj


class VaultCallback(TrainerCallback):  # type: ignore[misc]
    """A ``TrainerCallback`` that saves the Trainer's checkpoints into a vault.

    Saves happen at the steps the Trainer chooses. A checkpoint of the same name (from a
    run this one resumed, stepping past its point again) is replaced. ``save_total_limit``
    keeps that many of the newest checkpoints (through :meth:`Vault.retain`; it counts
    every checkpoint in the vault, so give each run its own vault). Training itself is
    untouched: the final parameters are bitwise equal to a run without the callback.

    Args:
        vault: Where checkpoints go: a :class:`~weightvault.Vault`, or its path or URL
            (``"runs/vault"``, ``"s3://bucket/vault"``).
        background: Copy what training changes (trainable weights, buffers, optimizer
            state) at the save step and write in a thread while training continues. The
            next save, and the end of training, wait for it.

    Example:
        >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[VaultCallback(vault)])
        >>> trainer.train()
        >>> [r.name for r in vault.list()]
        ['checkpoint-2', 'checkpoint-4', 'checkpoint-6']
    """

    def __init__(self, vault: VaultLike, *, background: bool = False) -> None:
        self.vault = as_vault(vault)
        self.background = background
        self._pending: Any = None

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> TrainerControl:
        # The Trainer saves right after this event when control.should_save is set; saving
        # here and clearing the flag stores the same state and skips its folder. The RNG
        # states are those the Trainer would store: nothing draws between the two points.
        if not control.should_save or not args.should_save:
            return control
        self._settle(args)
        # What the Trainer's own save records about the control flow, as it does.
        callbacks: Any = state.stateful_callbacks  # a dict once training runs
        callbacks["TrainerControl"] = control.state()
        doc = json.dumps(dataclasses.asdict(state), sort_keys=True)
        name = f"checkpoint-{state.global_step}"
        # A run resumed from an earlier step replaces the later checkpoints of the run it
        # left, as the Trainer overwrites its folders.
        discard(self.vault, name)
        result = self.vault.save(
            kwargs["model"],
            name,
            optimizer=_unwrap(kwargs.get("optimizer"), "optimizer"),
            scheduler=_unwrap(kwargs.get("lr_scheduler"), "scheduler"),
            rng=True,
            background=self.background,
            metadata={STATE_KEY: doc, "global_step": str(state.global_step)},
        )
        if self.background:
            self._pending = result
        else:
            self._retain(args)
        control.should_save = False
        return control

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._settle(args)

    def _settle(self, args: TrainingArguments) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
            self._retain(args)

    def _retain(self, args: TrainingArguments) -> None:
        if args.save_total_limit:
            self.vault.retain(keep_last=args.save_total_limit)


def checkout(vault: VaultLike, name: str, folder: str | os.PathLike[str]) -> Path:
    """Write checkpoint ``name`` as a folder ``trainer.train(resume_from_checkpoint=...)`` reads.

    The folder holds ``model.safetensors`` (every weight, tied ones as aliases),
    ``trainer_state.json``, and ``optimizer.pt``, ``scheduler.pt`` and ``rng_state.pth``:
    the Trainer reads those three with ``torch.load``, so they are written with
    ``torch.save`` of plain state dicts (tensors, numbers, lists), the Trainer's own
    format. weightvault never reads them back.

    Args:
        vault: The vault the :class:`VaultCallback` saved into, or its path or URL.
        name: A checkpoint name (``checkpoint-4``) or ``"latest"``.
        folder: Where to write; created if needed. Files of the same names are replaced.

    Returns:
        ``folder`` as a ``Path``.

    Raises:
        CheckpointNotFoundError: The vault has no checkpoint ``name``.
        ChecksumError: An object of the checkpoint is damaged (nothing is written).
        TrainingStateError: The checkpoint was not saved by :class:`VaultCallback` (it
            lacks the Trainer state, the optimizer, the scheduler or the RNG states).

    Example:
        >>> folder = checkout(vault, "latest", "resume/")
        >>> trainer.train(resume_from_checkpoint=str(folder))
    """
    out = Path(folder)
    with as_vault(vault).open(name) as ckpt:
        where = ckpt.path
        state = ckpt.manifest.metadata.get(STATE_KEY)
        if state is None or ckpt.manifest.training is None:
            raise TrainingStateError(
                f"{where} was not saved by VaultCallback: it lacks the Trainer state or the "
                "training state; save with VaultCallback to resume a Trainer from it"
            )
        ckpt.verify()  # as vault.load does: damaged objects never reach the Trainer
        training = _training.read_training(ckpt.manifest.training, where)
        optimizer = _optimizer_state(ckpt, training, where)
        scheduler = _scheduler_state(training, where)
        rng = _rng_state(ckpt, training, where)
        weights = _load_file(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    _save(weights, out / "model.safetensors")
    torch.save(optimizer, out / "optimizer.pt")
    torch.save(scheduler, out / "scheduler.pt")
    torch.save(rng, out / "rng_state.pth")
    (out / "trainer_state.json").write_text(json.dumps(json.loads(state), indent=2) + "\n")
    return out


def resume(trainer: Any, vault: VaultLike, name: str = "latest", **train_kwargs: Any) -> Any:
    """Resume ``trainer`` from vault checkpoint ``name`` in one call.

    Checks the checkpoint out into a temporary folder (removed afterwards) and calls
    ``trainer.train(resume_from_checkpoint=...)``. ``vault`` may be a path or URL.

    Returns:
        What ``trainer.train`` returns.

    Example:
        >>> resume(trainer, "runs/vault", "checkpoint-2")
    """
    with tempfile.TemporaryDirectory(prefix="weightvault-resume-") as tmp:
        folder = checkout(vault, name, tmp)
        return trainer.train(resume_from_checkpoint=str(folder), **train_kwargs)


def _tensor(ckpt: Checkpoint, name: str) -> torch.Tensor:
    """A tensor of its own (never the file mapping) for a training-state name."""
    stored = _training.stored_name(ckpt, name)
    if stored is None:
        raise TrainingStateError(
            f"{ckpt.path}: its training state names tensor {name!r}, which the checkpoint "
            "does not hold; the checkpoint is damaged: resume from another one"
        )
    return stored_tensor(ckpt, stored, mmap=False).clone()


def _optimizer_state(ckpt: Checkpoint, training: dict[str, Any], where: str) -> dict[str, Any]:
    """The positional ``optimizer.state_dict()`` the Trainer's optimizer takes.

    The Trainer builds its optimizer the same way on resume, so the saved groups, in their
    saved order, give each parameter its position.
    """
    saved = _training.read_optimizer(
        training, lambda n: _training.stored_name(ckpt, n) is not None, where
    )
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in saved.groups:
        ids = []
        for pname in group.params:
            rec = saved.params.get(pname)
            if rec is not None:
                entry: dict[str, Any] = dict(rec.values)
                for key, stored in rec.tensors.items():
                    entry[key] = _tensor(ckpt, stored)
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**group.hyper, "params": ids})
    return {"state": state, "param_groups": groups}


def _scheduler_state(training: dict[str, Any], where: str) -> dict[str, Any]:
    doc = training.get("scheduler")
    if not isinstance(doc, dict) or not isinstance(doc.get("state"), dict):
        raise TrainingStateError(f"{where} holds no scheduler state; it cannot resume a Trainer")
    return {k: _codec.decode(v, where) for k, v in doc["state"].items()}


def _rng_state(ckpt: Checkpoint, training: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``rng_state.pth`` dict the Trainer restores; validated before anything is written."""
    doc = training.get("rng")
    if not isinstance(doc, dict) or not isinstance(doc.get("torch"), str):
        raise TrainingStateError(f"{where} holds no RNG state; it cannot resume a Trainer")
    out: dict[str, Any] = {
        "python": _training.python_state(doc.get("python"), where),
        "numpy": _training.numpy_state(doc.get("numpy"), where),
        "cpu": _tensor(ckpt, doc["torch"]),
    }
    cuda = doc.get("cuda") or []
    if cuda and torch.cuda.is_available():
        # The Trainer restores one device's state outside distributed runs.
        out["cuda"] = _tensor(ckpt, cuda[0])
    return out
