"""A training run's state beside the weights: optimizer, scheduler and RNG, by name.

This module is framework-free. It fixes how the state is laid out in a checkpoint and
decides, from names alone, which optimizer state goes to which parameter on load; the
adapters (``weightvault.torch``) turn framework objects into this layout and back.

**Layout.** The state lives in the same safetensors file (or vault checkpoint) as the
weights, so it stays one valid safetensors file:

* Every state tensor is stored under ``__weightvault__.train/optim/<param>/<key>``
  (``<param>`` is the parameter's name in the model, ``<key>`` the optimizer's state key)
  and RNG tensors under ``__weightvault__.train/rng/<what>``. The prefix is reserved, so
  these names never collide with a model's, and they are left out of the manifest's
  ``names``: a weights-only load never sees them.
* The manifest gains a ``"training"`` section, a JSON object::

      {"version": 1,
       "optimizer": {"class": "AdamW",
                     "groups": [{"hyper": {"lr": 0.001, ...}, "params": ["a.weight", ...]}],
                     "params": {"a.weight": {"shape": [4, 4],
                                             "tensors": {"exp_avg": "<stored name>"},
                                             "values": {"step": 3}}}},
       "scheduler": {"class": "LambdaLR", "state": {...}},
       "rng": {"python": [...], "numpy": [...], "torch": "<stored name>"}}

  One record per distinct parameter (a tie once, under its first name; a frozen
  parameter that no optimizer holds, none). Non-tensor values are JSON with a tag for
  the types JSON lacks (tuples, non-finite floats), so they come back as they were.

**Loading by name.** Each saved record is renamed with the load's ``rules`` and matched
with the optimizer's parameters through the model's names, never by position, so a new
optimizer that lists its parameters in another order, in other groups, or after a
freeze or unfreeze receives the right state.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._base.errors import (
    KeyMismatchError,
    ShapeMismatchError,
    TrainingStateError,
    WeightvaultError,
    capped,
)
from .._base.reports import LoadReport, OptimizerReport
from .._file.checkpoint import Checkpoint
from .._file.layout import VERSION
from .._load import rules as _rules
from . import codec as _codec

Rename = Callable[[str], "str | None"]


# -- RNG states that need no framework ----------------------------------------------------


def python_rng() -> Any:
    """Python ``random``'s global state as JSON."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_python_rng(doc: Any, where: str) -> Callable[[], None]:
    """Validate a saved ``random`` state now; return the call that restores it."""
    try:
        version, internal, gauss = doc
        state = (int(version), tuple(int(x) for x in internal), gauss)
        random.Random().setstate(state)  # validates without touching the global one
    except (TypeError, ValueError) as e:
        raise TrainingStateError(f"{where}: the saved Python random state is malformed") from e
    return lambda: random.setstate(state)


