"""Lightning checkpoints into a vault: a ``CheckpointIO`` plugin.

One line changes in a training script::

    trainer = Trainer(plugins=[VaultCheckpointIO(vault)], callbacks=[ModelCheckpoint(...)])

Every checkpoint Lightning writes (through ``ModelCheckpoint`` or
``trainer.save_checkpoint``) becomes a vault checkpoint named after the file
(``epoch=0-step=4.ckpt`` is ``epoch_0-step_4``): its tensors are vault objects, stored once
across checkpoints when unchanged, and the rest of Lightning's checkpoint dict is JSON in
the checkpoint's metadata. ``trainer.fit(model, ckpt_path=path)`` with the same path
resumes from the vault. No pickle is written or read.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import PurePath
from typing import Any

from .._vault.objects.codec import preload
from ._common import discard, mirror_for, not_installed, settle

try:
    import torch
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise not_installed("lightning", "Lightning and PyTorch") from e

from .._base.errors import DistributedCheckpointError, TrainingStateError
from .._ranks import announce, announced, rank, world_size
from .._training import codec as _codec
from .._vault.records.checkpoint import VaultCheckpoint
from .._vault.upkeep.retain import drop_training_except_last
from .._vault.vault import VaultLike, as_vault
from ..torch import load_file as _load_file

__all__ = ["VaultCheckpointIO", "checkpoint_name"]

#: The metadata key that holds everything of the checkpoint dict but its tensors.
STATE_KEY = "lightning"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
#: A step of the codec's ``where`` (``['state_dict']``, ``[0]``), a folder of a tensor's name.
_STEP = re.compile(r"\[(?:'([^']*)'|(\d+))\]")
#: What Lightning leaves out of a weights-only checkpoint (``save_weights_only=True``).
TRAINING_KEYS = ("optimizer_states", "lr_schedulers", "callbacks")
#: Keys whose absence Lightning reads as "resume is impossible"; asking for them names
#: the weights-only checkpoint instead.
_REFUSED = ("optimizer_states", "lr_schedulers")
#: The one fix the codec suggests for a value without JSON form.
_HINT = (
    "Keep it out of the Lightning checkpoint (for example save_hyperparameters(ignore=[...])) "
    "or turn it into one of those types"
)


def checkpoint_name(path: Any) -> str:
    """The vault checkpoint name Lightning's ``path`` is stored under.

    The file name without ``.ckpt``, with every character a vault name cannot hold
    (``=``, spaces, ...) replaced by ``_``; the folder does not count. ``latest.ckpt`` is
    ``latest_``, since a vault reads ``latest`` as its newest checkpoint.

    Example:
        >>> checkpoint_name("checkpoints/epoch=0-step=4.ckpt")
        'epoch_0-step_4'
    """
    stem = PurePath(str(path)).name.removesuffix(".ckpt")
    name = _UNSAFE.sub("_", stem).lstrip("._-")[:128] or "checkpoint"
    return "latest_" if name == "latest" else name  # "latest" means the newest checkpoint


class VaultCheckpointIO(CheckpointIO):  # type: ignore[misc]
    """A Lightning ``CheckpointIO`` that keeps checkpoints in a :class:`~weightvault.Vault`.

    Args:
        vault: Where checkpoints go: a :class:`~weightvault.Vault`, or its path or URL
            (``"runs/vault"``, ``"s3://bucket/vault"``).
        training_state_last: Keep the weights of every checkpoint but the training state
            (optimizer, LR schedulers, callbacks' state) of only the newest ``N``: after
            each save the older checkpoints of the vault become what Lightning's
            ``save_weights_only=True`` writes. They load for ``validate``, ``test`` and
            ``predict``; resuming ``fit`` from one raises
            :class:`~weightvault.TrainingStateError` naming it. ``None`` takes the vault's
            own ``training_state_last`` (which by itself sees only the training state
            ``Vault.save`` records, not Lightning's), and keeps it all when that is unset.
        mirror: Another vault (a path or a URL) each checkpoint is pushed to once it
            commits, in a background thread (see ``VaultCallback``'s ``mirror``); the
            plugin's ``teardown`` waits for the last push.

    Example:
        >>> trainer = Trainer(max_epochs=3, plugins=[VaultCheckpointIO("runs/vault")],
        ...                   callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1)])
        >>> trainer.fit(model)
        >>> trainer.fit(model, ckpt_path="checkpoints/epoch=0-step=4.ckpt")  # resumes
    """

    def __init__(
        self,
        vault: VaultLike,
        *,
        training_state_last: int | None = None,
        mirror: VaultLike | None = None,
    ) -> None:
        if training_state_last is not None and training_state_last < 1:
            raise ValueError(
                "training_state_last must be at least 1 (None keeps every checkpoint's "
                f"training state), not {training_state_last!r}"
            )
        self.vault = as_vault(vault)
        self.mirror = mirror_for(self.vault, mirror)
        #: Checkpoints Lightning removed (``save_top_k``) that the mirror has yet to push:
        #: deleted once it has, so the mirror still gets every one.
        self._removed: set[str] = set()
        if training_state_last is None:
            training_state_last = self.vault.training_state_last
        self.training_state_last = training_state_last

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Store ``checkpoint`` as vault checkpoint :func:`checkpoint_name` of ``path``.

        A checkpoint of that name is replaced, as Lightning overwrites its files.

        Under DDP (``torchrun``) Lightning calls this on rank 0 alone, and the other ranks
        wait at its barrier.

        Raises:
            UnsupportedStateError: A value has no JSON form (named by its key); nothing is
                written, so the vault holds no partial checkpoint.
            DistributedCheckpointError: The save failed on a run of several processes (the
                storage's error is its ``__cause__``). Lightning calls this plugin on rank
                0 alone, so the other ranks wait in Lightning's barrier until rank 0 exits;
                then each raises the same error from its broken barrier (see
                :meth:`teardown`), never a hang.
        """
        preload()  # here, not in the compactor's thread: it draws from ``random``
        name = checkpoint_name(path)
        tensors: dict[str, torch.Tensor] = {}
        doc = _codec.encode(checkpoint, "checkpoint", tensor=_collect(tensors), hint=_HINT)
        text = json.dumps(doc, allow_nan=False)
        try:
            self._removed.discard(name)  # saved anew: not the one Lightning removed
            discard(self.vault, name)
            self.vault.save(tensors, name, metadata={STATE_KEY: text, "path": str(path)})
            if self.mirror is not None:
                self.mirror.after_save(name)  # pushed in the mirror's thread
            self._remove_pushed()
            if self.training_state_last is not None:
                # The disk stops growing; the records are read once each, and the gc (which
                # frees removed checkpoints too) runs on the compactor's thread.
                self.vault._drop_training(self.training_state_last, _training, free=True)
        except Exception as e:
            if world_size() == 1:
                raise
            error = _failed_on_rank(e, f"the vault save of {name} into {self.vault.url}")
            announce(error)  # the other ranks cannot hear it in a collective: see teardown
            raise error from e

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict saved for ``path``, tensors read from the vault.

        ``map_location`` may be a device (or its name); other forms leave tensors on the
        CPU. ``weights_only`` changes nothing: nothing here is unpickled.

        A weights-only checkpoint (``training_state_last``) comes back as Lightning's own
        ``save_weights_only`` checkpoint does, except that asking it for
        ``optimizer_states`` or ``lr_schedulers`` (as ``fit`` does to resume) raises.

        Raises:
            CheckpointNotFoundError: The vault has no checkpoint for ``path``.
            ChecksumError: An object of the checkpoint is damaged.
            TrainingStateError: (From the returned dict) its training state was dropped.
        """
        with self.vault.open(checkpoint_name(path)) as ckpt:
            text = ckpt.manifest.metadata.get(STATE_KEY)
            if text is None:
                raise TrainingStateError(
                    f"{ckpt.path} was not saved by VaultCheckpointIO (it lacks the "
                    f"{STATE_KEY!r} metadata); resume from a checkpoint Lightning saved"
                )
            tensors = _load_file(ckpt, verify=True)
        if isinstance(map_location, (str, torch.device)):
            tensors = {k: v.to(map_location) for k, v in tensors.items()}
        out = _codec.decode(json.loads(text), ckpt.path, tensors=tensors)
        assert isinstance(out, dict)
        return _WeightsOnly(out, ckpt.path) if ckpt.record.weights_only else out

    def teardown(self) -> None:
        """Raise, on a rank whose run broke off, the save failure rank 0 announced.

        Lightning tears down its strategy (and so this plugin) on every rank when the run
        stops with an error. A rank other than 0 stops with torch's connection error once
        rank 0, whose save failed, exits; here it raises that save's
        :class:`~weightvault.DistributedCheckpointError` instead (torch's error is its
        ``__cause__``), so every rank stops with the same ``Exception``. An error of
        anything else passes through unchanged.
        """
        error = announced(sys.exc_info()[1])  # Lightning calls this inside its `except`
        if error is not None:
            raise error from sys.exc_info()[1]
        if sys.exc_info()[1] is None:
            # A run that ends well ends compact: the last push and the retention that
            # waited for it first, then the compactor's work (a failure there was
            # logged; it is done later), so no retention after it leaves work undone.
            if self.mirror is not None:
                self.mirror.wait()  # the last push (a failure was logged, never raised)
                self._remove_pushed()
                if self.training_state_last is not None:  # what waited for the mirror
                    drop_training_except_last(self.vault.store, self.training_state_last, _training)
            settle(self.vault)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the vault checkpoint of ``path`` (its objects go at the next ``gc``).

        With a mirror, a checkpoint it has yet to push is deleted once it has (at a later
        save, or when training ends): local retention never keeps one from the mirror.
        """
        self._removed.add(checkpoint_name(path))
        self._remove_pushed()

    def _remove_pushed(self) -> None:
        """Delete the removed checkpoints that no push is waiting for any more."""
        waiting = self.vault.spared
        for name in sorted(self._removed - waiting):
            discard(self.vault, name)
        self._removed &= waiting


class _WeightsOnly(dict):  # type: ignore[type-arg]
    """A weights-only checkpoint's dict: asking it for training state names the checkpoint.

    Lightning tells a checkpoint it cannot resume from by ``"optimizer_states" not in
    checkpoint`` (and raises a ``KeyError`` that blames ``save_weights_only``); here that
    question raises the error that names the vault checkpoint and why.
    """

    def __init__(self, doc: dict[str, Any], where: str) -> None:
        super().__init__(doc)
        self.where = where

    def _refuse(self, key: object) -> None:
        if key in _REFUSED:
            raise TrainingStateError(
                f"{self.where} holds weights only: its {key} and the rest of its training "
                "state were dropped (training_state_last); resume fit from a newer "
                "checkpoint, or use this one for validate, test or predict"
            )

    def __contains__(self, key: object) -> bool:
        self._refuse(key)
        return super().__contains__(key)

    def __getitem__(self, key: Any) -> Any:
        self._refuse(key)
        return super().__getitem__(key)


def _training(ckpt: VaultCheckpoint) -> tuple[set[str], dict[str, str]] | None:
    """What of a VaultCheckpointIO checkpoint is training state (a retain ``Split``): the
    tensors under :data:`TRAINING_KEYS`, and the metadata without those keys."""
    text = ckpt.manifest.metadata.get(STATE_KEY)
    doc = None if text is None else json.loads(text)
    if not isinstance(doc, dict) or not any(k in doc for k in TRAINING_KEYS):
        return None  # not Lightning's, or keys that read as tags: leave it whole
    names: set[str] = set()
    for key in TRAINING_KEYS:
        _tensor_names(doc.pop(key, None), names)
    metadata = dict(ckpt.manifest.metadata)
    metadata[STATE_KEY] = json.dumps(doc, allow_nan=False)
    return names, metadata


def _tensor_names(doc: Any, out: set[str]) -> None:
    """Every tensor an encoded value names (``{"$tensor": name}``), into ``out``."""
    if isinstance(doc, dict):
        if set(doc) == {"$tensor"} and isinstance(doc["$tensor"], str):
            out.add(doc["$tensor"])
            return
        for value in doc.values():
            _tensor_names(value, out)
    elif isinstance(doc, list):
        for value in doc:
            _tensor_names(value, out)


def _failed_on_rank(error: Exception, what: str) -> DistributedCheckpointError:
    """The error for ``what`` failing on this rank, the one Lightning saves on."""
    return DistributedCheckpointError(
        f"{what} failed on rank {rank()} of {world_size()}: {type(error).__name__}: {error}; "
        "Lightning saves on this rank alone, so the other ranks stop when it exits, and the "
        "checkpoints committed before stay loadable; fix this error and resume with ckpt_path",
        {rank(): error},
    )


def _collect(tensors: dict[str, torch.Tensor]) -> _codec.TensorHook:
    """The codec's tensor hook: a tensor goes to ``tensors`` under its key path.

    ``checkpoint['state_dict']['net.0.weight']`` is stored as ``state_dict/net.0.weight``;
    a second tensor at the same path (a key holding ``/``) gets ``#<n>`` appended.
    """

    def store(value: Any, where: str) -> str | None:
        if not isinstance(value, torch.Tensor):
            return None
        name = _STEP.sub(lambda m: "/" + (m[1] or m[2]), where.removeprefix("checkpoint"))
        name = name.lstrip("/") or "tensor"
        if name in tensors:
            name = f"{name}#{len(tensors)}"
        tensors[name] = value.detach()
        return name

    return store
