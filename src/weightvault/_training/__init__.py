"""Optimizer, scheduler and RNG state beside the weights, framework-free.

- :mod:`~weightvault._training.state`: where the state sits in a checkpoint, and the
  steps every adapter's load shares;
- :mod:`~weightvault._training.optimizer`: the optimizer's section and its match by name;
- :mod:`~weightvault._training.rng`: Python's and numpy's global RNG states;
- :mod:`~weightvault._training.codec`: the one tagged-JSON codec for non-tensor values;
- :mod:`~weightvault._training.expect`: what saved state must hold, compared before a
  framework's loader sees it; :mod:`~weightvault._training.known`, the one hand table of
  known classes; :mod:`~weightvault._training.complete`, whether a checkpoint's training
  state is whole, without any framework (for ``verify``).

The adapters (``_torch``, ``_keras``) and the integrations use the names below.
"""

from .complete import training_state_problems
from .optimizer import encode_optimizer, plan_optimizer, read_optimizer
from .rng import numpy_rng, numpy_state, python_rng, python_state
from .state import Prepared, prepare_host_rng, read_training, rename_for, stored_name

__all__ = [
    "Prepared",
    "encode_optimizer",
    "numpy_rng",
    "numpy_state",
    "plan_optimizer",
    "prepare_host_rng",
    "python_rng",
    "python_state",
    "read_optimizer",
    "read_training",
    "rename_for",
    "stored_name",
    "training_state_problems",
]
