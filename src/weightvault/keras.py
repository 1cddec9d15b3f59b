"""Save and load Keras 3 models, with shared variables stored once, renames and freezing.

The verbs and their semantics are those of :mod:`weightvault.torch`; the load plan is
the same core (:func:`weightvault._load.plan.plan_load`). What is Keras-specific lives
here and in :mod:`weightvault._keras`:

* **Names** look like ``Variable.path`` (``"encoder/dense/kernel"``) but are built from
  what is stable between two processes that build the same model: attribute names of
  subclassed models, the layer names you chose, and otherwise the class name numbered by
  position (``dense``, ``dense_1``), the scheme Keras' own ``.weights.h5`` files use.
  Keras' auto-generated names (``dense_7``) count per process and are never used.
* **Identity** is the ``Variable`` object: a variable that several layers hold is stored
  once, with every other name recorded as an alias, and is assigned once on load.
* **Keras files**: ``load(model, "x.weights.h5")`` and ``load(model, "x.keras")`` read
  Keras' own files; their per-layer duplicate copies are found by content.
  :func:`save_weights` and :func:`save_model` write Keras' own files, which Keras loads
  natively, with each shared variable stored once (HDF5 hard links); :func:`check`
  tells what Keras' own ``save_weights`` would write again.

Example:
    >>> import keras, weightvault.keras as wvk
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="head")])
    >>> report = wvk.save(model, "m.safetensors")
    >>> wvk.load(model, "m.safetensors").loaded
    ['head/kernel', 'head/bias']
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import partial
from typing import Any

from ._base.errors import BackendNotInstalled, UnsupportedValueError, capped
from ._base.snapshots import SaveHandle, SnapshotPool

try:
    import keras
except ImportError as e:  # pragma: no cover - exercised only without keras
    raise BackendNotInstalled(
        "weightvault.keras needs Keras 3: pip install 'weightvault[keras]'"
    ) from e

from ._base.dtypes import ITEMSIZE, numpy_dtype
from ._base.errors import LoadOptionError
from ._base.reports import LoadReport, SaveReport
from ._base.types import PathLike
from ._file.arrays import entry_array
from ._file.checkpoint import CheckpointSource
from ._file.sharing import Source
from ._keras import config as _config, state as _keras_state
from ._keras.files import as_ours
from ._keras.fill import fill
from ._keras.internals import saving_lib, sublayers
from ._keras.layout import (
    Layout,
    SharedVariable as SharedVariable,
    SharingReport,
    check as _check,
    frozen_paths,
    record,
)
from ._keras.sources import checkpoint_sources as checkpoint_sources, model_sources
from ._keras.trainable import restore_flags, select, set_trainable
from ._keras.walk import NAMES as NAMES, Var, model_vars
from ._load.plan import LoadOptions, LoadPlan, RulesArg, Target, plan_load
from ._load.steps import save_file, values_by_group
from ._load.transforms import Transforms
from .formats._registry import opened
from .formats.keras_archive import read_json_members, save_model_archive
from .formats.keras_h5 import Declared, H5Checkpoint
from .formats.keras_write import H5Dataset, save_h5

__all__ = [
    "check",
    "freeze",
    "load",
    "load_file",
    "load_model",
    "save",
    "save_model",
    "save_weights",
    "trainable",
    "unfreeze",
]

#: The ``"format"`` written into ``__metadata__``.
FRAMEWORK = "keras"
#: The last background save; the next save waits for it.
_pending: SaveHandle[SaveReport] | None = None


def save(
    obj: Any,
    path: PathLike,
    *,
    metadata: Mapping[str, str] | None = None,
    checksum: bool = True,
    dedupe_copies: bool = False,
    optimizer: Any = None,
    scheduler: Any = None,
    rng: bool = False,
    background: bool = False,
) -> Any:
    """Save a built Keras model (or a dict of variables/arrays), every shared value once.

    A variable that several layers hold is written once; its other names become aliases.
    Equal but separate variables are stored under every name, so plain safetensors
    readers see them all, unless ``dedupe_copies`` is set. Frozen flags are recorded.
    Optimizer and metric state are not model weights and are left out. The file is a
    valid safetensors file, written atomically.

    Args:
        obj: A built ``keras.Model`` or layer, or a ``{name: Variable | array}`` dict.
        path: Where to write. An existing file is replaced only once the new one is complete.
        metadata: Your own ``str -> str`` metadata, also visible to ``safe_open``.
        checksum: Record an xxh3-64 checksum of every stored tensor.
        dedupe_copies: Store equal but separate values once, as copies only weightvault
            readers see.
        optimizer: Also store this Keras optimizer's state: each slot (``momentum``,
            ``velocity``, ...) under the path of its model variable, plus ``iterations``
            and ``get_config()`` as JSON (see docs/resuming.md).
        scheduler: Not taken: a Keras learning-rate schedule is part of the optimizer and
            is saved with it. Passing one raises ``TypeError``.
        rng: Also store the Python, numpy, Keras ``SeedGenerator`` (global and each random
            layer's) and, on the PyTorch backend, torch RNG states.
        background: Copy the values now and write in a thread; returns a
            :class:`~weightvault.SaveHandle` whose ``wait()`` gives the report, so
            training may change the variables at once. A second save waits for the first.

    Returns:
        What was stored, aliased and copied, and the bytes saved (a
        :class:`~weightvault.SaveHandle` of it with ``background=True``).

    Example:
        >>> report = save(model, "model.safetensors")
        >>> report.aliases
        {'tied_1/shared_kernel': 'tied/shared_kernel'}
    """
    global _pending
    if _pending is not None:  # one save at a time, in order
        _pending.settle()
        _pending = None
    snapshot = SnapshotPool() if background else None
    found = checkpoint_sources(
        obj, optimizer=optimizer, scheduler=scheduler, rng=rng, snapshot=snapshot
    )
    write = partial(save_file, path, found, FRAMEWORK, metadata, checksum, dedupe_copies)
    if not background:
        return write()
    _pending = SaveHandle(write, f"save {os.fspath(path)}")
    return _pending


def load_file(
    path: CheckpointSource,
    *,
    mmap: bool = False,
    verify: bool = False,
    max_bytes: int | None = None,
) -> dict[str, Any]:
    """Read every name in ``path`` as a numpy array.

    Aliases come back as one shared array, copies as separate arrays with equal values,
    and views as views of their base. Assign them with ``variable.assign(array)``.

    Args:
        path: A weightvault or plain safetensors file, or a Keras ``.weights.h5``.
        mmap: Return read-only-in-spirit arrays backed by the file mapping (copy-on-write:
            writes never reach the file) instead of copies.
        verify: Check every checksum first.
        max_bytes: Most bytes the arrays may take (stored tensors unless ``mmap``, and
            every copy). By default the larger of 256 MiB and 16 times the file's size;
            raise it for a trusted file that expands that much.

    Raises:
        FormatError: Not a checkpoint weightvault reads, or more than ``max_bytes``.
        ChecksumError: ``verify`` found damaged bytes.

    Example:
        >>> arrays = load_file("model.safetensors")
        >>> model.get_layer("head").kernel.assign(arrays["head/kernel"])
    """
    with opened(path) as ckpt:
        # Without mmap, private copies read with preadv: a file truncated meanwhile is a
        # FormatError, where copying out of the map would die of SIGBUS.
        stored = ckpt.mapped if mmap else ckpt.read
        return values_by_group(
            ckpt, mmap, "arrays", max_bytes, verify, stored=stored, value=entry_array, own=_copy
        )


def _copy(a: Any) -> Any:
    return a.copy()


def load(
    model: Any,
    path: CheckpointSource,
    *,
    strict: bool = True,
    rules: RulesArg = (),
    tie: bool = False,
    restore_frozen: bool = False,
    verify: bool = False,
    cast: bool = False,
    transforms: Transforms | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    rng: bool = False,
) -> LoadReport:
    """Fill a built Keras ``model`` from ``path`` in place, all or nothing.

    Every check (names, shapes, dtypes, ties and, with ``verify``, checksums) runs before
    the first variable is assigned. A variable several layers share is assigned once; a
    group the file ties but the model holds apart is filled and listed in ``untied``.

    Args:
        model: A built ``keras.Model`` or layer.
        path: A weightvault file, any safetensors file, or Keras' own ``.weights.h5``
            (its names are matched the way Keras does).
        strict: Raise on missing, unexpected or mismatched names (else only report them).
        rules: ``(pattern, replacement)`` renames of names on disk, or ``"auto"``.
        tie: Keras cannot make built layers share a variable: ``True`` raises if the file
            ties variables the model holds apart; share them when building instead.
        restore_frozen: Set each loaded variable's ``trainable`` flag from the file, and
            ``layer.trainable = False`` on layers whose variables are all frozen;
            recompile before ``fit``.
        verify: Check the checksums of what is read first.
        cast: Allow dtypes to differ; values are converted.
        transforms: ``{pattern: transform}`` over the model's names: ``{"*/kernel":
            "transpose"}`` loads a torch ``Linear.weight`` into a ``Dense.kernel``.
        optimizer: Also restore this Keras optimizer's slots, ``iterations`` and learning
            rate, matched by variable path (``rules`` apply); one not built yet is built
            on ``model.trainable_variables`` first. See ``report.optimizer``.
        scheduler: Not taken (see :func:`save`); passing one raises ``TypeError``.
        rng: Also restore the Python, numpy, Keras ``SeedGenerator`` and torch RNG states.

    Returns:
        What was loaded, renamed, missing, unexpected, mismatched and untied.

    Raises:
        KeyMismatchError, ShapeMismatchError, TieConflictError, ChecksumError: As in
            :func:`weightvault.torch.load`; nothing was changed.

    Example:
        >>> load(model, "gpt.safetensors", rules=[("h.*", "blocks/*")]).untied
        []
    """
    _keras_state.refuse_scheduler(scheduler)
    options = LoadOptions(
        rules=rules, strict=strict, cast=cast, tie=tie, verify=verify, transforms=transforms
    )
    return _load(model, path, options, restore_frozen, optimizer=optimizer, rng=rng)


def _load(
    model: Any,
    path: CheckpointSource,
    options: LoadOptions,
    restore_frozen: bool,
    *,
    optimizer: Any,
    rng: bool,
) -> LoadReport:
    vs = model_vars(model, "load")
    with opened(path) as file:
        label = file.region.label if isinstance(file, H5Checkpoint) else None
        ckpt = as_ours(file, vs, label)
        lp = plan_load(ckpt, _targets(vs), options, type(model).__name__)
        _refuse_ties(lp, model)
        # Training state is read and checked before the first variable is assigned too.
        prepared = _keras_state.prepare(ckpt, model, lp, options, optimizer=optimizer, rng=rng)
        # Every byte is reached (and with verify, checked) before the first assignment.
        ckpt.stage(lp.reads(), options.verify)
        variables = {v.name: v.variable for v in vs}
        fill(ckpt, lp, variables, lambda a: _numpy_dtype(a.dtype))
    if restore_frozen:
        restore_flags(model, vs, lp.frozen)
        lp.report_frozen()
    prepared.apply(lp.report)
    return lp.report


def _targets(vs: list[Var]) -> list[Target]:
    return [
        Target(
            v.name,
            id(v.variable),
            NAMES.get(str(v.variable.dtype), str(v.variable.dtype)),
            tuple(v.variable.shape),
            v.is_param,
        )
        for v in vs
    ]


def _numpy_dtype(name: str) -> Any:
    return numpy_dtype(name) if name in ITEMSIZE else None


def _refuse_ties(lp: LoadPlan, model: Any) -> None:
    if lp.tie:
        raise LoadOptionError(
            f"Cannot tie {capped(' / '.join(g) for g in lp.tie)} in {type(model).__name__}: "
            "Keras cannot make built layers share a variable. Pass the shared variable "
            "to the layers when building the model, or load with tie=False (each "
            "variable is filled and reported as untied)."
        )


# -- Keras' own files, each shared variable stored once ------------------------------------


def save_weights(
    model: Any, path: PathLike, *, metadata: Mapping[str, str] | None = None
) -> SaveReport:
    """Write ``model``'s weights as Keras' own ``.weights.h5``, each variable once.

    The file has exactly the groups, names and attributes of ``model.save_weights(path)``
    (Keras' own save walk decides them, optimizer state included), and
    ``model.load_weights(path)`` reads it natively. A variable several layers hold is
    written once; its other paths are HDF5 hard links to it. The frozen variables and
    your ``metadata`` go into a root attribute Keras ignores. Written atomically.

    Returns:
        Dataset paths ``stored`` and ``aliases`` (``{link: first path}``), and the bytes.

    Example:
        >>> report = save_weights(model, "model.weights.h5")   # 4 layers, 1 kernel
        >>> report.aliases
        {'layers/tied_1/vars/0': 'layers/tied/vars/0', ...}
        >>> model.load_weights("model.weights.h5")             # Keras reads it as its own
    """
    return save_h5(path, *_h5_layout(model, record(model), metadata))


def save_model(
    model: Any, path: PathLike, *, metadata: Mapping[str, str] | None = None
) -> SaveReport:
    """Write ``model`` as a ``.keras`` archive, its weights stored as :func:`save_weights`.

    ``config.json`` and ``metadata.json`` are what ``model.save(path)`` writes (Keras'
    own serializer makes them), so ``keras.models.load_model(path)`` opens the archive;
    ``model.weights.h5`` holds each shared variable once.

    Raises:
        UnsupportedValueError: A layer keeps assets (a ``TextVectorization``
            vocabulary), which this writer does not store; use ``model.save``.

    Example:
        >>> save_model(model, "model.keras").file_bytes
        295412
        >>> keras.models.load_model("model.keras")
    """
    layout = _h5_layout(model, record(model), metadata)  # refuses an unbuilt model first
    assets = [str(layer.name) for layer in sublayers(model) if hasattr(layer, "save_assets")]
    if assets:
        raise UnsupportedValueError(
            f"{capped(assets)} keep assets (vocabulary files) that save_model does not "
            "store; save this model with model.save()"
        )
    config, meta = saving_lib("_serialize_model_as_json")(model)
    return save_model_archive(path, config, meta, layout)


def _h5_layout(
    model: Any, layout: Layout, metadata: Mapping[str, str] | None
) -> tuple[list[tuple[str, dict[str, Any]]], list[H5Dataset], Declared]:
    """Keras' layout as the HDF5 writer takes it: each variable's later paths linked."""
    datasets = [
        H5Dataset(path, partial(keras.ops.convert_to_numpy, value), link_to=first)
        for path, value, first in layout.linked()
    ]
    declared = Declared(frozen=frozen_paths(model, layout), metadata=dict(metadata or {}))
    return layout.groups, datasets, declared


def check(model: Any) -> SharingReport:
    """The guardrail: every variable several layers hold, and what Keras writes again.

    Keras' ``save_weights`` and ``model.save`` write such a variable once per layer;
    :func:`save_weights` and :func:`save_model` write it once.

    Returns:
        ``shared``, one :class:`SharedVariable` each (weightvault names, Keras' dataset
        paths, dtype, shape, bytes), and ``extra_bytes`` in all; ``str()`` of it reads.

    Example:
        >>> report = check(model)
        >>> report.extra_bytes, report.shared[0].names
        (786432, ('tied/kernel', 'tied_1/kernel', 'tied_2/kernel', 'tied_3/kernel'))
    """
    return _check(model)


def load_model(
    path: PathLike,
    *,
    custom_objects: Mapping[str, Any] | None = None,
    safe_mode: bool = True,
    compile: bool = True,
    verify: bool = False,
) -> Any:
    """Build the model a ``.keras`` archive describes and load its weights, streamed.

    The config is vetted first: a ``Lambda`` layer or a class that is not Keras' own is
    refused unless named in ``custom_objects`` (or ``safe_mode=False``), since building
    it would run code from the file. The weights are then loaded as :func:`load` does,
    one variable at a time (``keras.models.load_model`` reads the whole weights file
    into memory first). Optimizer state in the archive is not restored.

    Raises:
        FormatError: The archive is refused (path traversal, a zip bomb, bad links), or
            its config asks for code the caller did not allow (naming the object).

    Example:
        >>> model = load_model("model.keras")
    """
    config, _ = read_json_members(path)
    where = f"{os.fspath(path)} (member 'config.json')"
    _config.vet(config, where, custom_objects, safe_mode)
    model = saving_lib("_model_from_config")(config, custom_objects, compile, safe_mode)
    load(model, path, verify=verify)
    return model


def freeze(model: Any, *patterns: str) -> list[str]:
    """Freeze the variables whose paths or layer names match ``patterns`` (all if none).

    A pattern matches a variable path (``"encoder/dense/kernel"``, ``"encoder/*"``), a
    bare layer path (``"encoder"`` means everything under it) or a Keras layer name
    (``layer.name``). Freezing a shared variable freezes it under all of its names, as
    in Keras, where the flag lives on the variable. Layers whose parameters are all frozen
    get ``trainable = False``.

    Keras builds its optimizer and train step on ``model.trainable_variables`` at
    ``compile()``: **recompile after freezing** for ``fit`` to see it.

    Args:
        model: A built Keras model or layer.
        *patterns: Variable paths, layer paths or layer names, with ``*`` wildcards.

    Returns:
        Every name frozen, aliases included.

    Example:
        >>> freeze(model, "encoder")
        ['encoder/dense/kernel', 'encoder/dense/bias']
        >>> model.compile(optimizer="adam", loss="mse")   # for fit() to see it
    """
    chosen, vs = select(model, patterns, "freeze")
    ids = {id(v.variable) for v in chosen}
    set_trainable(model, vs, ids, ids)
    return [v.name for v in chosen]


def unfreeze(model: Any, *patterns: str) -> list[str]:
    """Make the variables matching ``patterns`` trainable again; return every name.

    Recompile the model afterwards so its optimizer gets them.
    """
    chosen, vs = select(model, patterns, "unfreeze")
    set_trainable(model, vs, {id(v.variable) for v in chosen}, set())
    return [v.name for v in chosen]


def trainable(model: Any) -> list[Any]:
    """Each trainable variable once, in model order: what an optimizer should get.

    Example:
        >>> opt = keras.optimizers.AdamW(1e-4)
        >>> opt.build(trainable(model))
    """
    return list(model.trainable_variables)


# -- the adapter contract (weightvault._vault.adapters.Adapter), used by the vault --------------


def owns(obj: Any) -> bool:
    """Whether ``obj`` is a Keras layer or model, or a dict holding Keras variables."""
    if isinstance(obj, Mapping):
        return any(isinstance(v, keras.Variable) for v in obj.values())
    return isinstance(obj, keras.layers.Layer)


def sources(obj: Any) -> tuple[list[Source], list[str]]:
    """``(sources, skipped)`` of a model or variable dict, as :func:`save` would store them."""
    return model_sources(obj)
