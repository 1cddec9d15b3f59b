"""Save and load JAX models: Flax NNX modules, Equinox modules and pytrees of arrays.

The verbs and their semantics are those of :mod:`weightvault.torch`; the load plan is
the same core (:func:`weightvault._load.plan.plan_load`), and values are decoded by the
one decoder of stored bytes (:mod:`weightvault._file.arrays`). What is JAX-specific lives
here and in :mod:`weightvault._jax`:

* **Names** are the NNX attribute path or the pytree key path joined with ``.``:
  ``"layers.0.kernel"``, ``"encoder.weight"``, ``"params.dense.bias"``.
* **Identity** is the NNX ``Variable`` object, or for pytrees the array object. A
  ``Variable`` that two modules hold (``self.b.kernel = self.a.kernel``) is stored once and
  every other name is recorded as an alias; on load it is filled once and stays shared.
  ``eqx.nn.Shared`` keeps one copy in its pytree already, so it is stored once as it is.
  On load a pytree's ties are the file's: one array object twice in a template (as
  ``eqx.nn.State(model)`` holds each ``StateIndex.init``) is no tie.
* **In place or new**: NNX objects (modules, ``nnx.Optimizer``, ``nnx.State``, and
  containers of them such as ``(model, optimizer)``) are filled in place (``load`` returns
  the same object); pytrees and Equinox modules are immutable, so ``load`` returns a new
  one. Either may be abstract (``jax.ShapeDtypeStruct`` leaves, from ``nnx.eval_shape``).
* **Freezing** is an optimizer concern in JAX. :func:`trainable` gives what the optimizer
  needs: an NNX filter (``nnx.Optimizer(model, tx, wrt=trainable(model))``) or an optax
  mask for pytrees. NNX keeps the frozen flag in the ``Variable``'s metadata (key
  ``"weightvault_frozen"``), so it travels with ``nnx.split``/``merge`` and ``clone``.
  Pytrees cannot carry a flag, so their frozen names are kept per tree *structure*
  (``jax.tree.structure``): an optimizer step rebuilds the tree with the same structure
  and keeps the record, but two trees of one structure share it.
* **Devices**: arrays on any device are copied to host to be written; a sharded
  ``jax.Array`` is gathered and saved whole. On load each value is placed with the
  sharding of the array (or ``jax.ShapeDtypeStruct``) it replaces.

Example:
    >>> from flax import nnx
    >>> import weightvault.jax as wvj
    >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    >>> report = wvj.save(model, "m.safetensors")
    >>> model, report = wvj.load(model, "m.safetensors")
    >>> report.loaded
    ['bias', 'kernel']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping
from typing import Any, TypeVar

from ._base.errors import BackendNotInstalled, UnsupportedDtypeError as UnsupportedDtypeError

try:
    import jax
    import numpy as np
except ImportError as e:  # pragma: no cover - exercised only without jax
    raise BackendNotInstalled("weightvault.jax needs JAX: pip install 'weightvault[jax]'") from e

from ._base.errors import UnsupportedValueError
from ._base.reports import LoadReport, SaveReport
from ._base.types import PathLike
from ._file.arrays import array_bytes, dtype_name, read_array
from ._file.checkpoint import Checkpoint, CheckpointSource
from ._file.sharing import Source
from ._jax.frozen import (
    FROZEN_KEY as FROZEN_KEY,
    is_frozen,
    restore_frozen as _restore_frozen,
    set_frozen,
    trainable_variable,
    tree_record,
)
from ._jax.place import placed, where
from ._jax.walk import (
    Leaf,
    is_abstract,
    is_nnx,
    is_target,
    leaves as _leaves,
    nnx_leaves,
    tree_leaves,
)
from ._load import rules as _rules
from ._load.plan import LoadOptions, LoadPlan, RulesArg, Target, plan_load
from ._load.steps import by_group, grouped_cost, save_file, start_reading
from ._load.transforms import Transforms
from ._load.values import read_value
from ._numpy.sources import array_dtype, untrained_checkpoint_sources
from .formats._registry import opened

__all__ = ["freeze", "load", "load_file", "save", "trainable", "unfreeze"]

#: The ``"format"`` written into ``__metadata__``, as transformers' Flax models write it.
FRAMEWORK = "flax"

T = TypeVar("T")


def _refuse_abstract(leaf: Leaf) -> None:
    if is_abstract(leaf.value):
        raise UnsupportedValueError(
            f"array {leaf.name!r} is abstract (a jax.ShapeDtypeStruct, as nnx.eval_shape "
            "gives) and holds no values to save; load into the model first, or build it "
            "concretely"
        )


def _host(name: str, value: Any) -> np.ndarray:
    """``value`` as a host numpy array; a sharded array is gathered whole."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        raise UnsupportedValueError(
            f"array {name!r} is sharded across processes and this process holds only part "
            "of it; gather it first, for example with "
            "jax.experimental.multihost_utils.process_allgather, then save"
        )
    return np.asarray(value)


