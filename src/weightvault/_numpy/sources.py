"""What the numpy-backed adapters without training state share on the save side.

``weightvault.numpy`` and ``weightvault.jax`` hand the vault arrays only: their dtypes are
named the same way, and a background save copies every value at the call, since numpy
arrays change in place and NNX modules swap theirs. :func:`checkpoint_hook` spells the
vault's ``checkpoint_sources`` signature once, for them and for Keras.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._base.dtypes import unsupported
from .._base.snapshots import SnapshotPool
from .._file.arrays import dtype_name
from .._file.sharing import Source

#: An adapter's ``sources(obj) -> (sources, names left out)``.
Sources = Callable[[Any], tuple[list[Source], list[str]]]
#: What an adapter's ``checkpoint_sources`` returns: sources, names left out, and the
#: manifest's training section (``None`` without training state).
Found = tuple[list[Source], list[str], dict[str, Any] | None]
#: An adapter's ``checkpoint_sources(obj, *, optimizer, scheduler, rng, snapshot)``.
CheckpointSources = Callable[..., Found]


def array_dtype(what: str, dtype: Any, fix: str) -> str:
    """The safetensors name of an array's dtype.

    Args:
        what: The array, for the message (``"array 'w'"``).
        dtype: Its numpy, ``ml_dtypes`` or JAX dtype.
        fix: How to convert it (``".astype(np.float32)"``).

    Raises:
        UnsupportedDtypeError: safetensors has no such dtype.
    """
    name = dtype_name(dtype)
    if name is None:
        raise unsupported(what, dtype, fix)
    return name


def untrained_checkpoint_sources(adapter: str, sources: Sources) -> CheckpointSources:
    """The vault's ``checkpoint_sources`` for an adapter that saves no training state.

    Args:
        adapter: The adapter's module name, for the message.
        sources: The adapter's ``sources(obj) -> (sources, skipped)``.

    Example:
        >>> checkpoint_sources = untrained_checkpoint_sources("weightvault.numpy", sources)
    """

    def checkpoint_sources(obj: Any, asked: Asked) -> Found:
        """Every value as a source, for the vault; copied now when ``snapshot`` is given
        (a background save).

        Raises:
            TypeError: ``optimizer``, ``scheduler`` or ``rng`` was given: this adapter keeps
                no training state.
        """
        if asked.optimizer is not None or asked.scheduler is not None or asked.rng:
            raise TypeError(
                f"{adapter}: the vault saves no optimizer, scheduler or RNG state here; save "
                "the model alone, or keep the optimizer state in the tree you save"
            )
        found, skipped = sources(obj)
        if asked.snapshot is not None:
            # Arrays can change in place after the call (numpy) or be replaced in the
            # module (NNX); a background save must write the values of the call.
            found = [s.copied() for s in found]
        return found, skipped, None

    return checkpoint_hook(checkpoint_sources)


@dataclass(frozen=True)
class Asked:
    """What the vault asks of an adapter's ``checkpoint_sources`` beside the object: the
    training state to add, and the pool of a background save (values are copied now)."""

    optimizer: Any = None
    scheduler: Any = None
    rng: bool = False
    snapshot: SnapshotPool | None = None


def checkpoint_hook(body: Callable[[Any, Asked], Found]) -> CheckpointSources:
    """``body(obj, asked)`` as the vault's hook ``checkpoint_sources(obj, *, optimizer,
    scheduler, rng, snapshot)``, with ``body``'s docstring: the one spelling of that
    signature for the adapters that take any object (PyTorch's types its own).

    Example:
        >>> checkpoint_sources = checkpoint_hook(lambda obj, asked: ([], [], None))
        >>> checkpoint_sources({}, rng=False)
        ([], [], None)
    """

    def checkpoint_sources(
        obj: Any,
        *,
        optimizer: Any = None,
        scheduler: Any = None,
        rng: bool = False,
        snapshot: SnapshotPool | None = None,
    ) -> tuple[list[Source], list[str], dict[str, Any] | None]:
        return body(obj, Asked(optimizer, scheduler, rng, snapshot))

    checkpoint_sources.__doc__ = body.__doc__
    checkpoint_sources.__module__ = body.__module__
    return checkpoint_sources
