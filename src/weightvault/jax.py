"""Save and load JAX models: Flax NNX modules, Equinox modules and pytrees of arrays.

The verbs and their semantics are those of :mod:`weightvault.torch`; the load policy is
the same core (:func:`weightvault._match.plan_load`). What is JAX-specific lives here:

* **Names** are the NNX attribute path or the pytree key path joined with ``.``:
  ``"layers.0.kernel"``, ``"encoder.weight"``, ``"params.dense.bias"``.
* **Identity** is the NNX ``Variable`` object, or for pytrees the array object. A
  ``Variable`` that two modules hold (``self.b.kernel = self.a.kernel``) is stored once and
  every other name is recorded as an alias; on load it is filled once and stays shared.
  ``eqx.nn.Shared`` keeps one copy in its pytree already, so it is stored once as it is.
* **In place or new**: NNX modules are filled in place (``load`` returns the same object);
  pytrees and Equinox modules are immutable, so ``load`` returns a new one.
* **Freezing** is an optimizer concern in JAX. :func:`trainable` gives what the optimizer
  needs: an NNX filter (``nnx.Optimizer(model, tx, wrt=trainable(model))``) or an optax
  mask for pytrees. NNX keeps the frozen flag in the ``Variable``'s metadata (key
  ``"weightvault_frozen"``), so it travels with ``nnx.split``/``merge`` and ``clone``.
  Pytrees cannot carry a flag, so their frozen names are kept per tree *structure*
  (``jax.tree.structure``): an optimizer step rebuilds the tree with the same structure
  and keeps the record, but two trees of one structure share it.
* **Devices**: arrays on any device are copied to host to be written; a sharded
  ``jax.Array`` is gathered and saved whole. On load each value is placed with the
  sharding of the array it replaces.

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

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ._base.background import SnapshotPool
from ._base.dtypes import ITEMSIZE, numpy_dtype, unsupported
from ._base.errors import (
    BackendNotInstalled,
    UnsupportedDtypeError as UnsupportedDtypeError,
)

try:
    import jax
    import ml_dtypes  # noqa: F401 - the dtype table below needs it (bf16, fp8)
    import numpy as np
except ImportError as e:  # pragma: no cover - exercised only without jax
    raise BackendNotInstalled("weightvault.jax needs JAX: pip install 'weightvault[jax]'") from e

try:
    from flax import nnx
    from flax.nnx import graph as _graph
except ImportError:  # pragma: no cover - pytrees and Equinox work without Flax
    nnx = None  # type: ignore[assignment]
    _graph = None  # type: ignore[assignment]

from ._base.errors import UnsupportedValueError
from ._base.reports import LoadReport, SaveReport
from ._base.types import PathLike
from ._file import writer as _writer
from ._file.checkpoint import Checkpoint, CheckpointSource, Entry
from ._file.sharing import Source
from ._load import rules as _rules, transforms as _transforms
from ._load.plan import RulesArg, Target, plan_load
from .formats._registry import opened

__all__ = ["freeze", "load", "load_file", "save", "trainable", "unfreeze"]

#: The ``"format"`` written into ``__metadata__``, as transformers' Flax models write it.
FRAMEWORK = "flax"

#: The NNX ``Variable`` metadata key that marks a frozen parameter.
FROZEN_KEY = "weightvault_frozen"

T = TypeVar("T")

#: safetensors dtype name -> numpy dtype (``ml_dtypes``, a JAX dependency, for bf16/fp8).
DTYPES: dict[str, Any] = {k: numpy_dtype(k) for k in ITEMSIZE}
NAMES: dict[Any, str] = {v: k for k, v in DTYPES.items()}


@dataclass
class _Leaf:
    """One name of an array in the model."""

    name: str
    identity: Hashable  # equal for names that are one Variable (NNX) or one array object
    value: Any  # the jax.Array or numpy array it holds now
    is_param: bool  # an nnx.Param, or any array leaf of a pytree
    variable: Any = None  # the nnx.Variable (NNX only)
    index: int = -1  # position among the pytree's leaves (pytrees only)


def _is_nnx(obj: Any) -> bool:
    return nnx is not None and isinstance(obj, nnx.Module)


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def _dtype_name(name: str, value: Any) -> str:
    try:
        return NAMES[np.dtype(value.dtype)]
    except (KeyError, TypeError):
        raise unsupported(
            f"array {name!r}",
            value.dtype,
            "jax.random.key_data for PRNG keys, .astype for others",
        ) from None


def _host(name: str, value: Any) -> np.ndarray:
    """``value`` as a host numpy array; a sharded array is gathered whole."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        raise UnsupportedValueError(
            f"array {name!r} is sharded across processes and this process holds only part "
            "of it; gather it first, for example with "
            "jax.experimental.multihost_utils.process_allgather, then save"
        )
    return np.asarray(value)


