"""The Trainer's checkpoints of a sharded (FSDP2) model, through :mod:`weightvault.dcp`.

transformers shards a model as it loads it (``from_pretrained(...,
distributed_config=DistributedConfig(fsdp_size=N))``, on GPUs or on CPUs with gloo), and
the Trainer then trains it as it is. No process holds that model whole, so
:class:`~weightvault.integrations.transformers.VaultCallback` saves it with
:func:`weightvault.dcp.save` on every rank: each shard and its optimizer state is written
once, by the rank that holds it, and the ``TrainerState``, the LR scheduler's state and
every rank's RNG states go into the checkpoint's metadata as JSON.

To resume, :func:`resume_sharded` gives the Trainer a folder holding only what the
Trainer restores by itself (``trainer_state.json``, one ``rng_state_<rank>.pth`` per
rank), so it restores its counters, skips the batches already trained and restores each
rank's RNG states as from its own checkpoint. The model, the optimizer and the scheduler
come from the vault when training begins (:class:`LoadSharded`), once the Trainer has
built the optimizer.

Example:
    >>> sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    >>> unwrap(sgd, "optimizer") is sgd
    True
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .._base.errors import DistributedCheckpointError, TrainingStateError
from .._ranks import agree, gather, rank
from .._training import codec as _codec
from .._vault.vault import Vault
from ._common import discard
from ._rank_rng import RANKS_KEY, decode_ranks

__all__ = ["SCHEDULER_KEY", "LoadSharded", "resume_sharded", "save_sharded", "unwrap"]

#: The metadata key of the LR scheduler's state, as JSON (a sharded checkpoint's).
SCHEDULER_KEY = "trainer_scheduler"
#: The metadata key of the TrainerState, as JSON (the same as a whole model's checkpoint).
STATE_KEY = "trainer_state"
#: The shard file the stand-in weight index names; it holds no tensor.
_STAND_IN = "weights-load-from-the-vault.safetensors"


def unwrap(obj: Any, attr: str) -> Any:
    """The torch optimizer or scheduler inside accelerate's wrapper (which delegates)."""
    inner = getattr(obj, attr, None)
    return inner if type(obj).__name__.startswith("Accelerated") and inner is not None else obj


def save_sharded(
    vault: Vault,
    name: str,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    metadata: dict[str, str],
    fix: str,
) -> None:
    """Commit checkpoint ``name`` of a sharded model on every rank; collective.

    A checkpoint of that name (from the run a resumed one left) is replaced first.

    Raises:
        DistributedCheckpointError: Some rank failed (on every rank); nothing is committed.
    """
    from .. import dcp as wdcp

    error = None
    if rank() == 0:
        try:
            discard(vault, name)
        except Exception as e:  # the others must not start a save this rank gave up
            error = e
    agree(error, f"replacing checkpoint {name} in {vault.url}", fix)
    meta = dict(metadata)
    if scheduler is not None:
        label = type(scheduler).__name__
        state = scheduler.state_dict()
        doc = {k: _codec.encode(v, f"{label} state {k!r}") for k, v in state.items()}
        meta[SCHEDULER_KEY] = json.dumps({"class": label, "state": doc}, sort_keys=True)
    wdcp.save(model, vault, name, optimizer=optimizer, metadata=meta)


def _scheduler_state(metadata: dict[str, str], where: str) -> tuple[str, dict[str, Any]]:
    try:
        doc = json.loads(metadata[SCHEDULER_KEY])
        state = {k: _codec.decode(v, where) for k, v in doc["state"].items()}
        return str(doc["class"]), state
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TrainingStateError(
            f"{where} holds no readable scheduler state ({SCHEDULER_KEY!r} metadata); it was "
            "not saved by VaultCallback from a sharded model: resume from one that was"
        ) from e