# -- saving --------------------------------------------------------------------------------


def _sources(obj: Any) -> tuple[list[Source], list[str]]:
    found, skipped = _leaves(obj)
    tree_frozen = tree_record(obj)
    sources = []
    for leaf in found:
        _refuse_abstract(leaf)  # before the file is opened
        what = f"array {leaf.name!r}"
        dtype = array_dtype(what, leaf.value.dtype, "jax.random.key_data for PRNG keys, .astype")
        shape = tuple(int(d) for d in leaf.value.shape)

        def data(name: str = leaf.name, value: Any = leaf.value) -> memoryview:
            return array_bytes(_host(name, value))

        frozen = is_frozen(leaf, tree_frozen)
        sources.append(Source(leaf.name, dtype, shape, leaf.identity, data, frozen))
    return sources, skipped


def save(
    obj: Any,
    path: PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    checksum: bool = True,
    dedupe_copies: bool = False,
) -> SaveReport:
    """Save an NNX module, an Equinox module or a pytree of arrays, each array once.

    A ``Variable`` (or, in a pytree, an array object) held under two names is stored once
    and the second name becomes an alias. Equal but separate arrays (copies) are stored
    under every name, so plain safetensors readers see them all, unless ``dedupe_copies``
    is set. Non-array leaves (functions, ``None``, Python numbers) and NNX RNG state are
    left out and listed in ``report.skipped``. The file is a valid safetensors file
    (``safetensors.flax.load_file`` reads it) and is written atomically.

    Args:
        obj: An ``nnx.Module``, an ``eqx.Module`` or any pytree of ``jax.Array`` or numpy
            arrays.
        path: Where to write. An existing file is replaced only once the new one is complete.
        metadata: Your own ``str -> str`` metadata, kept in the manifest.
        checksum: Record an xxh3-64 checksum of every stored array.
        dedupe_copies: Store equal but separate arrays once, as copies only weightvault
            readers see.

    Returns:
        What was stored, aliased, copied and frozen, and the bytes saved.

    Raises:
        UnsupportedDtypeError: An array's dtype has no safetensors name.
        UnsupportedValueError: An array is sharded across processes and not all here, or
            is abstract (a ``jax.ShapeDtypeStruct``).

    Example:
        >>> model.b.kernel = model.a.kernel        # one Variable in two places
        >>> save(model, "tied.safetensors").aliases
        {'b.kernel': 'a.kernel'}
    """
    sources, skipped = _sources(obj)
    return save_file(path, (sources, skipped, None), FRAMEWORK, metadata, checksum, dedupe_copies)


# -- loading -------------------------------------------------------------------------------


