"""The private Keras functions weightvault.keras relies on, in one place.

Keras names the variables in its ``.weights.h5`` files by walking the model with private
helpers of ``keras.src.saving.saving_lib``; weightvault.keras names them the same way
with the same helpers, so a model saved by either loads with the other. Those helpers
are no public API and may change in any Keras release: they are looked up here, once,
and a Keras without them is a :class:`KerasInternalsChanged` naming what changed,
never a ``NameError`` in the middle of a save.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

from .._base.errors import BackendNotInstalled, KerasInternalsChanged

#: The Keras releases whose internals are known to work (also the ``keras`` extra).
SUPPORTED = "keras>=3.0,<4"

try:
    import keras
except ImportError as e:  # pragma: no cover - exercised only without keras
    raise BackendNotInstalled(
        "weightvault.keras needs Keras 3: pip install 'weightvault[keras]'"
    ) from e


def _changed(what: str, error: BaseException | None = None) -> KerasInternalsChanged:
    detail = f" ({type(error).__name__}: {error})" if error else ""
    return KerasInternalsChanged(
        f"this Keras version ({getattr(keras, '__version__', '?')}) changed {what}{detail}, "
        "which weightvault.keras uses to name weights exactly as Keras' own .weights.h5 "
        f"files do; weightvault supports {SUPPORTED}: pip install '{SUPPORTED}'"
    )


def _lookup(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise _changed(f"{module}.{name}", e) from None


_walk_saveable: Callable[[Any], Iterator[tuple[str, Any]]] = _lookup(
    "keras.src.saving.saving_lib", "_walk_saveable"
)
_get_unique_name: Callable[[str, dict[str, int]], str] = _lookup(
    "keras.src.saving.saving_lib", "_get_unique_name"
)
_to_snake_case: Callable[[str], str] = _lookup("keras.src.utils.naming", "to_snake_case")
#: Everything Keras' saving walks: layers, models, optimizers, metrics.
KerasSaveable: type = _lookup("keras.src.saving.keras_saveable", "KerasSaveable")
if not hasattr(keras.layers.Layer, "_flatten_layers"):
    raise _changed("keras.layers.Layer._flatten_layers")


def saving_lib(name: str) -> Any:
    """A private function or class of Keras' ``saving_lib``, looked up when first needed.

    Only ``save_weights``, ``save_model`` and ``load_model`` need these (Keras' own save
    walk, its store class, its config writer and reader), so a Keras without one of them
    fails those calls, with :class:`KerasInternalsChanged`, and nothing else.
    """
    return _lookup("keras.src.saving.saving_lib", name)


def walk_saveable(obj: Any) -> list[tuple[str, Any]]:
    """``(attribute, child)`` pairs Keras' saving visits below ``obj``, in its order."""
    return list(_walk_saveable(obj))


def unique_name(base: str, used: dict[str, int]) -> str:
    """``base``, or ``base_1``, ``base_2``, ... as Keras dedupes names in a container."""
    return _get_unique_name(base, used)


def snake_case(name: str) -> str:
    """A class name as Keras names its instances (``Dense`` -> ``dense``)."""
    return _to_snake_case(name)


def sublayers(model: Any, *, recursive: bool = True) -> list[Any]:
    """The layers inside ``model`` (not itself), nested ones too when ``recursive``."""
    return list(model._flatten_layers(include_self=False, recursive=recursive))