def sharded_folder(vault: Vault, name: str, folder: Path) -> Path:
    """Write what the Trainer restores itself of sharded checkpoint ``name`` into ``folder``.

    ``trainer_state.json``, ``rng_state.pth`` and one ``rng_state_<rank>.pth`` per saving
    rank, and a weight index whose one shard holds no tensor: the Trainer insists on
    loading weights from the folder, and the sharded model's come from the vault instead.

    Raises:
        TrainingStateError: The checkpoint holds weights only, or was not saved by
            VaultCallback from a sharded model.
    """
    with vault.open(name) as ckpt:
        where, record, keys = ckpt.path, ckpt.record, list(ckpt.manifest.names)
    if record.weights_only:
        raise TrainingStateError(
            f"{where} holds weights only: its optimizer, scheduler, RNG and Trainer state "
            "were dropped (training_state_last); resume from a newer checkpoint"
        )
    state, ranks = record.metadata.get(STATE_KEY), record.metadata.get(RANKS_KEY)
    if state is None or ranks is None:
        raise TrainingStateError(
            f"{where} was not saved by VaultCallback from a sharded model (it lacks the "
            "Trainer state or the ranks' RNG states); resume from one that was"
        )
    _scheduler_state(record.metadata, where)  # checked before anything is written
    per_rank = decode_ranks(ranks, where)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps(json.loads(state), indent=2) + "\n")
    for r, states in per_rank.items():
        torch.save(states, folder / f"rng_state_{r}.pth")
    torch.save(per_rank[0], folder / "rng_state.pth")
    # The Trainer loads every weight the index names from its shard: this one holds none,
    # and the names it lists keep the Trainer from reporting them missing.
    save_file({}, str(folder / _STAND_IN))
    index = {
        "metadata": {"weightvault": f"the weights load from {where} when training begins"},
        "weight_map": dict.fromkeys(keys, _STAND_IN),
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


class LoadSharded(TrainerCallback):  # type: ignore[misc]
    """Fill the sharded model, its optimizer and its scheduler when training begins.

    The Trainer has built its optimizer by then and has not taken a step; every rank
    loads its own shards (:func:`weightvault.dcp.load`, collective).
    """

    def __init__(self, vault: Vault, name: str) -> None:
        self.vault = vault
        self.name = name

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        from .. import dcp as wdcp

        optimizer = unwrap(kwargs.get("optimizer"), "optimizer")
        scheduler = unwrap(kwargs.get("lr_scheduler"), "scheduler")
        wdcp.load(kwargs["model"], self.vault, self.name, optimizer=optimizer)
        if scheduler is not None:
            with self.vault.open(self.name) as ckpt:
                where, metadata = ckpt.path, ckpt.record.metadata
            label, saved = _scheduler_state(metadata, where)
            if label != type(scheduler).__name__:
                raise TrainingStateError(
                    f"{where} holds the state of a {label[:40]} scheduler, which this "
                    f"Trainer's {type(scheduler).__name__} cannot take; resume with the "
                    "same lr_scheduler_type"
                )
            scheduler.load_state_dict(saved)


def resume_sharded(trainer: Any, vault: Vault, name: str, **train_kwargs: Any) -> Any:
    """Resume ``trainer``, whose model is sharded, from vault checkpoint ``name``.

    Every rank calls it (under ``torchrun``). A checkout that fails on one rank raises
    :class:`~weightvault.DistributedCheckpointError` on all of them.
    """
    with tempfile.TemporaryDirectory(prefix="weightvault-resume-") as tmp:
        error, resolved = None, None
        try:
            resolved = vault.resolve(name)
            sharded_folder(vault, resolved, Path(tmp))
        except Exception as e:  # the other ranks would wait in the Trainer's collectives
            error = e
        agree(error, f"the checkout of {name!r} from {vault.url}", "resume from another one")
        if len(set(gather(resolved))) != 1:  # "latest" moved while the ranks read it
            raise DistributedCheckpointError(
                f"{vault.url}: the ranks resolved {name!r} to different checkpoints; "
                "resume from a checkpoint by its name"
            )
        assert resolved is not None
        loader = LoadSharded(vault, resolved)
        trainer.add_callback(loader)
        try:
            return trainer.train(resume_from_checkpoint=tmp, **train_kwargs)
        finally:
            trainer.remove_callback(loader)
