"""The adapter contract, and the ordered registry that picks the adapter of an object.

An adapter is a module ``weightvault.<framework>`` that offers, besides its public
``save``/``load``/``load_file``:

- ``FRAMEWORK``: the ``"format"`` it writes into ``__metadata__`` (``"pt"``, ``"keras"``...);
- ``owns(obj)``: whether ``obj`` is a model or dict of this framework;
- ``sources(obj)``: ``(sources, skipped)``, every value as a :class:`~.._file.sharing.Source`;
- ``load(model, checkpoint, *, verify, **options)``: fill ``model`` from a
  :class:`~._reader.Checkpoint`, as the public ``load`` does from a path;
- ``checkpoint_sources(obj, *, optimizer, scheduler, rng, snapshot)``: the sources plus
  optimizer, scheduler and RNG state and the manifest's training section; with
  ``snapshot`` (the vault's :class:`~.._base.background.SnapshotPool`, given for a
  background save) every value training can change is copied at the call, into the
  pool's reused buffers where the framework can. An adapter without training state
  raises ``TypeError`` when asked for it.

A new framework is one module and one line in :data:`ADAPTERS`. The vault imports an
adapter only when an object of its framework's packages arrives, so a missing framework
costs nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol, cast

from .._base.snapshots import SnapshotPool
from .._file.sharing import Source

__all__ = ["ADAPTERS", "Adapter", "adapter_for"]


class Adapter(Protocol):
    """What the vault needs of an adapter module (see the module docstring)."""

    FRAMEWORK: str

    def owns(self, obj: Any) -> bool:
        """Whether ``obj`` is a model or dict this adapter saves and loads."""
        ...

    def sources(self, obj: Any) -> tuple[list[Source], list[str]]:
        """Every value of ``obj`` as a source, and the names left out."""
        ...

    def load(self, model: Any, path: Any, *, verify: bool = ..., **options: Any) -> Any:
        """Fill ``model`` from ``path`` (a path or an open checkpoint)."""
        ...

    def checkpoint_sources(
        self,
        obj: Any,
        *,
        optimizer: Any = ...,
        scheduler: Any = ...,
        rng: bool = ...,
        snapshot: SnapshotPool | None = ...,
    ) -> tuple[list[Source], list[str], dict[str, Any] | None]:
        """Sources with training state, copied now when ``snapshot`` is given."""
        ...


#: ``(adapter module, packages whose objects it may own)``, tried in this order.
#: Keras comes first: on ``KERAS_BACKEND=torch`` a Keras model is also a ``torch.nn.Module``.
#: numpy comes last: JAX pytrees may hold numpy arrays, and JAX claims those.
ADAPTERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("weightvault.keras", frozenset({"keras"})),
    ("weightvault.torch", frozenset({"torch"})),
    ("weightvault.jax", frozenset({"flax", "equinox", "jax", "jaxlib"})),
    ("weightvault.numpy", frozenset({"numpy", "ml_dtypes"})),
)


def _packages(obj: Any) -> set[str]:
    """Top-level packages of ``obj``'s classes, or of its first leaf if it is a dict."""
    if isinstance(obj, Mapping) and obj:
        first = next(iter(obj.values()))
        while isinstance(first, Mapping) and first:  # a nested pytree: look at its arrays
            first = next(iter(first.values()))
        return {c.__module__.split(".")[0] for c in type(first).__mro__}
    return {c.__module__.split(".")[0] for c in type(obj).__mro__}


def adapter_for(obj: Any) -> Adapter:
    """The first adapter in :data:`ADAPTERS` that owns ``obj``, imported on demand.

    Raises:
        TypeError: No adapter owns ``obj``.

    Example:
        >>> adapter_for({"w": np.zeros(2)}).FRAMEWORK
        'np'
    """
    packages = _packages(obj)
    for module, owners in ADAPTERS:
        if owners & packages:
            adapter = cast(Adapter, importlib.import_module(module))
            if adapter.owns(obj):
                return adapter
    raise TypeError(
        f"the vault does not know how to save a {type(obj).__name__}; pass a PyTorch "
        "nn.Module, a Keras model, an NNX or Equinox module, or a dict of tensors or arrays"
    )
