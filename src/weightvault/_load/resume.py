"""The framework-free checks that open every training-state load (torch's and Keras').

A load that asks for optimizer, scheduler or RNG state first needs the checkpoint to hold
a training section, and an optimizer of the class that saved it. Both halves
(:mod:`weightvault._torch.state`, :mod:`weightvault._keras.state`) refuse the same way,
with the same fix, from here.

Example:
    >>> training_doc(ckpt, ["optimizer", "rng"])
    Traceback (most recent call last):
    TrainingStateError: w.safetensors holds weights only: no optimizer or RNG state. ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._base.errors import TrainingStateError
from .._file.checkpoint import Checkpoint

#: What each kind of training state is called in messages, and how a save asks for it.
_KINDS = {
    "optimizer": ("optimizer", "optimizer=..."),
    "scheduler": ("scheduler", "scheduler=..."),
    "rng": ("RNG", "rng=True"),
}


def _listed(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def training_doc(ckpt: Checkpoint, kinds: Sequence[str]) -> Any:
    """The manifest's training section, unvalidated.

    Args:
        ckpt: The open checkpoint.
        kinds: The kinds of state the framework saves (``"optimizer"``, ``"scheduler"``,
            ``"rng"``), for the message.

    Raises:
        TrainingStateError: The checkpoint holds weights only.
    """
    if ckpt.manifest.training is None:
        what = _listed([_KINDS[k][0] for k in kinds])
        how = ", ".join(_KINDS[k][1] for k in kinds)
        raise TrainingStateError(
            f"{ckpt.path} holds weights only: no {what} state. Save with {how} to resume "
            "training from it"
        )
    return ckpt.manifest.training


def check_optimizer_class(where: str, saved: str, label: str) -> None:
    """Refuse to load the state of a ``saved`` optimizer into a ``label`` one.

    Raises:
        TrainingStateError: The classes differ; their state keys and slots would too.
    """
    if saved != label:
        raise TrainingStateError(
            f"{where} holds the state of a {saved} optimizer, which a {label} cannot "
            f"take; build a {saved} to resume, or load without optimizer="
        )