def load_file(
    path: CheckpointSource, *, verify: bool = False, max_bytes: int | None = None
) -> dict[str, jax.Array]:
    """Read every name in ``path`` as a ``jax.Array`` on the default device.

    Aliases come back as one array object; copies and views as arrays of their own.

    Args:
        path: A weightvault or plain safetensors file, or any format
            :func:`weightvault.numpy.load_file` reads.
        verify: Check every checksum first.
        max_bytes: Most bytes the arrays may take (one per alias group, plus the stored
            tensors views are read from). By default the larger of 256 MiB and 16 times
            the file's size, so that a tiny hostile file whose copies or stride-0 views
            describe gigabytes is refused before anything is allocated; raise it for a
            trusted file that really expands that much.

    Raises:
        FormatError: The file is not a valid checkpoint, or would exceed ``max_bytes``.
        ChecksumError: ``verify`` and a tensor's bytes are damaged.

    Example:
        >>> arrays = load_file("tied.safetensors")
        >>> arrays["b.kernel"] is arrays["a.kernel"]
        True
    """
    with opened(path) as ckpt:
        start_reading(ckpt, grouped_cost(ckpt), "arrays", max_bytes, verify)
        bases: dict[str, memoryview] = {}
        return by_group(ckpt, lambda e: jax.numpy.asarray(read_array(ckpt, e, bases)))


def load(
    obj: T,
    path: CheckpointSource,
    *,
    strict: bool = True,
    rules: RulesArg = (),
    restore_frozen: bool = False,
    verify: bool = False,
    cast: bool = False,
    transforms: Transforms | None = None,
) -> tuple[T, LoadReport]:
    """Fill ``obj`` from ``path``, all or nothing; return the filled model and a report.

    Every check (names, shapes, dtypes, ties and, with ``verify``, checksums) runs and
    every value is read and placed on its device before the model is touched, so a load
    that raises leaves it exactly as it was. An NNX object is filled in place and returned
    as is; a pytree or an Equinox module is immutable, so a new one is returned. In a
    pytree, names the file holds as one tensor come back as one array object
    (``report.tied``); the template's own sharing of array objects is not a tie.

    Args:
        obj: An ``nnx.Module``, an ``nnx.Optimizer``, an ``nnx.State``, a container of
            them, an ``eqx.Module`` or a pytree of arrays. Any of them may be abstract
            (``jax.ShapeDtypeStruct`` leaves): each array is placed on the struct's
            sharding, or on the default device if it has none.
        path: A weightvault file, any safetensors file, a foreign format weightvault reads,
            or an open checkpoint (a vault's).
        strict: Raise on missing, unexpected or mismatched names; with ``False`` they are
            only reported.
        rules: ``(pattern, replacement)`` renames of names on disk (``*`` captures, ``None``
            drops), or ``"auto"`` to pair leftovers by dtype and shape.
        restore_frozen: Set the frozen flags of loaded parameters from the file (NNX
            metadata, or the pytree's record that :func:`trainable` reads).
        verify: Check the checksums of everything to be read first.
        cast: Allow dtypes to differ; values are converted.
        transforms: ``{pattern: transform}`` over the model's names that rearrange values
            before they are placed: ``{"*.kernel": "transpose"}`` loads a torch
            ``Linear.weight`` ``(out, in)`` into an NNX ``Linear.kernel`` ``(in, out)``.

    Returns:
        ``(model, report)``: the filled model (the same object for NNX) and what was
        loaded, renamed, missing, unexpected, mismatched and untied.

    Raises:
        KeyMismatchError: ``strict`` and names disagree; the message proposes a rule.
        ShapeMismatchError: A shape or dtype differs.
        TieConflictError: An NNX model shares a Variable between names that the file
            holds with different values.
        ChecksumError: ``verify`` and an array's bytes are damaged.

    Example:
        >>> model, report = load(model, "torch_linear.safetensors",
        ...                      transforms={"*.kernel": "transpose"},
        ...                      rules=[("*.weight", "*.kernel")])
        >>> report.missing, report.unexpected
        ([], [])
    """
    options = LoadOptions(
        rules=rules, strict=strict, cast=cast, verify=verify, transforms=transforms
    )
    return _load(obj, path, options, restore_frozen)


def _legacy_value_names(
    options: LoadOptions, disk: Iterable[str], model: Mapping[str, Any]
) -> LoadOptions:
    """``options`` with a last rule that drops the ``.value`` older files end names with.

    Before an ``nnx.Optimizer``, an ``nnx.State`` or a tuple of NNX objects was named like
    a module, it was saved as a pytree (``step.value``); such a file still loads in place.
    The rule comes after the caller's, and only where the bare name is the model's.
    """
    if isinstance(options.rules, str):
        return options
    if not any(n.endswith(".value") and n.removesuffix(".value") in model for n in disk):
        return options
    return dataclasses.replace(options, rules=[*options.rules, ("*.value", "*")])


