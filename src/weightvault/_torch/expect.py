"""What a live ``torch.optim`` optimizer or LR scheduler needs of saved state, derived from it.

A load compares the decoded state with this before ``load_state_dict`` sees it
(:func:`weightvault._training.expect.refuse`), so a damaged key is a
:class:`~weightvault.FormatError` naming the checkpoint, the parameter and the key, never
torch's own ``KeyError`` from a half-loaded optimizer. Nothing here is a table written by
hand; each need comes from torch itself:

* **Group hyperparameters**: the keys of the optimizer's ``defaults``, less those its
  class's ``__setstate__`` fills in when a group lacks them (keys a later torch release
  added, such as ``foreach``), each of the kind the live groups hold.
* **Per-parameter state**: what the class itself keeps after one step of a probe
  optimizer of the same class and group hyperparameters, on a parameter of a few elements
  with as many dimensions, the same dtype and device (its keys; a tensor or a number; a
  tensor's dimensions, and whether it takes the parameter's shape). Probes are cached,
  so a resume pays for one per (class, hyperparameters, dimensions, dtype, device). A
  class whose probe fails (one that needs real gradients) falls back to the hand table
  of known classes (:mod:`weightvault._training.known`).
* **Scheduler state**: the live scheduler's own ``state_dict()``.

Example:
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> sorted(param_expectations(opt, opt.param_groups[0])(model.weight))
    ['exp_avg', 'exp_avg_sq', 'step']
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._training import codec as _codec
from .._training.expect import Expect, kind
from .._training.known import param_state

#: Group keys that are not hyperparameters: weightvault records parameters by name itself.
NOT_HYPER = frozenset({"params", "param_names"})
#: The probe parameter's shape: a few elements, every dimension of a different size (so a
#: state tensor of the parameter's shape is told apart from a reduced one).
_PROBE = (2, 3, 4, 5, 6, 7)


def plain(value: Any) -> Any:
    """``value`` with every tensor replaced by a number: a tensor hyperparameter (a
    ``lr`` held in a tensor) is of a number's kind, and saved JSON never holds tensors."""
    if isinstance(value, torch.Tensor):
        return 0.0
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def group_needs(optimizer: torch.optim.Optimizer) -> tuple[list[str], dict[str, Any]]:
    """``(keys every saved group must hold, reference values for their kinds)``."""
    cls: Any = type(optimizer)
    filled = _filled_by_setstate(cls)
    required = [k for k in optimizer.defaults if k not in filled and k not in NOT_HYPER]
    reference: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for k, v in group.items():
            if k not in NOT_HYPER:
                reference.setdefault(k, plain(v))
    for k, v in optimizer.defaults.items():
        reference.setdefault(k, plain(v))
    return required, reference


@functools.lru_cache(maxsize=64)
def _filled_by_setstate(cls: Any) -> frozenset[str]:
    """The group keys ``cls.__setstate__`` fills in when a group lacks them.

    ``load_state_dict`` ends in ``__setstate__``, which each ``torch.optim`` class uses to
    give groups saved by an older release the keys added since; a saved group may lack
    those and still load as torch means it to.
    """
    shell = cls.__new__(cls)
    group: dict[str, Any] = {"params": []}
    try:
        cls.__setstate__(shell, {"defaults": {}, "state": {}, "param_groups": [group]})
    except Exception:  # a class of its own whose __setstate__ needs more: require every key
        return frozenset()
    return frozenset(group) - {"params"}


def param_expectations(
    optimizer: torch.optim.Optimizer, hyper: Mapping[str, Any]
) -> Callable[[torch.Tensor], dict[str, Expect] | None]:
    """What ``optimizer``'s class keeps for a parameter in a group with ``hyper``, key by
    key (``None`` when neither a probe nor the table of known classes can tell), as a
    function of the parameter: one per group, so each parameter costs a cache lookup."""
    cls: Any = type(optimizer)
    hyper = {k: v for k, v in hyper.items() if k not in NOT_HYPER}
    try:
        key: str | None = json.dumps(_codec.encode(hyper, "hyperparameters"), sort_keys=True)
    except Exception:  # a hyperparameter without JSON form (a tensor lr): probed per group
        key = None
    mine: dict[tuple[int, torch.dtype, torch.device], dict[str, Expect] | None] = {}

    def expect(p: torch.Tensor) -> dict[str, Expect] | None:
        if key is not None:
            found = _cached_probe(cls, key, p.ndim, p.dtype, p.device)
        else:
            at = (p.ndim, p.dtype, p.device)
            if at not in mine:
                mine[at] = _probe(cls, hyper, *at)
            found = mine[at]
        return param_state("pt", cls.__name__, hyper, p.ndim) if found is None else found

    return expect


@functools.lru_cache(maxsize=256)
def _cached_probe(
    cls: Any, hyper: str, ndim: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Expect] | None:
    return _probe(cls, _codec.decode(json.loads(hyper), "hyperparameters"), ndim, dtype, device)


def _probe(
    cls: Any, hyper: Mapping[str, Any], ndim: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Expect] | None:
    """The state ``cls`` keeps after one step on a small parameter; ``None`` if it fails."""
    if ndim > len(_PROBE):
        return None
    shape = _PROBE[:ndim]
    try:
        p = torch.nn.Parameter(torch.ones(shape, dtype=dtype, device=device))

        def closure() -> torch.Tensor:
            p.grad = torch.full_like(p, 0.5)
            return torch.zeros((), device=device)

        closure()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = cls([{"params": [p], **hyper}])
            step = type(opt).step
            # The step without the process's global step hooks (a background save's wait,
            # a profiler's): the probe is no step of the training run.
            if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
                step = step.__wrapped__
            step(opt, closure)
        state = opt.state.get(p, {})
    except Exception:
        return None
    return {str(k): _expected(v, shape) for k, v in state.items()}


def _expected(value: Any, shape: tuple[int, ...]) -> Expect:
    if isinstance(value, torch.Tensor):
        return Expect("tensor", value.ndim, like_param=tuple(value.shape) == shape)
    return Expect("any" if value is None else kind(value))


def scheduler_reference(scheduler: Any) -> dict[str, Any]:
    """The live scheduler's state, the form a saved one must have."""
    return plain(dict(scheduler.state_dict()))  # type: ignore[no-any-return]
