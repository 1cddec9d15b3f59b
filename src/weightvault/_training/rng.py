"""Python's and numpy's global RNG states as JSON, and back, with no framework.

Each framework adapter adds its own generators (torch's CPU and CUDA states, Keras'
``SeedGenerator``); these two are the same everywhere, so every adapter and the
``Trainer`` integration read them here. A saved state is validated when it is read, so a
malformed one fails before anything is restored.

Example:
    >>> import random
    >>> doc = python_rng()
    >>> first = random.random()
    >>> set_python_rng(doc, "ckpt")()
    >>> random.random() == first
    True
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from .._base.errors import TrainingStateError


def python_rng() -> Any:
    """Python ``random``'s global state as JSON."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def python_state(doc: Any, where: str) -> tuple[Any, ...]:
    """A saved ``random`` state (from :func:`python_rng`) as ``random.setstate`` takes it.

    Raises:
        TrainingStateError: ``doc`` is malformed, naming ``where``.
    """
    try:
        version, internal, gauss = doc
        state = (int(version), tuple(int(x) for x in internal), gauss)
        random.Random().setstate(state)  # validates without touching the global one
    except (TypeError, ValueError) as e:
        raise TrainingStateError(f"{where}: the saved Python random state is malformed") from e
    return state


def set_python_rng(doc: Any, where: str) -> Callable[[], None]:
    """Validate a saved ``random`` state now; return the call that restores it."""
    state = python_state(doc, where)
    return lambda: random.setstate(state)


def numpy_rng() -> Any:
    """numpy's legacy global RNG state as JSON, or ``None`` without numpy."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with every framework we support
        return None
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]


def numpy_state(doc: Any, where: str) -> tuple[Any, ...]:
    """A saved numpy state (from :func:`numpy_rng`) as ``np.random.set_state`` takes it.

    Raises:
        TrainingStateError: ``doc`` is malformed, naming ``where``.
    """
    import numpy as np

    try:
        kind, keys, pos, has_gauss, cached = doc
        state = (
            str(kind),
            np.asarray(keys, dtype=np.uint32),
            int(pos),
            int(has_gauss),
            float(cached),
        )
        np.random.RandomState().set_state(state)
    except (TypeError, ValueError, OverflowError) as e:
        raise TrainingStateError(f"{where}: the saved numpy random state is malformed") from e
    return state


def set_numpy_rng(doc: Any, where: str) -> Callable[[], None]:
    """Validate a saved numpy state now; return the call that restores it."""
    import numpy as np

    state = numpy_state(doc, where)
    return lambda: np.random.set_state(state)