def _load(
    obj: T, path: CheckpointSource, options: LoadOptions, restore_frozen: bool
) -> tuple[T, LoadReport]:
    in_place = is_nnx(obj)
    if in_place:
        found, _ = nnx_leaves(obj)
        flat: list[Any] = []
        treedef = None
    else:
        found, _, flat, treedef = tree_leaves(obj)
        # A pytree's ties are the file's: one array object twice in the template is no tie.
        options = dataclasses.replace(options, tie=True)
    by_name = {leaf.name: leaf for leaf in found}
    targets = [_target(leaf, by_identity=in_place) for leaf in found]
    with opened(path) as ckpt:
        if in_place:
            options = _legacy_value_names(options, ckpt.names, by_name)
        lp = plan_load(ckpt, targets, options, type(obj).__name__)
        ckpt.stage(lp.reads(), options.verify)
        # Read, rearrange, convert and place every value before touching the model.
        values = _placed_values(ckpt, lp, by_name, share=not in_place)
    for names, value in values:
        first = by_name[names[0]]
        if first.variable is not None:
            first.variable.set_value(value)  # every name of the group is this one Variable
            continue
        for name in names:
            flat[by_name[name].index] = value
    result: Any = obj if treedef is None else jax.tree_util.tree_unflatten(treedef, flat)
    if restore_frozen:
        _restore_frozen(result, by_name, lp.frozen)
        lp.report_frozen()
    return result, lp.report


def _placed_values(
    ckpt: Checkpoint, lp: LoadPlan, by_name: dict[str, Leaf], *, share: bool
) -> list[tuple[list[str], Any]]:
    """Every planned value, read and placed where its leaf is, as ``(names, value)``.

    With ``share``, names the file holds as one tensor get one array object, when they are
    placed alike; otherwise each assignment gets its own.
    """
    done: dict[Hashable, Any] = {}
    out = []
    bases: dict[str, memoryview] = {}
    for a in lp.assignments:
        like = by_name[a.names[0]].value
        key = (ckpt.entry(a.source).group, a.dtype, a.transform, where(like)) if share else id(a)
        if key not in done:
            # One numpy value at a time: it is dropped once placed (a new array of JAX's).
            value = read_value(ckpt, a, bases, lambda a: by_name[a.names[0]].value.dtype)
            done[key] = placed(value, like)
            del value
        out.append((a.names, done[key]))
    return out


def _target(leaf: Leaf, *, by_identity: bool) -> Target:
    """The load plan's view of ``leaf``; only NNX Variables tie names by identity.

    A pytree's identity is its array object, and ``eqx.nn.State(model)`` holds the very
    arrays of the model's ``StateIndex.init``: arrays are immutable, so sharing one object
    is no tie anyone asked for. Each pytree name is a tensor of its own.
    """
    dtype = dtype_name(leaf.value.dtype) or str(leaf.value.dtype)
    shape = tuple(int(d) for d in leaf.value.shape)
    identity = leaf.identity if by_identity else ("name", leaf.name)
    return Target(leaf.name, identity, dtype, shape, is_param=leaf.is_param)


# -- freezing ------------------------------------------------------------------------------


def _select(obj: Any, patterns: Iterable[str], verb: str) -> tuple[list[Leaf], set[Hashable]]:
    """All leaves of ``obj``, and the identities of the parameters ``patterns`` choose."""
    found, _ = _leaves(obj)
    params = [leaf for leaf in found if leaf.is_param]
    what = f"parameter of {type(obj).__name__}"
    hits = _rules.choose(patterns, [leaf.name for leaf in params], ".", verb, what)
    return found, {leaf.identity for leaf in params if leaf.name in hits}


