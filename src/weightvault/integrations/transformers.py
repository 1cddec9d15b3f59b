"""The Hugging Face ``Trainer`` checkpoints into a vault instead of ``checkpoint-N`` folders.

One line changes in a training script::

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[VaultCallback(vault)])

At every save the Trainer decides (``save_steps``, ``save_strategy``, ``"best"``
included), the callback stores the model, the optimizer (by parameter name), the LR
scheduler, the RNG states and the ``TrainerState`` (as JSON) as checkpoint
``checkpoint-{global_step}``, and keeps the Trainer from writing its own folder.
Unchanged tensors (a frozen base, a PEFT model's base weights) are stored once across all
checkpoints. With ``metric_for_best_model`` (or ``load_best_model_at_end``) the best
checkpoint is named ``vault://<vault>#checkpoint-N`` in ``state.best_model_checkpoint``,
marked ``"best"`` in the vault and kept by ``save_total_limit``, and loaded at the end.

To resume, :func:`checkout` writes a folder in the Trainer's own layout, which
``trainer.train(resume_from_checkpoint=folder)`` reads; :func:`resume` does both in one call.

Under ``torchrun`` (DDP) nothing changes in the script: the main process writes each
checkpoint once, with every rank's RNG states, and a failed save raises on every rank. A
model transformers shards as it loads it (FSDP2, ``distributed_config=``) is saved
through :mod:`weightvault.dcp` on every rank instead, and :func:`resume` resumes it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .._vault.objects.codec import preload
from ._common import (
    BEST,
    best_name,
    checkpoint_name,
    discard,
    mirror_for,
    not_installed,
    retained,
    settle,
    trim,
)

try:
    import torch
    from transformers import TrainerCallback, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise not_installed("transformers", "transformers and PyTorch") from e

from .. import _training
from .._base.errors import TrainingStateError, UnsupportedValueError
from .._file.checkpoint import Checkpoint
from .._ranks import agree, rank, sharded_parameter
from .._torch.tensors import stored_tensor
from .._training import codec as _codec
from .._vault.records.dcp import DcpCheckpoint
from .._vault.vault import VaultLike, as_vault
from ..torch import load_file as _load_file, save as _save
from ._best import FIX, STATE_KEY, Due, SavePoints, check_best, rng_as, trainer_callbacks
from ._rank_rng import RANKS_KEY, decode_ranks, encode_ranks, rank_rng
from ._sharded_trainer import resume_sharded, save_sharded, unwrap

__all__ = ["VaultCallback", "checkout", "resume"]


class VaultCallback(SavePoints, TrainerCallback):  # type: ignore[misc]
    """A ``TrainerCallback`` that saves the Trainer's checkpoints into a vault.

    Saves happen at the steps the Trainer chooses, ``save_strategy="best"`` included, with
    the ``TrainerState``, the stateful callbacks' states (``EarlyStoppingCallback``) and
    the RNG states the Trainer's own save would store. A checkpoint of the same name (from
    a run this one resumed, stepping past its point again) is replaced.
    ``save_total_limit`` keeps that many of the newest checkpoints and the best (through
    :meth:`Vault.retain`; it counts every checkpoint in the vault, so give each run its
    own vault). Training itself is untouched: the final parameters are bitwise equal to a
    run without the callback.

    When the Trainer tracks a best checkpoint (``metric_for_best_model``, set by
    ``load_best_model_at_end``), its ``state.best_model_checkpoint`` names it
    ``vault://<vault URL>#checkpoint-N`` (which :func:`checkout` and :func:`resume`
    take), the vault marks it ``"best"`` (``vault.load(model, "best")``), and with
    ``load_best_model_at_end`` the end of training loads it into the model from the vault,
    where the Trainer would load its folder.

    On several processes (DDP under ``torchrun``) every rank skips the Trainer's own save,
    the main process writes, and the ranks then agree: a save that failed raises
    :class:`~weightvault.DistributedCheckpointError` on every rank, never a hang. A model
    whose parameters are DTensors (FSDP2 from ``from_pretrained(...,
    distributed_config=DistributedConfig(fsdp_size=N))``) is saved with
    :func:`weightvault.dcp.save` on every rank: each shard once, by the rank holding it.
    An FSDP1-wrapped model is refused when training begins; see docs/integrations.md.

    Args:
        vault: Where checkpoints go: a :class:`~weightvault.Vault`, or its path or URL
            (``"runs/vault"``, ``"s3://bucket/vault"``).
        background: Copy what training changes (trainable weights, buffers, optimizer
            state) at the save step and write in a thread while training continues. The
            next save, and the end of training, wait for it.
        training_state_last: Keep the weights of every checkpoint but the optimizer,
            scheduler, RNG and Trainer state of only the newest ``N``: after each save the
            older ones become weights-only (:meth:`Vault.retain`; like ``save_total_limit``
            it counts every checkpoint of the vault). They still load with
            ``vault.load(model, name)``; :func:`checkout` of one raises
            :class:`~weightvault.TrainingStateError` naming it. ``None`` keeps it all.
        mirror: Another vault (a path or a URL such as ``"s3://bucket/run1"``) that
            each checkpoint is pushed to once it commits, in a background thread: only
            the objects the mirror lacks travel. A failing mirror logs a warning per
            checkpoint and is retried at the next save; it never fails a step. Local
            retention never deletes from it. The end of training waits for the last push.

    Example:
        >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[VaultCallback(vault)])
        >>> trainer.train()
        >>> [r.name for r in vault.list()]
        ['checkpoint-2', 'checkpoint-4', 'checkpoint-6']
    """

    def __init__(
        self,
        vault: VaultLike,
        *,
        background: bool = False,
        training_state_last: int | None = None,
        mirror: VaultLike | None = None,
    ) -> None:
        if training_state_last is not None and training_state_last < 1:
            raise ValueError(
                f"training_state_last must be at least 1 (None keeps every checkpoint's "
                f"training state), not {training_state_last!r}"
            )
        self.vault = as_vault(vault)
        self.mirror = mirror_for(self.vault, mirror)
        self.background = background
        self.training_state_last = training_state_last
        self._pending: Any = None
        self._inflight: str | None = None  # a background save's name, on every rank
        self._sharded = False  # the model is DTensors: every rank saves its shards
        self._callbacks = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # Every rank holds the same kind of model, so every rank decides alike, at once.
        model = kwargs["model"]
        sharded = sharded_parameter(model)
        self._sharded = sharded is not None and _dtensors(model)
        if sharded is not None and not self._sharded:
            raise UnsupportedValueError(
                "VaultCallback saves a sharded model through weightvault.dcp when its "
                "parameters are DTensors (FSDP2, tensor parallelism), but this Trainer wraps it "
                f"in FSDP1: parameter {sharded!r} is a flat shard; shard with FSDP2 "
                "(from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N))), "
                "or train with DDP"
            )
        if self._sharded and self.background:
            raise UnsupportedValueError(
                f"VaultCallback(background=True) cannot save a sharded model: parameter "
                f"{sharded!r} is a shard, saved by every rank through weightvault.dcp; use "
                "background=False"
            )
        check_best(args)
        if self._sharded and getattr(args, "load_best_model_at_end", False):
            raise UnsupportedValueError(
                f"VaultCallback cannot load the best checkpoint of a sharded model (parameter "
                f"{sharded!r} is a shard) at the end of training: set "
                "load_best_model_at_end=False and load it with resume_sharded's weightvault.dcp"
            )
        self._callbacks = trainer_callbacks()
        preload()
        self._due, self._training, self._best, self._hidden = None, True, None, None
        if state.global_step and getattr(args, "metric_for_best_model", None) is not None:
            self._resumed(state)
        return self._release(control)[0]

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        hidden, self._hidden = self._hidden, None
        if hidden is not None and state.best_model_checkpoint is None:
            state.best_model_checkpoint = hidden
        control = self._flush(args, state, control, kwargs)  # an epoch's save, at the last
        self._training = False
        self._settle(args)
        # The last push first (a failure was logged, never raised): the retention the
        # mirror held back for it runs then, and the retention below has nothing left
        # to wait for. Settling last leaves the run's disk compact and trimmed: settled
        # first, a retention that ran after it left to-do markers, and a weights-only
        # oldest whole (a mirror that lagged behind the run, as on a busy machine).
        if self.mirror is not None:
            self.mirror.wait()
        self._retain_agreed(args, "at the end of training", final=True)
        best = best_name(state.best_model_checkpoint)
        if getattr(args, "load_best_model_at_end", False) and best is not None:
            error = None  # where the Trainer loads its best folder: every rank
            try:
                self.vault.load(kwargs["model"], best)
            except Exception as e:
                error = e
            agree(error, f"the load of the best checkpoint {best} from {self.vault.url}", FIX)
        settle(self.vault)
        return control

    def _take(self, args: Any, state: Any, control: Any, due: Due, kwargs: dict[str, Any]) -> None:
        """Store checkpoint ``checkpoint-{global_step}`` as the Trainer's save would."""
        self._settle(args)
        name = f"checkpoint-{state.global_step}"
        self._at_save(args, state, control, name)
        error = None
        with rng_as(due.rng):
            if self._sharded:
                metadata = _metadata(state, due.ranks or [rank_rng()])
                self._write_sharded(args, name, metadata, kwargs)
                return
            if args.should_save:  # the Trainer's own rule: the main process writes
                try:
                    self._write(args, state, name, due.ranks, kwargs)
                except Exception as e:  # every rank must hear of it, or they wait forever
                    error = e
        agree(error, f"the vault save of {name} into {self.vault.url}", FIX)
        self._inflight = name if self.background else None

    def _write(
        self,
        args: TrainingArguments,
        state: TrainerState,
        name: str,
        ranks: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> None:
        """Store the checkpoint (on the writing rank only)."""
        metadata = _metadata(state, ranks)
        # A run resumed from an earlier step replaces the later checkpoints of the run it
        # left, as the Trainer overwrites its folders.
        discard(self.vault, name)
        result = self.vault.save(
            kwargs["model"],
            name,
            optimizer=unwrap(kwargs.get("optimizer"), "optimizer"),
            scheduler=unwrap(kwargs.get("lr_scheduler"), "scheduler"),
            rng=True,
            background=self.background,
            metadata=metadata,
        )
        if self.background:
            self._pending = result
        else:
            self._mirrored(name)
            self._retain(args)

    def _write_sharded(
        self, args: TrainingArguments, name: str, metadata: dict[str, str], kwargs: dict[str, Any]
    ) -> None:
        """Store the checkpoint of a sharded model (every rank, collective)."""
        save_sharded(
            self.vault, name, kwargs["model"], unwrap(kwargs.get("optimizer"), "optimizer"),
            unwrap(kwargs.get("lr_scheduler"), "scheduler"), metadata, FIX,
        )  # fmt: skip
        if rank() == 0:
            self._mirrored(name)
        self._retain_agreed(args, f"after {name}")

    def _retain_agreed(self, args: TrainingArguments, when: str, *, final: bool = False) -> None:
        """:meth:`_retain` on rank 0, then every rank agrees (collective): a failed
        retention raises on every rank."""
        error = None
        if rank() == 0:
            try:
                self._retain(args, final=final)
            except Exception as e:
                error = e
        agree(error, f"the retention {when} in {self.vault.url}", FIX)

    def _settle(self, args: TrainingArguments) -> None:
        """Wait for the background save; collective, as the save's own :func:`agree` is."""
        name, self._inflight = self._inflight, None
        if name is None:
            return
        pending, self._pending = self._pending, None
        error = None
        try:
            if pending is not None:
                pending.wait()
                self._mirrored(name)
                self._retain(args)
        except Exception as e:
            error = e
        agree(error, f"the background vault save of {name} into {self.vault.url}", FIX)

    def _mirrored(self, name: str) -> None:
        """Queue committed checkpoint ``name`` for the mirror's thread (returns at once)."""
        if self.mirror is not None:
            self.mirror.after_save(name)

    def _retain(self, args: TrainingArguments, *, final: bool = False) -> None:
        """The Trainer's rotation (the best and the newest kept) and training_state_last."""
        best = self._best
        if best is not None and best != self._marked:  # committed now: marked, then spared
            self.vault.mark(best, BEST)
            self._marked = best
        limit = args.save_total_limit or None
        keep = retained(self.vault, limit, best, final=final)
        trim(self.vault, keep_last=keep, training_state_last=self.training_state_last)


def _metadata(state: TrainerState, ranks: list[dict[str, Any]] | None) -> dict[str, str]:
    """A checkpoint's metadata: the ``TrainerState``, its step, and each rank's RNG."""
    metadata = {
        STATE_KEY: json.dumps(dataclasses.asdict(state), sort_keys=True),
        "global_step": str(state.global_step),
    }
    if ranks is not None:
        metadata[RANKS_KEY] = encode_ranks(ranks)
    return metadata


def checkout(vault: VaultLike, name: str, folder: str | os.PathLike[str]) -> Path:
    """Write checkpoint ``name`` as a folder ``trainer.train(resume_from_checkpoint=...)`` reads.

    The folder holds ``model.safetensors`` (every weight, tied ones as aliases),
    ``trainer_state.json``, and ``optimizer.pt``, ``scheduler.pt`` and ``rng_state.pth``:
    the Trainer reads those three with ``torch.load``, so they are written with
    ``torch.save`` of plain state dicts (tensors, numbers, lists), the Trainer's own
    format. weightvault never reads them back. ``trainer_state.json`` keeps
    ``best_metric`` and ``best_global_step`` but not a ``vault://`` best: it names no
    folder, and the Trainer would drop it with a warning; a resumed :class:`VaultCallback`
    names it again from the vault.

    Args:
        vault: The vault the :class:`VaultCallback` saved into, or its path or URL.
        name: A checkpoint name (``checkpoint-4``), ``"latest"``, ``"best"`` (the marked
            best) or ``state.best_model_checkpoint`` (``vault://...#checkpoint-2``).
        folder: Where to write; created if needed. Files of the same names are replaced.

    Returns:
        ``folder`` as a ``Path``.

    Raises:
        CheckpointNotFoundError: The vault has no checkpoint ``name``.
        ChecksumError: An object of the checkpoint is damaged (nothing is written).
        TrainingStateError: The checkpoint was not saved by :class:`VaultCallback` (it
            lacks the Trainer state, the optimizer, the scheduler or the RNG states), holds
            weights only (``training_state_last`` dropped its training state), or is a
            sharded model's (use :func:`resume` under ``torchrun``).

    Example:
        >>> folder = checkout(vault, "latest", "resume/")
        >>> trainer.train(resume_from_checkpoint=str(folder))
    """
    out = Path(folder)
    with as_vault(vault).open(checkpoint_name(name)) as ckpt:
        where = ckpt.path
        if isinstance(ckpt, DcpCheckpoint):
            raise TrainingStateError(
                f"{where} is a sharded model's checkpoint (weightvault.dcp): its optimizer "
                "state is kept by shard, not as a folder the Trainer reads; resume it with "
                "resume(trainer, vault, name) on every rank, or load its weights alone with "
                "vault.load(model, name)"
            )
        state = ckpt.manifest.metadata.get(STATE_KEY)
        if ckpt.record.weights_only:
            raise TrainingStateError(
                f"{where} holds weights only: its optimizer, scheduler, RNG and Trainer state "
                "were dropped (training_state_last); resume from a newer checkpoint, or load "
                "its weights with vault.load(model, name)"
            )
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
        ranks = ckpt.manifest.metadata.get(RANKS_KEY)
        per_rank = {} if ranks is None else decode_ranks(ranks, where)
        weights = _load_file(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    _save(weights, out / "model.safetensors")
    torch.save(optimizer, out / "optimizer.pt")
    torch.save(scheduler, out / "scheduler.pt")
    torch.save(rng, out / "rng_state.pth")
    for r, states in per_rank.items():  # a distributed Trainer reads its rank's file
        torch.save(states, out / f"rng_state_{r}.pth")
    doc = json.loads(state)
    if best_name(doc.get("best_model_checkpoint")) is not None:
        # It names no folder: the Trainer would drop it as it resumes, with a warning.
        # VaultCallback names it again from the vault (best_metric and the step are kept).
        doc["best_model_checkpoint"] = None
    (out / "trainer_state.json").write_text(json.dumps(doc, indent=2) + "\n")
    return out


def resume(trainer: Any, vault: VaultLike, name: str = "latest", **train_kwargs: Any) -> Any:
    """Resume ``trainer`` from vault checkpoint ``name`` in one call.

    Checks the checkpoint out into a temporary folder (removed afterwards) and calls
    ``trainer.train(resume_from_checkpoint=...)``. ``vault`` may be a path or URL. Under
    ``torchrun`` every rank calls it: each checks out its own folder (ranks need not share
    a file system), and a checkout that fails on one rank raises on all of them. A sharded
    model (FSDP2) gets its shards, optimizer and scheduler state through
    :func:`weightvault.dcp.load` when training begins, the rest from the folder.

    ``name`` is any name :func:`checkout` takes (``"best"``, a ``vault://`` URL).

    Returns:
        What ``trainer.train`` returns.

    Raises:
        DistributedCheckpointError: The checkout failed on some rank (several processes).

    Example:
        >>> resume(trainer, "runs/vault", "checkpoint-2")
    """
    if sharded_parameter(trainer.model) is not None:
        return resume_sharded(trainer, as_vault(vault), checkpoint_name(name), **train_kwargs)
    with tempfile.TemporaryDirectory(prefix="weightvault-resume-") as tmp:
        error = None
        try:
            folder = checkout(vault, name, tmp)
        except Exception as e:  # the other ranks would wait in the Trainer's first collective
            error = e
        agree(error, f"the checkout of {name!r} from {vault}", "resume from another checkpoint")
        return trainer.train(resume_from_checkpoint=str(folder), **train_kwargs)


def _dtensors(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (FSDP2, tensor parallel)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


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
