"""The one hand table: what known ``torch.optim`` classes keep, for checks without torch.

A load derives what an optimizer or scheduler needs from the live object
(:mod:`weightvault._torch.expect`); ``verify`` cannot import torch, so it reads it here,
for the classes people resume most. Each entry lists only what every torch release that
weightvault supports (2.4 and later) writes, so a whole checkpoint never reads as damaged:
a key a newer torch added, or one its loader fills in when absent (``foreach``,
``maximize``), is left out. ``tests/test_training_state_damage.py`` checks the table
against torch itself.

Example:
    >>> sorted(param_state("pt", "AdamW", {"amsgrad": True}, 2))
    ['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step']
    >>> group_keys("pt", "SGD")["momentum"]
    'number'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .expect import Expect, keys_problems, kind

#: A 0-d tensor (``step``), and a tensor of the parameter's shape (``exp_avg``).
_STEP = Expect("tensor", ndim=0)
_LIKE = Expect("tensor", like_param=True)

#: ``(group's hyperparameters, parameter's ndim) -> {state key: what it holds}``.
StateOf = Callable[[Mapping[str, Any], int], dict[str, Expect]]


def _adam(h: Mapping[str, Any], ndim: int) -> dict[str, Expect]:
    out = {"step": _STEP, "exp_avg": _LIKE, "exp_avg_sq": _LIKE}
    if h.get("amsgrad"):
        out["max_exp_avg_sq"] = _LIKE
    return out


def _sgd(h: Mapping[str, Any], ndim: int) -> dict[str, Expect]:
    return {"momentum_buffer": _LIKE} if h.get("momentum") else {}


def _adafactor(h: Mapping[str, Any], ndim: int) -> dict[str, Expect]:
    if ndim >= 2:  # a factored second moment: one row and one column statistic
        return {"step": _STEP, "row_var": Expect("tensor", ndim), "col_var": Expect("tensor", ndim)}
    return {"step": _STEP, "variance": _LIKE}


def _rmsprop(h: Mapping[str, Any], ndim: int) -> dict[str, Expect]:
    out = {"step": _STEP, "square_avg": _LIKE}
    if h.get("momentum"):
        out["momentum_buffer"] = _LIKE
    if h.get("centered"):
        out["grad_avg"] = _LIKE
    return out


def _adagrad(h: Mapping[str, Any], ndim: int) -> dict[str, Expect]:
    return {"step": _STEP, "sum": _LIKE}


_N, _L, _B = "number", "list", "bool"
_ADAM = {"lr": _N, "betas": _L, "eps": _N, "weight_decay": _N}

#: ``class -> (hyperparameters every group holds, with their kinds; per-parameter state)``.
OPTIMIZERS: dict[str, tuple[dict[str, str], StateOf]] = {
    "Adam": (_ADAM, _adam),
    "AdamW": (_ADAM, _adam),
    "SGD": ({"lr": _N, "momentum": _N, "dampening": _N, "weight_decay": _N}, _sgd),
    "Adafactor": (
        {"lr": _N, "beta2_decay": _N, "eps": _L, "d": _N, "weight_decay": _N, "maximize": _B},
        _adafactor,
    ),
    "RMSprop": ({"lr": _N, "alpha": _N, "eps": _N, "weight_decay": _N}, _rmsprop),
    "Adagrad": (
        {"lr": _N, "lr_decay": _N, "weight_decay": _N, "initial_accumulator_value": _N, "eps": _N},
        _adagrad,
    ),
}

_LR = {
    "base_lrs": _L,
    "last_epoch": _N,
    "_step_count": _N,
    "_last_lr": _L,
    "_get_lr_called_within_step": _B,
}

#: ``class -> {state key: kind}`` of the schedulers' ``state_dict()``.
SCHEDULERS: dict[str, dict[str, str]] = {
    "LambdaLR": {**_LR, "lr_lambdas": _L},
    "StepLR": {**_LR, "step_size": _N, "gamma": _N},
    "MultiStepLR": {**_LR, "milestones": "dict", "gamma": _N},
    "ExponentialLR": {**_LR, "gamma": _N},
    "LinearLR": {**_LR, "start_factor": _N, "end_factor": _N, "total_iters": _N},
    "CosineAnnealingLR": {**_LR, "T_max": _N, "eta_min": _N},
    "OneCycleLR": {
        **_LR,
        "total_steps": _N,
        "_schedule_phases": _L,
        "_anneal_func_type": "str",
        "cycle_momentum": _B,
    },
    "SequentialLR": {"_schedulers": _L, "_milestones": _L, "last_epoch": _N, "_last_lr": _L},
}


def keras_group_problems(hyper: Mapping[str, Any], where: str, label: str) -> list[str]:
    """What a Keras optimizer's saved configuration (its one group) lacks: a load restores
    ``learning_rate`` from it, a number or a schedule's configuration."""
    problems = keys_problems(hyper, ["learning_rate"], {}, where, label)
    lr = hyper.get("learning_rate")
    if not problems and lr is not None and kind(lr) not in ("number", "dict"):
        problems.append(
            f"{where} 'learning_rate' is a {kind(lr)}, but {label} keeps a number or a "
            "schedule's configuration there"
        )
    return problems


def group_keys(framework: str | None, cls: str) -> dict[str, str] | None:
    """The hyperparameters every group of a known optimizer holds, with their kinds."""
    entry = OPTIMIZERS.get(cls) if framework == "pt" else None
    return None if entry is None else dict(entry[0])


def param_state(
    framework: str | None, cls: str, hyper: Mapping[str, Any], ndim: int
) -> dict[str, Expect] | None:
    """What a known optimizer keeps for a stepped parameter of ``ndim`` dimensions in a
    group with ``hyper``; ``None`` for a class the table does not know."""
    entry = OPTIMIZERS.get(cls) if framework == "pt" else None
    return None if entry is None else entry[1](hyper, ndim)


def scheduler_keys(framework: str | None, cls: str) -> dict[str, str] | None:
    """The keys of a known scheduler's state, with their kinds."""
    entry = SCHEDULERS.get(cls) if framework == "pt" else None
    return None if entry is None else dict(entry)