def freeze(obj: Any, *patterns: str) -> list[str]:
    """Freeze the parameters whose names match ``patterns`` (all if none are given).

    A pattern matches any name of a parameter, aliases included, so freezing one name of
    a shared ``Variable`` freezes all of them. In NNX only ``nnx.Param`` variables are
    parameters (batch statistics are not trained anyway); in a pytree every array leaf is.

    Nothing changes in the arrays: JAX trains what the optimizer is given. Build the
    optimizer (or the gradient filter) from :func:`trainable` **after** freezing.

    Args:
        obj: An ``nnx.Module``, an ``eqx.Module`` or a pytree of arrays.
        *patterns: Names or ``*`` patterns (``"encoder.*"``); a bare prefix such as
            ``"encoder"`` means everything under it.

    Returns:
        Every name frozen, aliases included.

    Raises:
        RuleError: A pattern matches no parameter (the message names the closest one).

    Example:
        >>> freeze(model, "encoder")
        ['encoder.bias', 'encoder.kernel']
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=trainable(model))
    """
    found, chosen = _select(obj, patterns, "freeze")
    set_frozen(obj, found, chosen, True)
    return [leaf.name for leaf in found if leaf.is_param and leaf.identity in chosen]


def unfreeze(obj: Any, *patterns: str) -> list[str]:
    """Make the parameters matching ``patterns`` trainable again; return every name.

    Rebuild the optimizer from :func:`trainable` afterwards for it to train them.
    """
    found, chosen = _select(obj, patterns, "unfreeze")
    set_frozen(obj, found, chosen, False)
    return [leaf.name for leaf in found if leaf.is_param and leaf.identity in chosen]


def trainable(obj: Any) -> Any:
    """What the optimizer should train: an NNX filter, or an optax mask for a pytree.

    For an NNX object, a filter that selects every ``nnx.Param`` not frozen. It reads the
    flag when it runs, so it works on clones and split states too.

    For a pytree or an Equinox module, a pytree of the same structure with ``True`` for
    each trainable array and ``False`` for each frozen one and for every non-array leaf.
    That is an Equinox filter spec: ``eqx.partition(model, trainable(model))`` splits what
    trains from the rest, as the Equinox FAQ freezes layers. It is also the labels of
    ``optax.multi_transform({True: tx, False: optax.set_to_zero()}, mask)``. Note that
    ``optax.masked(tx, mask)`` is not enough on its own: it passes the gradient of a
    masked-out array through unchanged, so the array would still move. An Equinox mask
    is itself a module, hence callable, and optax calls callable labels: pass
    ``lambda _: mask`` there.

    Example:
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.01), wrt=trainable(model))
        >>> grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, trainable(model)))(model)

        >>> labels = trainable(params)                            # a pytree
        >>> tx = optax.multi_transform({True: optax.adam(1e-3), False: optax.set_to_zero()}, labels)

        >>> diff, static = eqx.partition(eqx_model, trainable(eqx_model))
    """
    if is_nnx(obj):
        return trainable_variable
    frozen = tree_record(obj)
    found, _, flat, treedef = tree_leaves(obj)
    # False, not None, for non-array leaves: None is an empty subtree, and a filter spec
    # (eqx.partition) needs one leaf for each of the model's.
    mask: list[Any] = [False] * len(flat)
    for leaf in found:
        mask[leaf.index] = leaf.name not in frozen
    return jax.tree_util.tree_unflatten(treedef, mask)


# -- the adapter contract (weightvault._vault.adapters.Adapter), used by the vault --------------


def owns(obj: Any) -> bool:
    """Whether ``obj`` is an NNX object, or a pytree (Equinox modules included) of arrays.

    Abstract arrays (``jax.ShapeDtypeStruct``) count: only JAX builds them.
    """
    return is_nnx(obj) or any(is_target(x) for x in jax.tree_util.tree_leaves(obj))


def sources(obj: Any) -> tuple[list[Source], list[str]]:
    """``(sources, skipped)`` of a module or pytree, as :func:`save` would store them."""
    return _sources(obj)


#: The vault's ``checkpoint_sources``: :func:`sources`, copied now for a background save.
checkpoint_sources = untrained_checkpoint_sources("weightvault.jax", sources)
