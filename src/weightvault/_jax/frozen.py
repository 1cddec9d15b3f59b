"""Where the frozen flags of a JAX model live, since JAX arrays carry none.

NNX keeps the flag in the ``Variable``'s metadata (key :data:`FROZEN_KEY`), so it travels
with ``nnx.split``/``merge`` and ``clone``. A pytree cannot carry a flag, so its frozen
names are kept per tree *structure* (``jax.tree.structure``): an optimizer step rebuilds
the tree with the same structure and keeps the record, but two trees of one structure
share it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax

from .walk import Leaf, is_nnx, is_param

#: The NNX ``Variable`` metadata key that marks a frozen parameter.
FROZEN_KEY = "weightvault_frozen"

#: Frozen names of pytrees, by tree structure: a pytree cannot carry a flag of its own.
FROZEN_TREES: dict[Hashable, set[str]] = {}


def structure_key(tree: Any) -> Hashable:
    """The key of ``tree``'s record in :data:`FROZEN_TREES`: its structure."""
    treedef = jax.tree_util.tree_structure(tree)
    try:
        hash(treedef)
    except TypeError:  # a static field that cannot be hashed: compare the printed form
        return ("repr", str(treedef))
    return treedef


def tree_record(obj: Any) -> set[str]:
    """The frozen names of a pytree's structure (empty for NNX: its flags are on Variables)."""
    return set() if is_nnx(obj) else FROZEN_TREES.get(structure_key(obj), set())


def is_frozen(leaf: Leaf, tree_frozen: set[str]) -> bool:
    """Whether ``leaf`` is frozen: its Variable's flag, or its name in the tree's record."""
    if leaf.variable is not None:
        return bool(leaf.is_param and leaf.variable.get_metadata().get(FROZEN_KEY, False))
    return leaf.name in tree_frozen


def _flag(variable: Any, frozen: bool) -> None:
    # Only frozen Variables carry the key, so trainable models print as they always did.
    if frozen:
        variable.set_metadata(FROZEN_KEY, True)
    elif variable.has_metadata(FROZEN_KEY):
        variable.del_metadata(FROZEN_KEY)


def restore_frozen(obj: Any, by_name: dict[str, Leaf], flags: dict[str, bool]) -> None:
    """Set the frozen flag of every loaded parameter name to the file's."""
    if is_nnx(obj):
        for name, frozen in flags.items():
            _flag(by_name[name].variable, frozen)
        return
    record = FROZEN_TREES.setdefault(structure_key(obj), set())
    record |= {n for n, f in flags.items() if f}
    record -= {n for n, f in flags.items() if not f}


def set_frozen(obj: Any, leaves: list[Leaf], chosen: set[Hashable], frozen: bool) -> None:
    """Freeze (or unfreeze) the leaves whose identities are ``chosen``, every name of them."""
    if is_nnx(obj):
        for leaf in leaves:
            if leaf.identity in chosen:
                _flag(leaf.variable, frozen)
        return
    record = FROZEN_TREES.setdefault(structure_key(obj), set())
    names = {leaf.name for leaf in leaves if leaf.identity in chosen}
    if frozen:
        record |= names
    else:
        record -= names


def trainable_variable(path: tuple[Any, ...], value: Any) -> bool:
    """An NNX filter: a ``Param`` that is not frozen."""
    return is_param(value) and not value.get_metadata().get(FROZEN_KEY, False)
