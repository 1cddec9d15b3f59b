"""What the numpy-backed adapters without training state share on the save side.

``weightvault.numpy`` and ``weightvault.jax`` hand the vault arrays only: their dtypes are
named the same way, and a background save copies every value at the call, since numpy
arrays change in place and NNX modules swap theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._base.dtypes import unsupported
from .._base.snapshots import SnapshotPool
from .._file.arrays import dtype_name
from .._file.sharing import Source

#: An adapter's ``sources(obj) -> (sources, names left out)``.
Sources = Callable[[Any], tuple[list[Source], list[str]]]
#: An adapter's ``checkpoint_sources(obj, *, optimizer, scheduler, rng, snapshot)``.
CheckpointSources = Callable[..., tuple[list[Source], list[str], dict[str, Any] | None]]


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

    def checkpoint_sources(
        obj: Any,
        *,
        optimizer: Any = None,
        scheduler: Any = None,
        rng: bool = False,
        snapshot: SnapshotPool | None = None,
    ) -> tuple[list[Source], list[str], dict[str, Any] | None]:
        """Every value as a source, for the vault; copied now when ``snapshot`` is given
        (a background save).

        Raises:
            TypeError: ``optimizer``, ``scheduler`` or ``rng`` was given: this adapter keeps
                no training state.
        """
        if optimizer is not None or scheduler is not None or rng:
            raise TypeError(
                f"{adapter}: the vault saves no optimizer, scheduler or RNG state here; save "
                "the model alone, or keep the optimizer state in the tree you save"
            )
        found, skipped = sources(obj)
        if snapshot is not None:
            # Arrays can change in place after the call (numpy) or be replaced in the
            # module (NNX); a background save must write the values of the call.
            found = [s.copied() for s in found]
        return found, skipped, None

    return checkpoint_sources
