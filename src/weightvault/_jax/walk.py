"""How weightvault names a JAX model's arrays: NNX Variables by attribute path, pytree
leaves by key path.

Shared by every verb of :mod:`weightvault.jax`. A name is the path joined with ``.``
(``"layers.0.kernel"``); its identity is the NNX ``Variable`` object, or for pytrees the
array object, so a Variable two modules hold is one tensor under two names. A leaf may
also be *abstract*, a ``jax.ShapeDtypeStruct`` (``nnx.eval_shape``,
``eqx.filter_eval_shape``): a place to load into that holds no values yet.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

try:
    from flax import nnx
    from flax.nnx import graph as _graph
except ImportError:  # pragma: no cover - pytrees and Equinox work without Flax
    nnx = None  # type: ignore[assignment]
    _graph = None  # type: ignore[assignment]


@dataclass
class Leaf:
    """One name of an array in the model."""

    name: str
    identity: Hashable  # equal for names that are one Variable (NNX) or one array object
    value: Any  # the jax.Array or numpy array it holds now
    is_param: bool  # an nnx.Param, or any array leaf of a pytree
    variable: Any = None  # the nnx.Variable (NNX only)
    index: int = -1  # position among the pytree's leaves (pytrees only)


def _nnx_object(x: Any) -> bool:
    return isinstance(x, nnx.Pytree | nnx.Variable)


def is_nnx(obj: Any) -> bool:
    """Whether ``obj`` is filled in place on load: it keeps its arrays in NNX Variables.

    True for an NNX object (a module, an ``nnx.Optimizer``), and for a container of NNX
    objects with no bare array of its own: ``(model, optimizer)``, an ``nnx.State``.
    """
    if nnx is None or isinstance(obj, nnx.Variable):
        return False
    if isinstance(obj, nnx.Pytree):
        return True
    found = jax.tree_util.tree_leaves(obj, is_leaf=_nnx_object)
    return any(_nnx_object(x) for x in found) and not any(is_target(x) for x in found)


def is_param(value: Any) -> bool:
    """Whether ``value`` is an ``nnx.Param``: a Variable an optimizer trains."""
    return nnx is not None and isinstance(value, nnx.Param)


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array weightvault saves: a ``jax.Array`` or a numpy array."""
    return isinstance(x, jax.Array | np.ndarray)


def is_abstract(x: Any) -> bool:
    """Whether ``x`` is an abstract array, a ``jax.ShapeDtypeStruct``: shape, no values."""
    return isinstance(x, jax.ShapeDtypeStruct)


def is_target(x: Any) -> bool:
    """Whether ``x`` is an array or an abstract one: a leaf a load fills."""
    return is_array(x) or is_abstract(x)


def nnx_leaves(model: Any) -> tuple[list[Leaf], list[str]]:
    """Every name of every array Variable of an NNX module, aliases included."""
    out: list[Leaf] = []
    skipped: list[str] = []

    def visit(node: Any, path: tuple[Any, ...], ancestors: tuple[int, ...]) -> None:
        if id(node) in ancestors:  # a module that refers to its parent: not a new path
            return
        impl: Any = _graph.get_node_impl(node)
        items = (
            impl.node_dict(node).items() if hasattr(impl, "node_dict") else impl.flatten(node)[0]
        )
        for key, value in items:
            if isinstance(key, str) and key.startswith("_pytree__"):
                continue  # NNX's own bookkeeping, not model state
            here = (*path, key)
            name = ".".join(str(p) for p in here)
            if isinstance(value, nnx.Variable):
                inner = value.get_value()
                if isinstance(value, nnx.RngState) or not is_target(inner):
                    skipped.append(name)  # RNG streams and non-array state are not weights
                    continue
                out.append(Leaf(name, id(value), inner, is_param(value), value))
            elif _graph.is_node(value):
                visit(value, here, (*ancestors, id(node)))
            elif is_target(value):
                skipped.append(name)  # a bare array attribute: NNX state lives in Variables

    visit(model, (), ())
    return out, skipped


def _key(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def tree_leaves(tree: Any) -> tuple[list[Leaf], list[str], list[Any], Any]:
    """Array leaves of a pytree by key path, plus all leaves and the tree structure."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out: list[Leaf] = []
    skipped: list[str] = []
    for i, (path, value) in enumerate(flat):
        name = ".".join(_key(k) for k in path)
        if is_target(value):
            out.append(Leaf(name, id(value), value, True, index=i))
        elif value is not None:
            skipped.append(name)
    return out, skipped, [v for _, v in flat], treedef


def leaves(obj: Any) -> tuple[list[Leaf], list[str]]:
    """Every array name of a module or pytree, and the names left out (not arrays)."""
    if is_nnx(obj):
        return nnx_leaves(obj)
    found, skipped, _, _ = tree_leaves(obj)
    return found, skipped
