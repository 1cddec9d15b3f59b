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
import math
import re
from pathlib import PurePath
from typing import Any

from .._base.errors import BackendNotInstalled

try:
    import torch
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise BackendNotInstalled(
        "weightvault.integrations.lightning needs Lightning and PyTorch: pip install "
        "'weightvault[lightning]'"
    ) from e

from .._base.errors import FormatError, TrainingStateError, UnsupportedStateError
from .._vault.vault import Vault
from ..torch import load_file as _load_file

__all__ = ["VaultCheckpointIO", "checkpoint_name"]

#: The metadata key that holds everything of the checkpoint dict but its tensors.
STATE_KEY = "lightning"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


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
        vault: Where checkpoints go.

    Example:
        >>> trainer = Trainer(max_epochs=3, plugins=[VaultCheckpointIO(vault)],
        ...                   callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1)])
        >>> trainer.fit(model)
        >>> trainer.fit(model, ckpt_path="checkpoints/epoch=0-step=4.ckpt")  # resumes
    """

    def __init__(self, vault: Vault) -> None:
        self.vault = vault

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Store ``checkpoint`` as vault checkpoint :func:`checkpoint_name` of ``path``.

        A checkpoint of that name is replaced, as Lightning overwrites its files.

        Raises:
            UnsupportedStateError: A value has no JSON form (named by its key); nothing is
                written, so the vault holds no partial checkpoint.
        """
        name = checkpoint_name(path)
        tensors: dict[str, torch.Tensor] = {}
        doc = _encode(checkpoint, "checkpoint", tensors)
        text = json.dumps(doc, allow_nan=False)
        if any(r.name == name for r in self.vault.list()):
            self.vault.delete(name)
        self.vault.save(tensors, name, metadata={STATE_KEY: text, "path": str(path)})

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict saved for ``path``, tensors read from the vault.

        ``map_location`` may be a device (or its name); other forms leave tensors on the
        CPU. ``weights_only`` changes nothing: nothing here is unpickled.

        Raises:
            CheckpointNotFoundError: The vault has no checkpoint for ``path``.
            ChecksumError: An object of the checkpoint is damaged.
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
        out = _decode(json.loads(text), tensors, ckpt.path)
        assert isinstance(out, dict)
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the vault checkpoint of ``path`` (its objects go at the next ``gc``)."""
        name = checkpoint_name(path)
        if any(r.name == name for r in self.vault.list()):
            self.vault.delete(name)


def _encode(value: Any, where: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON; tensors go to ``tensors`` under their key path, tagged ``$tensor``.

    Tags: ``$tensor``, ``$tuple``, ``$float`` (non-finite), ``$items`` (a dict whose keys
    are not all plain strings, such as an optimizer's ``{0: {...}}``).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$float": repr(float(value))}
    if isinstance(value, torch.Tensor):
        name = where.removeprefix("checkpoint")
        name = re.sub(r"\[(?:'([^']*)'|(\d+))\]", lambda m: "/" + (m[1] or m[2]), name)
        name = name.lstrip("/") or "tensor"
        if name in tensors:
            name = f"{name}#{len(tensors)}"
        tensors[name] = value.detach()
        return {"$tensor": name}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, f"{where}[{k!r}]", tensors) for k, v in value.items()}
        return {
            "$items": [
                [_encode(k, f"{where} key {k!r}", tensors), _encode(v, f"{where}[{k!r}]", tensors)]
                for k, v in value.items()
            ]
        }
    raise UnsupportedStateError(
        f"Lightning checkpoint value {where} is a {type(value).__name__}, which has no JSON "
        "form; VaultCheckpointIO stores tensors, numbers, strings, lists, tuples and dicts "
        "(never pickle). Keep it out of the checkpoint (for example save_hyperparameters("
        "ignore=[...])) or turn it into one of those types"
    )


def _decode(value: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == "$tensor" and inner in tensors:
            return tensors[inner]
        if tag == "$tuple" and isinstance(inner, list):
            return tuple(_decode(v, tensors, where) for v in inner)
        if tag == "$float" and inner in ("inf", "-inf", "nan"):
            return float(inner)
        if tag == "$items" and isinstance(inner, list):
            return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in inner}
    if any(k.startswith("$") for k in value):
        raise FormatError(f"{where}: unknown tagged value {str(value)[:80]} in its state")
    return {k: _decode(v, tensors, where) for k, v in value.items()}
