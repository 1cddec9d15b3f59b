"""Whether a checkpoint's training state is whole, told without any framework (for ``verify``).

A load compares the saved optimizer and scheduler state with the live objects before the
framework sees it (:mod:`weightvault._torch.expect`). ``verify`` has no live objects and
cannot import torch, so it reads what the checkpoint itself says:

* the optimizer section is well formed and every tensor it names is stored;
* for a class of the hand table (:mod:`weightvault._training.known`: ``Adam``, ``AdamW``,
  ``SGD``, ``Adafactor``, ``RMSprop``, ``Adagrad`` saved from PyTorch), every group holds
  the hyperparameters the class needs, and every stepped parameter the state keys it
  needs, each of the right kind (a 0-d tensor ``step``, an ``exp_avg`` of the
  parameter's shape);
* for any other class, the groups and parameters agree with each other: a group lacking a
  hyperparameter the others hold, or a parameter lacking a state key that the others in
  its group with as many dimensions hold (or holding it in another kind), is reported;
* a scheduler state is well formed and, for a known class, holds the keys it needs;
* the RNG states are well formed and every tensor they name is stored.

Example:
    >>> with weightvault.formats.open_any("ckpt.safetensors") as ckpt:
    ...     training_state_problems(ckpt)
    ["optimizer state of parameter '0.weight': key 'step' is missing (AdamW keeps ...)"]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._base.errors import FormatError, TrainingStateError
from .._file.checkpoint import Checkpoint
from . import codec as _codec
from .expect import Expect, keys_problems, kind, param_problems
from .known import group_keys, keras_group_problems, param_state, scheduler_keys
from .optimizer import SavedOptimizer, SavedParam, read_optimizer
from .rng import numpy_state, python_state
from .state import read_training, stored_name

__all__ = ["training_state_problems"]


def training_state_problems(ckpt: Checkpoint) -> list[str]:
    """Every problem of ``ckpt``'s training state, one line each; ``[]`` when it is whole
    or when the checkpoint holds weights only.

    Reads only the manifest and the stored tensors' dtypes and shapes (no tensor bytes),
    so it costs next to nothing beside a checksum pass.

    Args:
        ckpt: An open checkpoint: a single file (``weightvault.formats.open_any``) or a
            vault checkpoint (``Vault.open``).

    Example:
        >>> with vault.open("latest") as ckpt:
        ...     assert not training_state_problems(ckpt)
    """
    training = ckpt.manifest.training
    if training is None:
        return []
    try:
        read_training(training, ckpt.path)
    except TrainingStateError as e:
        return [str(e)]
    out = []
    if training.get("optimizer") is not None:
        out += _optimizer_problems(ckpt, training, ckpt.framework)
    if training.get("scheduler") is not None:
        out += _scheduler_problems(training["scheduler"], ckpt.framework)
    if training.get("rng") is not None:
        out += _rng_problems(ckpt, training["rng"])
    return out


def _optimizer_problems(
    ckpt: Checkpoint, training: Mapping[str, Any], framework: str | None
) -> list[str]:
    try:
        saved = read_optimizer(training, lambda n: stored_name(ckpt, n) is not None, ckpt.path)
    except (TrainingStateError, FormatError) as e:
        return [str(e)]
    label = saved.cls
    out = _group_problems(saved, framework)
    if framework == "keras":
        it = training["optimizer"].get("iterations")
        if not isinstance(it, int) or isinstance(it, bool) or it < 0:
            out.append(f"the optimizer's iterations are {str(it)[:40]}, not a step count")
    stepped = {n: r for n, r in saved.params.items() if r.tensors or r.values}
    if group_keys(framework, label) is not None:
        for name, rec in stepped.items():
            hyper = saved.groups[rec.group].hyper
            expected = param_state(framework, label, hyper, len(rec.shape)) or {}
            out += _param_problems(ckpt, name, rec, expected, label)
        return out
    # An unknown class: the parameters of one group with as many dimensions must agree.
    peers: dict[tuple[int, int], dict[str, Expect]] = {}
    for rec in stepped.values():
        seen = peers.setdefault((rec.group, len(rec.shape)), {})
        for key, expect in _described(ckpt, rec).items():
            seen.setdefault(key, expect)
    for name, rec in stepped.items():
        expected = peers[(rec.group, len(rec.shape))]
        out += _param_problems(ckpt, name, rec, expected, f"another parameter of group {rec.group}")
    return out


def _group_problems(saved: SavedOptimizer, framework: str | None) -> list[str]:
    label = saved.cls
    known = group_keys(framework, label)
    where = "optimizer group {} hyperparameter".format
    out: list[str] = []
    if framework == "keras":
        for gi, g in enumerate(saved.groups):
            out += keras_group_problems(g.hyper, where(gi), label)
        return out
    if known is not None:
        for gi, g in enumerate(saved.groups):
            out += keys_problems(g.hyper, known, {}, where(gi), label)
        return out
    every: dict[str, Any] = {}  # an unknown class: the groups must agree with each other
    for g in saved.groups:
        for k, v in g.hyper.items():
            if every.get(k) is None:
                every[k] = v
    for gi, g in enumerate(saved.groups):
        out += keys_problems(g.hyper, list(every), every, where(gi), "another group")
    return out


def _shapes(ckpt: Checkpoint, rec: SavedParam) -> dict[str, tuple[int, ...]]:
    out = {}
    for key, name in rec.tensors.items():
        stored = stored_name(ckpt, name)
        assert stored is not None  # read_optimizer checked that every tensor is stored
        out[key] = tuple(ckpt.stored[stored].shape)
    return out


def _described(ckpt: Checkpoint, rec: SavedParam) -> dict[str, Expect]:
    """What ``rec`` holds, key by key, as an expectation for its peers."""
    out = {
        key: Expect("tensor", len(shape), like_param=shape == rec.shape)
        for key, shape in _shapes(ckpt, rec).items()
    }
    for key, value in rec.values.items():
        if value is not None:
            out[key] = Expect(kind(value))
    return out


def _param_problems(
    ckpt: Checkpoint, name: str, rec: SavedParam, expected: Mapping[str, Expect], label: str
) -> list[str]:
    found = param_problems(name, _shapes(ckpt, rec), rec.values, rec.shape, expected, label)
    return [f"optimizer state of {p}" for p in found]


def _scheduler_problems(doc: Any, framework: str | None) -> list[str]:
    if not (
        isinstance(doc, dict)
        and isinstance(doc.get("class"), str)
        and isinstance(doc.get("state"), dict)
    ):
        return ["the scheduler state is malformed: it lacks its class or its state"]
    label = doc["class"]
    try:
        state = {k: _codec.decode(v, f"{label} state") for k, v in doc["state"].items()}
    except FormatError as e:
        return [str(e)]
    keys = scheduler_keys(framework, label)
    return [] if keys is None else keys_problems(state, keys, {}, f"{label} state key", label)


def _rng_problems(ckpt: Checkpoint, doc: Any) -> list[str]:
    if not isinstance(doc, dict):
        return ["the RNG state is malformed"]
    out = []
    for key, check in (("python", python_state), ("numpy", numpy_state)):
        if doc.get(key) is not None:
            try:
                check(doc[key], "the RNG state")
            except TrainingStateError as e:
                out.append(str(e))
            except ImportError:  # pragma: no cover - numpy comes with every framework
                pass
    named = [doc[k] for k in ("torch", "keras") if doc.get(k) is not None]
    for k in ("cuda", "keras_layers"):
        listed = doc.get(k) or []
        named += listed if isinstance(listed, list) else [listed]
    for name in named:
        if not isinstance(name, str) or stored_name(ckpt, name) is None:
            out.append(f"the RNG state names tensor {str(name)[:80]!r}, which is not stored")
    return out
