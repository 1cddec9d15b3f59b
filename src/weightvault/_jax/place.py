"""Where a loaded value goes: the device, sharding and kind of the leaf it replaces.

A load reads every value to host first (:mod:`weightvault._load.values`); this module
puts each one where the model's leaf was. A ``jax.Array`` leaf gives its sharding, a
``jax.ShapeDtypeStruct`` (an abstract leaf, from ``nnx.eval_shape``) gives the sharding it
carries or, without one, the default device, and a numpy leaf stays on host as numpy.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from .walk import is_abstract


def _sharding(like: Any) -> jax.sharding.Sharding | None:
    """The sharding ``like`` asks for, or ``None`` for the default device or numpy."""
    if isinstance(like, jax.Array) or is_abstract(like):
        sharding = getattr(like, "sharding", None)
        # A struct may carry a bare PartitionSpec or nothing: only a Sharding places.
        return sharding if isinstance(sharding, jax.sharding.Sharding) else None
    return None


def where(like: Any) -> Hashable:
    """What decides where a value for ``like`` is placed: two leaves equal here can share it.

    Example:
        >>> where(np.zeros(2)) == where(np.ones(3))
        True
    """
    if not (isinstance(like, jax.Array) or is_abstract(like)):
        return "numpy"
    return ("jax", _sharding(like))


def placed(value: Any, like: Any) -> Any:
    """``value`` as the kind of array ``like`` is, on ``like``'s devices and sharding.

    Example:
        >>> placed(np.ones(2), jax.ShapeDtypeStruct((2,), np.float32))
        Array([1., 1.], dtype=float32)
    """
    if not (isinstance(like, jax.Array) or is_abstract(like)):
        return np.asarray(value)
    sharding = _sharding(like)
    return jax.device_put(value) if sharding is None else jax.device_put(value, sharding)