# -- walking models ------------------------------------------------------------------------


def _nnx_leaves(model: Any) -> tuple[list[_Leaf], list[str]]:
    """Every name of every array Variable of an NNX module, aliases included."""
    out: list[_Leaf] = []
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
                if isinstance(value, nnx.RngState) or not _is_array(inner):
                    skipped.append(name)  # RNG streams and non-array state are not weights
                    continue
                out.append(_Leaf(name, id(value), inner, isinstance(value, nnx.Param), value))
            elif _graph.is_node(value):
                visit(value, here, (*ancestors, id(node)))
            elif _is_array(value):
                skipped.append(name)  # a bare array attribute: NNX state lives in Variables

    visit(model, (), ())
    return out, skipped


def _key(k: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _tree_leaves(tree: Any) -> tuple[list[_Leaf], list[str], list[Any], Any]:
    """Array leaves of a pytree by key path, plus all leaves and the tree structure."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out: list[_Leaf] = []
    skipped: list[str] = []
    for i, (path, value) in enumerate(flat):
        name = ".".join(_key(k) for k in path)
        if _is_array(value):
            out.append(_Leaf(name, id(value), value, True, index=i))
        elif value is not None:
            skipped.append(name)
    return out, skipped, [v for _, v in flat], treedef


def _leaves(obj: Any) -> tuple[list[_Leaf], list[str]]:
    if _is_nnx(obj):
        return _nnx_leaves(obj)
    leaves, skipped, _, _ = _tree_leaves(obj)
    return leaves, skipped


# -- the frozen record ---------------------------------------------------------------------

#: Frozen names of pytrees, by tree structure: a pytree cannot carry a flag of its own.
_FROZEN_TREES: dict[Hashable, set[str]] = {}


def _structure_key(tree: Any) -> Hashable:
    treedef = jax.tree_util.tree_structure(tree)
    try:
        hash(treedef)
    except TypeError:  # a static field that cannot be hashed: compare the printed form
        return ("repr", str(treedef))
    return treedef


def _is_frozen(leaf: _Leaf, tree_frozen: set[str]) -> bool:
    if leaf.variable is not None:
        return bool(leaf.is_param and leaf.variable.get_metadata().get(FROZEN_KEY, False))
    return leaf.name in tree_frozen


def _flag(variable: Any, frozen: bool) -> None:
    # Only frozen Variables carry the key, so trainable models print as they always did.
    if frozen:
        variable.set_metadata(FROZEN_KEY, True)
    elif variable.has_metadata(FROZEN_KEY):
        variable.del_metadata(FROZEN_KEY)


def _restore_frozen(obj: Any, by_name: dict[str, _Leaf], flags: dict[str, bool]) -> None:
    """Set the frozen flag of every loaded parameter name to the file's."""
    if _is_nnx(obj):
        for name, frozen in flags.items():
            _flag(by_name[name].variable, frozen)
        return
    record = _FROZEN_TREES.setdefault(_structure_key(obj), set())
    record |= {n for n, f in flags.items() if f}
    record -= {n for n, f in flags.items() if not f}


def _set_frozen(obj: Any, leaves: list[_Leaf], chosen: set[Hashable], frozen: bool) -> None:
    if _is_nnx(obj):
        for leaf in leaves:
            if leaf.identity in chosen:
                _flag(leaf.variable, frozen)
        return
    record = _FROZEN_TREES.setdefault(_structure_key(obj), set())
    names = {leaf.name for leaf in leaves if leaf.identity in chosen}
    if frozen:
        record |= names
    else:
        record -= names


# -- saving --------------------------------------------------------------------------------


def _bytes(name: str, value: Any) -> memoryview:
    a = np.ascontiguousarray(_host(name, value))
    if a.size == 0:
        return memoryview(b"")
    out: memoryview = a.reshape(-1).view(np.uint8).data
    return out


def _sources(obj: Any) -> tuple[list[Source], list[str]]:
    leaves, skipped = _leaves(obj)
    tree_frozen = set() if _is_nnx(obj) else _FROZEN_TREES.get(_structure_key(obj), set())
    sources = []
    for leaf in leaves:
        dtype = _dtype_name(leaf.name, leaf.value)
        shape = tuple(int(d) for d in leaf.value.shape)

        def data(name: str = leaf.name, value: Any = leaf.value) -> memoryview:
            return _bytes(name, value)

        frozen = _is_frozen(leaf, tree_frozen)
        sources.append(Source(leaf.name, dtype, shape, leaf.identity, data, frozen))
    return sources, skipped


def save(
    obj: Any,
    path: PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    checksum: bool = True,
    dedupe_copies: bool = True,
) -> SaveReport:
    """Save an NNX module, an Equinox module or a pytree of arrays, each array once.

    A ``Variable`` (or, in a pytree, an array object) held under two names is stored once
    and the second name becomes an alias; equal but separate arrays are stored once as
    copies. Non-array leaves (functions, ``None``, Python numbers) and NNX RNG state are
    left out and listed in ``report.skipped``. The file is a valid safetensors file
    (``safetensors.flax.load_file`` reads it) and is written atomically.

    Args:
        obj: An ``nnx.Module``, an ``eqx.Module`` or any pytree of ``jax.Array`` or numpy
            arrays.
        path: Where to write. An existing file is replaced only once the new one is complete.
        metadata: Your own ``str -> str`` metadata, kept in the manifest.
        checksum: Record an xxh3-64 checksum of every stored array.
        dedupe_copies: Store equal but separate arrays once.

    Returns:
        What was stored, aliased, copied and frozen, and the bytes saved.

    Raises:
        UnsupportedDtypeError: An array's dtype has no safetensors name.
        WeightvaultError: An array is sharded across processes and not all here.

    Example:
        >>> model.b.kernel = model.a.kernel        # one Variable in two places
        >>> save(model, "tied.safetensors").aliases
        {'b.kernel': 'a.kernel'}
    """
    sources, skipped = _sources(obj)
    return _writer.save_sources(
        path,
        sources,
        framework=FRAMEWORK,
        metadata=dict(metadata or {}),
        checksum=checksum,
        dedupe_copies=dedupe_copies,
        skipped=skipped,
    )


# -- loading -------------------------------------------------------------------------------


def _read(ckpt: Checkpoint, e: Entry) -> np.ndarray:
    """A fresh host array holding the values of ``e`` (the caller owns it)."""
    info = ckpt.stored[e.stored]
    raw = ckpt.raw(e.stored) if info.nbytes else memoryview(b"")
    if e.view is None:
        return np.frombuffer(raw, dtype=DTYPES[e.dtype]).reshape(e.shape).copy()
    v = e.view
    dt = DTYPES[v.dtype]
    if not v.span():
        return np.empty(v.shape, dtype=dt)
    base = np.frombuffer(raw, dtype=np.uint8)[v.offset : v.offset + v.span()].view(dt)
    strides = tuple(s * dt.itemsize for s in v.stride)
    return np.lib.stride_tricks.as_strided(base, v.shape, strides, writeable=False).copy()


def load_file(path: CheckpointSource, *, verify: bool = False) -> dict[str, jax.Array]:
    """Read every name in ``path`` as a ``jax.Array`` on the default device.

    Aliases come back as one array object; copies and views as arrays of their own.

    Args:
        path: A weightvault or plain safetensors file, or any format
            :func:`weightvault.numpy.load_file` reads.
        verify: Check every checksum first.

    Example:
        >>> arrays = load_file("tied.safetensors")
        >>> arrays["b.kernel"] is arrays["a.kernel"]
        True
    """
    with opened(path) as ckpt:
        if verify:
            ckpt.verify()
        groups: dict[str, jax.Array] = {}
        out: dict[str, jax.Array] = {}
        for name in ckpt.names:
            e = ckpt.entry(name)
            if e.group not in groups:
                groups[e.group] = jax.numpy.asarray(_read(ckpt, e))
            out[name] = groups[e.group]
        return out


def _placed(value: np.ndarray, like: Any) -> Any:
    """``value`` as the kind of array ``like`` is, on ``like``'s devices and sharding."""
    if isinstance(like, jax.Array):
        return jax.device_put(value, like.sharding)
    return value


def load(
    obj: T,
    path: CheckpointSource,
    *,
    strict: bool = True,
    rules: RulesArg = (),
    restore_frozen: bool = False,
    verify: bool = False,
    cast: bool = False,
    transforms: _transforms.Transforms | None = None,
) -> tuple[T, LoadReport]:
    """Fill ``obj`` from ``path``, all or nothing; return the filled model and a report.

    Every check (names, shapes, dtypes, ties and, with ``verify``, checksums) runs and
    every value is read and placed on its device before the model is touched, so a load
    that raises leaves it exactly as it was. An NNX module is filled in place and returned
    as is; a pytree or an Equinox module is immutable, so a new one is returned.

    Args:
        obj: An ``nnx.Module``, an ``eqx.Module`` or a pytree of arrays.
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
        TieConflictError: The model shares a Variable between names that the file holds
            with different values.
        ChecksumError: ``verify`` and an array's bytes are damaged.

    Example:
        >>> model, report = load(model, "torch_linear.safetensors",
        ...                      transforms={"*.kernel": "transpose"},
        ...                      rules=[("*.weight", "*.kernel")])
        >>> report.missing, report.unexpected
        ([], [])
    """
    if _is_nnx(obj):
        leaves, _ = _nnx_leaves(obj)
        flat: list[Any] = []
        treedef = None
    else:
        leaves, _, flat, treedef = _tree_leaves(obj)
    by_name = {leaf.name: leaf for leaf in leaves}
    targets = [
        Target(
            leaf.name,
            leaf.identity,
            NAMES.get(np.dtype(leaf.value.dtype), str(leaf.value.dtype)),
            tuple(int(d) for d in leaf.value.shape),
            is_param=leaf.is_param,
        )
        for leaf in leaves
    ]
    pairs = _transforms.check(transforms)
    with opened(path) as ckpt:

        def equal(a: str, b: str) -> bool:
            return bool(np.array_equal(_read(ckpt, ckpt.entry(a)), _read(ckpt, ckpt.entry(b))))

        lp = plan_load(
            ckpt,
            targets,
            rules=rules,
            strict=strict,
            cast=cast,
            equal=equal,
            label=type(obj).__name__,
            shape_of=_transforms.shape_hook(transforms),
        )
        if verify:
            ckpt.verify(sorted({ckpt.entry(a.source).stored for a in lp.assignments}))
        # Read, rearrange, convert and place every value before touching the model.
        values = []
        for a in lp.assignments:
            target = by_name[a.names[0]]
            value = _read(ckpt, ckpt.entry(a.source))
            transform = _transforms.resolve(pairs, a.names)
            if transform is not None:
                value = np.ascontiguousarray(value.transpose(transform.axes_for(value.ndim)))
            if a.cast:
                value = value.astype(target.value.dtype)
            values.append((a.names, _placed(value, target.value)))

    for names, value in values:
        first = by_name[names[0]]
        if first.variable is not None:
            first.variable.set_value(value)  # every name of the group is this one Variable
            continue
        for name in names:  # one array object at every position that held the same one
            flat[by_name[name].index] = value
    result: Any = obj if treedef is None else jax.tree_util.tree_unflatten(treedef, flat)
    if restore_frozen:
        _restore_frozen(result, by_name, lp.frozen)
        lp.report.frozen = [n for n, f in lp.frozen.items() if f]
    return result, lp.report


# -- freezing ------------------------------------------------------------------------------


def _select(obj: Any, patterns: Iterable[str], verb: str) -> tuple[list[_Leaf], set[Hashable]]:
    """All leaves of ``obj``, and the identities of the parameters ``patterns`` choose."""
    leaves, _ = _leaves(obj)
    params = [leaf for leaf in leaves if leaf.is_param]
    names = [leaf.name for leaf in params]
    chosen: set[Hashable] = set()
    for pat in list(patterns) or ["*"]:
        hits = set(_rules.select(pat, names, "."))
        if not hits:
            what = f"parameter of {type(obj).__name__}"
            raise _rules.unmatched(verb, pat, names, what, ".")
        chosen |= {leaf.identity for leaf in params if leaf.name in hits}
    return leaves, chosen


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
    leaves, chosen = _select(obj, patterns, "freeze")
    _set_frozen(obj, leaves, chosen, True)
    return [leaf.name for leaf in leaves if leaf.is_param and leaf.identity in chosen]


def unfreeze(obj: Any, *patterns: str) -> list[str]:
    """Make the parameters matching ``patterns`` trainable again; return every name.

    Rebuild the optimizer from :func:`trainable` afterwards for it to train them.
    """
    leaves, chosen = _select(obj, patterns, "unfreeze")
    _set_frozen(obj, leaves, chosen, False)
    return [leaf.name for leaf in leaves if leaf.is_param and leaf.identity in chosen]


def _trainable_variable(path: tuple[Any, ...], value: Any) -> bool:
    """An NNX filter: a ``Param`` that is not frozen."""
    return isinstance(value, nnx.Param) and not value.get_metadata().get(FROZEN_KEY, False)


def trainable(obj: Any) -> Any:
    """What the optimizer should train: an NNX filter, or an optax mask for a pytree.

    For an NNX module, a filter that selects every ``nnx.Param`` not frozen. It reads the
    flag when it runs, so it works on clones and split states too.

    For a pytree or an Equinox module, a pytree of the same structure with ``True`` for
    each trainable array, ``False`` for each frozen one and ``None`` for every non-array
    leaf, the shape ``eqx.filter(model, eqx.is_array)`` has. Use it as the labels of
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
    """
    if _is_nnx(obj):
        return _trainable_variable
    frozen = _FROZEN_TREES.get(_structure_key(obj), set())
    leaves, _, flat, treedef = _tree_leaves(obj)
    mask: list[Any] = [None] * len(flat)
    for leaf in leaves:
        mask[leaf.index] = leaf.name not in frozen
    return jax.tree_util.tree_unflatten(treedef, mask)


# -- the adapter contract (weightvault._adapters.Adapter), used by the vault --------------


def owns(obj: Any) -> bool:
    """Whether ``obj`` is an NNX module, or a pytree (Equinox modules included) of arrays."""
    return _is_nnx(obj) or any(_is_array(x) for x in jax.tree_util.tree_leaves(obj))


def sources(obj: Any) -> tuple[list[Source], list[str]]:
    """``(sources, skipped)`` of a module or pytree, as :func:`save` would store them."""
    return _sources(obj)


def checkpoint_sources(
    obj: Any,
    *,
    optimizer: Any = None,
    scheduler: Any = None,
    rng: bool = False,
    snapshot: SnapshotPool | None = None,
) -> tuple[list[Source], list[str], dict[str, Any] | None]:
    """Every value as a source, for the vault; copied now when ``snapshot`` is given.

    Raises:
        TypeError: ``optimizer``, ``scheduler`` or ``rng`` was given: weightvault.jax has no
            training state to save.
    """
    if optimizer is not None or scheduler is not None or rng:
        raise TypeError(
            "weightvault.jax: the vault saves no optimizer, scheduler or RNG state here; "
            "save the model alone, or keep the optimizer state in the tree you save"
        )
    found, skipped = sources(obj)
    if snapshot is not None:
        # Arrays can change in place after the call (numpy) or be replaced in the module
        # (NNX); a background save must write the values of the call.
        found = [s.copied() for s in found]
    return found, skipped, None
