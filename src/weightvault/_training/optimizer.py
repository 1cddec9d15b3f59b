"""An optimizer's state by parameter name: its JSON section, and the match on load.

The section (see :mod:`weightvault._training.state` for where it sits)::

    {"class": "AdamW",
     "groups": [{"hyper": {"lr": 0.001, ...}, "params": ["a.weight", ...]}],
     "params": {"a.weight": {"shape": [4, 4],
                             "tensors": {"exp_avg": "<stored name>"},
                             "values": {"step": 3}}}}

One record per distinct parameter (a tie once, under its first name; a frozen parameter
that no optimizer holds, none). Non-tensor values go through the one codec
(:mod:`weightvault._training.codec`), so tuples and non-finite floats come back as they
were.

**Loading by name.** Each saved record is renamed with the load's ``rules`` and matched
with the optimizer's parameters through the model's names, never by position, so a new
optimizer that lists its parameters in another order, in other groups, or after a
freeze or unfreeze receives the right state.

Example:
    >>> doc = encode_optimizer("SGD", [({"lr": 0.1}, ["w"])], {"w": ([2], {}, {"step": 1})})
    >>> saved = read_optimizer({"optimizer": doc}, lambda n: True, "ckpt")
    >>> plan = plan_optimizer(saved, [[(["w"], (2,))]], lambda n: n, strict=True,
    ...                       where="ckpt", label="SGD")
    >>> plan.fill, plan.hyper_from
    ({(0, 0): 'w'}, [0])
"""

from __future__ import annotations

import json
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
from .._base.reports import OptimizerReport
from . import codec as _codec

#: Maps a name on disk to a model name (``None``: dropped by a rule).
Rename = Callable[[str], "str | None"]
#: A parameter of the new optimizer: ``(its model names, shape)``; a tie has several names.
Param = tuple[list[str], tuple[int, ...]]


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

    Raises:
        UnsupportedStateError: A hyperparameter or state value has no JSON form.
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


def read_optimizer(
    training: Mapping[str, Any], known: Callable[[str], bool], where: str
) -> SavedOptimizer:
    """Parse the optimizer section, checking that every tensor it names exists.

    Raises:
        TrainingStateError: The checkpoint holds no optimizer state, or it is malformed.
    """
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
        params = {
            str(name): _saved_param(str(name), rec, owner[name], known, where)
            for name, rec in dict(doc["params"]).items()
        }
        return SavedOptimizer(str(doc["class"]), groups, params)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, WeightvaultError):
            raise
        raise TrainingStateError(f"{where}: the optimizer state is malformed ({e!r:.80})") from e


def _saved_param(
    name: str, rec: Any, group: int, known: Callable[[str], bool], where: str
) -> SavedParam:
    tensors = {str(k): str(v) for k, v in dict(rec["tensors"]).items()}
    for stored in tensors.values():
        if not known(stored):
            raise TrainingStateError(
                f"{where}: optimizer state of {name!r} names tensor {stored!r}, which the "
                "checkpoint does not hold"
            )
    return SavedParam(
        tuple(int(d) for d in rec["shape"]),
        tensors,
        {str(k): _codec.decode(v, where) for k, v in dict(rec["values"]).items()},
        group,
    )


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
    groups: Sequence[Sequence[Param]],
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
    used: set[str] = set()
    for gi, group in enumerate(groups):
        sources: set[int] = set()
        for pi, param in enumerate(group):
            source = _match_param(saved, (gi, pi), param, by_model, used, out)
            if source is not None:
                sources.add(source)
        _pick_hyperparameters(saved, gi, sources, out)
    out.report.unused = [
        d for d, rec in saved.params.items() if d not in used and (rec.tensors or rec.values)
    ]
    if strict:
        _refuse_mismatches(out.report, where, label)
    return out


def _match_param(
    saved: SavedOptimizer,
    at: tuple[int, int],
    param: Param,
    by_model: Mapping[str, str],
    used: set[str],
    out: OptimizerPlan,
) -> int | None:
    """Plan the state of the parameter at ``at``; the saved group it came from, if any."""
    names, shape = param
    r = out.report
    disk = next((by_model[n] for n in names if n in by_model), None)
    if disk is None or disk in used:
        r.missing.append(names[0])
        r.without_state.append(names[0])
        return None
    used.add(disk)
    rec = saved.params[disk]
    if rec.shape != tuple(shape):
        r.mismatched.append((names[0], list(rec.shape), list(shape)))
        r.without_state.append(names[0])
        return rec.group
    if disk not in names:
        r.renamed.append((disk, names[0]))
    if rec.tensors or rec.values:
        out.fill[at] = disk
        r.loaded.append(names[0])
    else:
        r.without_state.append(names[0])  # known, but the optimizer never stepped it
    return rec.group


def _pick_hyperparameters(
    saved: SavedOptimizer, group: int, sources: set[int], out: OptimizerPlan
) -> None:
    """New group ``group`` takes the saved hyperparameters its parameters agree on, if any.

    Parameters from saved groups with different hyperparameters keep the new group's own,
    and the report says so.
    """
    hypers = {json.dumps(saved.groups[s].hyper, sort_keys=True, default=repr) for s in sources}
    if len(hypers) == 1:
        out.hyper_from.append(min(sources))
        return
    out.hyper_from.append(None)
    if len(hypers) > 1:
        out.report.groups_kept.append(group)


def _refuse_mismatches(r: OptimizerReport, where: str, label: str) -> None:
    """Raise for what a strict load cannot restore: shapes first, then names."""
    if r.mismatched:
        shown = capped(f"{n} {a} vs {b}" for n, a, b in r.mismatched)
        raise ShapeMismatchError(
            f"Cannot load the optimizer state of {where!r} into {label}: shapes differ "
            f"for {shown}. Load with strict=False to skip them.",
            [(n, str(a), str(b)) for n, a, b in r.mismatched],
        )
    problems = []
    if r.missing:
        problems.append(f"the checkpoint has no record of {capped(r.missing)}")
    if r.unused:
        problems.append(f"state for {capped(r.unused)} has no parameter in {label}")
    if problems:
        raise KeyMismatchError(
            f"Cannot load the optimizer state of {where!r} into {label}: "
            + "; ".join(problems)
            + ". Load with strict=False to restore what matches (the report lists the rest), "
            "or pass rules= if parameters were renamed.",
            missing=r.missing,
            unexpected=r.unused,
        )
