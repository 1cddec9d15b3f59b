"""A training run's state beside the weights: the layout, and the steps every load shares.

This module is framework-free. It fixes how the state is laid out in a checkpoint; the
adapters (``weightvault.torch``, ``weightvault.keras``) turn framework objects into this
layout and back. The optimizer's section and its match by name are in
:mod:`weightvault._training.optimizer`, Python's and numpy's RNG states in
:mod:`weightvault._training.rng`.

**Layout.** The state lives in the same safetensors file (or vault checkpoint) as the
weights, so it stays one valid safetensors file:

* Every state tensor is stored under ``__weightvault__.train/optim/<param>/<key>``
  (``<param>`` is the parameter's name in the model, ``<key>`` the optimizer's state key)
  and RNG tensors under ``__weightvault__.train/rng/<what>``. The prefix is reserved, so
  these names never collide with a model's, and they are left out of the manifest's
  ``names``: a weights-only load never sees them.
* The manifest gains a ``"training"`` section, a JSON object::

      {"version": 1,
       "optimizer": {...},
       "scheduler": {"class": "LambdaLR", "state": {...}},
       "rng": {"python": [...], "numpy": [...], "torch": "<stored name>"}}

  Non-tensor values are JSON with a tag for the types JSON lacks (tuples, non-finite
  floats; see :mod:`weightvault._training.codec`), so they come back as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._base.errors import TrainingStateError
from .._base.reports import LoadReport
from .._file.checkpoint import Checkpoint
from .._file.layout import VERSION
from .._load import rules as _rules
from .optimizer import Rename
from .rng import set_numpy_rng, set_python_rng


def read_training(doc: Any, where: str) -> dict[str, Any]:
    """Validate the ``"training"`` section of a manifest (shape only; values later).

    Raises:
        TrainingStateError: The section is malformed or of an unknown version.
    """
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise TrainingStateError(
            f"{where}: the training state is malformed or of an unknown version; upgrade "
            "weightvault"
        )
    return doc


def stored_name(ckpt: Checkpoint, name: str) -> str | None:
    """The stored tensor that holds ``name`` whole: itself, or what it aliases or copies.

    The one lookup for names outside the model's (optimizer, scheduler and RNG tensors),
    which have no entry of their own; ``None`` when the checkpoint holds no such tensor
    (or only a view, which training state never is).

    Example:
        >>> stored_name(ckpt, "__weightvault__.train/optim/a.weight/exp_avg")
        '__weightvault__.train/optim/a.weight/exp_avg'
    """
    m = ckpt.manifest
    alias = m.aliases.get(name, name)
    stored = m.copies.get(alias, alias)
    return stored if stored in ckpt.stored else None


@dataclass
class Prepared:
    """Training state read and checked, ready to be applied after the weights."""

    steps: list[Callable[[], None]] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    optimizer: Any = None

    def apply(self, report: LoadReport) -> None:
        for step in self.steps:
            step()
        report.optimizer = self.optimizer
        report.restored = list(self.restored)


def rename_for(rules: Any, renamed: list[tuple[str, str]]) -> Rename:
    """How a saved parameter name maps to the model's, by the load's ``rules``.

    ``"auto"`` reuses the pairs the weights load found (``renamed``), so optimizer state
    follows exactly the renames the weights took.
    """
    if rules == "auto":
        moved = dict(renamed)
        return lambda n: moved.get(n, n)
    checked = _rules.check(rules)
    return lambda n: _rules.rename(checked, n)


def prepare_host_rng(training: Mapping[str, Any], where: str, out: Prepared) -> dict[str, Any]:
    """The RNG section, with Python's and numpy's restores added to ``out``.

    Raises:
        TrainingStateError: The checkpoint was saved without ``rng=True``.
    """
    doc = training.get("rng")
    if not isinstance(doc, dict):
        raise TrainingStateError(
            f"{where} holds no RNG state; it was saved without rng=True, so load without rng="
        )
    if doc.get("python") is not None:
        out.steps.append(set_python_rng(doc["python"], where))
        out.restored.append("rng:python")
    if doc.get("numpy") is not None:
        out.steps.append(set_numpy_rng(doc["numpy"], where))
        out.restored.append("rng:numpy")
    return doc