def numpy_rng() -> Any:
    """numpy's legacy global RNG state as JSON, or ``None`` without numpy."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with every framework we support
        return None
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]


def set_numpy_rng(doc: Any, where: str) -> Callable[[], None]:
    """Validate a saved numpy state now; return the call that restores it."""
    import numpy as np

    try:
        kind, keys, pos, has_gauss, cached = doc
        state = (str(kind), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), cached)
        np.random.RandomState().set_state(state)
    except (TypeError, ValueError, OverflowError) as e:
        raise TrainingStateError(f"{where}: the saved numpy random state is malformed") from e
    return lambda: np.random.set_state(state)


# -- The optimizer section -------------------------------------------------------------------


@dataclass
class SavedGroup:
    hyper: dict[str, Any]
    params: list[str]


@dataclass
class SavedParam:
    shape: tuple[int, ...]
    tensors: dict[str, str]  # state key -> stored name
    values: dict[str, Any]  # state key -> JSON value (already decoded)
    group: int


@dataclass
class SavedOptimizer:
    cls: str
    groups: list[SavedGroup]
    params: dict[str, SavedParam]


def encode_optimizer(
    cls: str,
    groups: Sequence[tuple[Mapping[str, Any], Sequence[str]]],
    params: Mapping[str, tuple[Sequence[int], Mapping[str, str], Mapping[str, Any]]],
) -> dict[str, Any]:
    """The optimizer section: ``groups`` as ``(hyperparameters, names)`` and ``params`` as
    ``{name: (shape, {key: stored_name}, {key: value})}``.
    """
    return {
        "class": cls,
        "groups": [
            {
                "hyper": {
                    k: _codec.encode(v, f"optimizer group {i} hyperparameter {k!r}")
                    for k, v in hyper.items()
                },
                "params": list(names),
            }
            for i, (hyper, names) in enumerate(groups)
        ],
        "params": {
            name: {
                "shape": list(shape),
                "tensors": dict(tensors),
                "values": {
                    k: _codec.encode(v, f"optimizer state {k!r} of parameter {name!r}")
                    for k, v in values.items()
                },
            }
            for name, (shape, tensors, values) in params.items()
        },
    }


def read_training(doc: Any, where: str) -> dict[str, Any]:
    """Validate the ``"training"`` section of a manifest (shape only; values later)."""
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise TrainingStateError(
            f"{where}: the training state is malformed or of an unknown version; upgrade "
            "weightvault"
        )
    return doc


def read_optimizer(
    training: Mapping[str, Any], known: Callable[[str], bool], where: str
) -> SavedOptimizer:
    """Parse the optimizer section, checking that every tensor it names exists."""
    doc = training.get("optimizer")
    if not isinstance(doc, dict):
        raise TrainingStateError(
            f"{where}: the checkpoint holds no optimizer state; it was saved without "
            "optimizer=..., so load without optimizer= (or from another checkpoint)"
        )
    try:
        groups = [
            SavedGroup(
                {k: _codec.decode(v, where) for k, v in dict(g["hyper"]).items()},
                [str(n) for n in g["params"]],
            )
            for g in doc["groups"]
        ]
        owner = {n: i for i, g in enumerate(groups) for n in g.params}
        params = {}
        for name, rec in dict(doc["params"]).items():
            tensors = {str(k): str(v) for k, v in dict(rec["tensors"]).items()}
            for stored in tensors.values():
                if not known(stored):
                    raise TrainingStateError(
                        f"{where}: optimizer state of {name!r} names tensor {stored!r}, "
                        "which the checkpoint does not hold"
                    )
            params[str(name)] = SavedParam(
                tuple(int(d) for d in rec["shape"]),
                tensors,
                {str(k): _codec.decode(v, where) for k, v in dict(rec["values"]).items()},
                owner[name],
            )
        return SavedOptimizer(str(doc["class"]), groups, params)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, WeightvaultError):
            raise
        raise TrainingStateError(f"{where}: the optimizer state is malformed ({e!r:.80})") from e


@dataclass
class OptimizerPlan:
    """Which saved record fills which parameter of the new optimizer."""

    #: ``(group index, position in group) -> saved parameter name``
    fill: dict[tuple[int, int], str] = field(default_factory=dict)
    #: For each group of the new optimizer, the saved group whose hyperparameters it gets.
    hyper_from: list[int | None] = field(default_factory=list)
    report: OptimizerReport = field(default_factory=OptimizerReport)


def plan_optimizer(
    saved: SavedOptimizer,
    groups: Sequence[Sequence[tuple[list[str], tuple[int, ...]]]],
    rename: Rename,
    *,
    strict: bool,
    where: str,
    label: str,
) -> OptimizerPlan:
    """Match saved state with the new optimizer's parameters by name.

    Args:
        saved: The optimizer section of the checkpoint.
        groups: The new optimizer's groups; each parameter as ``(its model names, shape)``
            (a tied parameter has several names).
        rename: Maps a name on disk to a model name (``None``: dropped by a rule).
        strict: Raise if a parameter is unknown to the checkpoint, saved state goes unused,
            or a shape differs.
        where: The checkpoint, for messages.
        label: The optimizer's class name, for messages.

    Raises:
        KeyMismatchError: ``strict`` and names disagree.
        ShapeMismatchError: ``strict`` and a parameter's shape differs from the saved one.
    """
    by_model: dict[str, str] = {}
    for saved_name in saved.params:
        new = rename(saved_name)
        if new is not None:
            by_model.setdefault(new, saved_name)
    out = OptimizerPlan()
    r = out.report
    used: set[str] = set()
    for gi, group in enumerate(groups):
        sources: set[int] = set()
        for pi, (names, shape) in enumerate(group):
            disk = next((by_model[n] for n in names if n in by_model), None)
            if disk is None or disk in used:
                r.missing.append(names[0])
                r.without_state.append(names[0])
                continue
            used.add(disk)
            rec = saved.params[disk]
            sources.add(rec.group)
            if rec.shape != tuple(shape):
                r.mismatched.append((names[0], list(rec.shape), list(shape)))
                r.without_state.append(names[0])
                continue
            if disk != names[0] and disk not in names:
                r.renamed.append((disk, names[0]))
            if rec.tensors or rec.values:
                out.fill[(gi, pi)] = disk
                r.loaded.append(names[0])
            else:
                r.without_state.append(names[0])  # known, but the optimizer never stepped it
        hypers = {json.dumps(saved.groups[s].hyper, sort_keys=True, default=repr) for s in sources}
        if len(hypers) == 1:
            out.hyper_from.append(min(sources))
        else:
            out.hyper_from.append(None)
            if len(hypers) > 1:
                r.groups_kept.append(gi)
    r.unused = [
        d for d, rec in saved.params.items() if d not in used and (rec.tensors or rec.values)
    ]
    if strict and (r.missing or r.unused or r.mismatched):
        problems = []
        if r.missing:
            problems.append(f"the checkpoint has no record of {capped(r.missing)}")
        if r.unused:
            problems.append(f"state for {capped(r.unused)} has no parameter in {label}")
        if r.mismatched:
            shown = capped(f"{n} {a} vs {b}" for n, a, b in r.mismatched)
            raise ShapeMismatchError(
                f"Cannot load the optimizer state of {where!r} into {label}: shapes differ "
                f"for {shown}. Load with strict=False to skip them.",
                [(n, str(a), str(b)) for n, a, b in r.mismatched],
            )
        raise KeyMismatchError(
            f"Cannot load the optimizer state of {where!r} into {label}: "
            + "; ".join(problems)
            + ". Load with strict=False to restore what matches (the report lists the rest), "
            "or pass rules= if parameters were renamed.",
            missing=r.missing,
            unexpected=r.unused,
        )
    return out


# -- what both adapters' training-state loads share ------------------------------------


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


def stored_name(ckpt: Checkpoint, name: str) -> str | None:
    """The stored tensor that holds ``name`` whole: itself, or what it aliases or copies."""
    m = ckpt.manifest
    alias = m.aliases.get(name, name)
    stored = m.copies.get(alias, alias)
    return stored if stored in ckpt.stored else None


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
