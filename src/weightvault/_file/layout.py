"""Where a training run's state sits in a checkpoint: the reserved names, and the plan's section.

Training tensors (optimizer state, RNG) are stored under a reserved prefix, so they never
collide with a model's names and a weights-only load never sees them. The JSON section
that describes them is attached to the save plan by :func:`with_training`.
"""

from __future__ import annotations

from typing import Any

from .manifest import INTERNAL_PREFIX
from .sharing import Plan

#: Every training-state tensor is stored under this prefix.
TRAINING_PREFIX = INTERNAL_PREFIX + "train/"
OPTIM_PREFIX = TRAINING_PREFIX + "optim/"
RNG_PREFIX = TRAINING_PREFIX + "rng/"
VERSION = 1


def is_training(name: str) -> bool:
    """Whether a stored name holds training state rather than a model tensor."""
    return name.startswith(TRAINING_PREFIX)


def state_name(param: str, key: str) -> str:
    """The stored name of optimizer state ``key`` of parameter ``param``."""
    return f"{OPTIM_PREFIX}{param}/{key}"


def with_training(p: Plan, training: dict[str, Any] | None) -> Plan:
    """Attach the training section to a plan whose sources included its tensors.

    Training tensors are stored but are no model's names, so they leave ``names``.
    """
    if training is not None:
        p.training = training
        p.names = [n for n in p.names if not is_training(n)]
    return p
