"""Save and load Keras 3 models, with shared variables stored once, renames and freezing.

The verbs and their semantics are those of :mod:`weightvault.torch`; the load policy is
the same core (:func:`weightvault._match.plan_load`). What is Keras-specific lives here:

* **Names** look like ``Variable.path`` (``"encoder/dense/kernel"``) but are built from
  what is stable between two processes that build the same model: attribute names of
  subclassed models, the layer names you chose, and otherwise the class name numbered by
  position (``dense``, ``dense_1``), the scheme Keras' own ``.weights.h5`` files use.
  Keras' auto-generated names (``dense_7``) count per process and are never used.
* **Identity** is the ``Variable`` object: a variable that several layers hold is stored
  once, with every other name recorded as an alias, and is assigned once on load.
* **Keras files**: ``load(model, "x.weights.h5")`` reads Keras' own files; their
  per-layer duplicate copies are found by content.

Example:
    >>> import keras, weightvault.keras as wvk
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="head")])
    >>> report = wvk.save(model, "m.safetensors")
    >>> wvk.load(model, "m.safetensors").loaded
    ['head/kernel', 'head/bias']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._base.background import SnapshotPool
from ._base.errors import BackendNotInstalled, capped

try:
    import keras
    import ml_dtypes  # noqa: F401 - the dtype table below needs it (bf16, fp8)
    import numpy as np
except ImportError as e:  # pragma: no cover - exercised only without keras
    raise BackendNotInstalled(
        "weightvault.keras needs Keras 3: pip install 'weightvault[keras]'"
    ) from e

from ._base.errors import LoadOptionError, ModelNotBuiltError
from ._base.reports import LoadReport, SaveReport
from ._base.types import PathLike
from ._file import writer as _writer
from ._file.checkpoint import Checkpoint, CheckpointSource
from ._file.header import TensorInfo
from ._file.manifest import Manifest, View
from ._file.sharing import Source
from ._keras.internals import sublayers
from ._keras.walk import _KERAS_FILE_NAME, NAMES, NUMPY, _base, _dtype_name, _Var, _walk
from ._load import rules as _rules, transforms as _transforms
from ._load.plan import RulesArg, Target, plan_load
from .formats._registry import open_checkpoint, opened

__all__ = ["freeze", "load", "load_file", "save", "trainable", "unfreeze"]

#: The ``"format"`` written into ``__metadata__``.
FRAMEWORK = "keras"


def _model_vars(model: Any, verb: str) -> list[_Var]:
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"{verb}() takes a Keras model or layer, not {type(model).__name__}")
    if not model.built:
        raise ModelNotBuiltError(
            f"{type(model).__name__} {model.name!r} is not built and has no variables yet; "
            "build it first, for example with model.build(input_shape) or by calling it "
            "on a batch"
        )
    return _walk(model)


def _numpy(value: Any, dtype: str) -> Any:
    arr = np.asarray(keras.ops.convert_to_numpy(value))
    want = NUMPY[dtype]
    if arr.dtype != want:
        arr = arr.astype(want)
    return np.ascontiguousarray(arr)


def _bytes_of(value: Any, dtype: str) -> memoryview:
    raw = getattr(value, "value", value)  # a Variable's backend tensor
    if (
        type(raw).__module__.startswith("torch")
        and hasattr(raw, "untyped_storage")
        # Keras' torch backend holds some dtypes wider (uint16 and uint32 as int32): then
        # the tensor's bytes are not the declared dtype's, and numpy converts them.
        and raw.element_size() == NUMPY[dtype].itemsize
    ):
        # KERAS_BACKEND=torch: hand out the tensor's own bytes; convert_to_numpy would
        # copy every variable (and widen bfloat16 to float32 and back).
        import torch

        t = raw.detach().cpu().contiguous()
        if t.numel() == 0:
            return memoryview(b"")
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    arr = _numpy(value, dtype)
    if arr.size == 0:
        return memoryview(b"")
    return memoryview(arr.reshape(-1).view(np.uint8))


def _frozen_ids(model: Any, vs: list[_Var]) -> set[int]:
    # What an optimizer would get decides; a non-trainable layer hides all its variables.
    live = {id(v) for v in model.trainable_variables}
    return {id(v.variable) for v in vs if v.is_param and id(v.variable) not in live}


def _sources(obj: Any) -> tuple[list[Source], list[str]]:
    """Every named variable as a :class:`Source`, and the names left out (none here).

    This is the contract every adapter offers the vault: ``(sources, skipped)``.
    """
    if isinstance(obj, Mapping):
        out = []
        for name, value in obj.items():
            is_var = isinstance(value, keras.Variable)
            arr = value if is_var else np.asarray(value)
            dtype = _dtype_name(name, str(value.dtype) if is_var else str(arr.dtype))
            out.append(
                Source(
                    name,
                    dtype,
                    tuple(arr.shape),
                    id(value),
                    lambda a=arr, d=dtype: _bytes_of(a, d),  # type: ignore[misc]
                    frozen=is_var and not value.trainable,
                )
            )
        return out, []
    vs = _model_vars(obj, "save")
    frozen = _frozen_ids(obj, vs)
    out = []
    for v in vs:
        var = v.variable
        dtype = _dtype_name(v.name, var.dtype)
        out.append(
            Source(
                v.name,
                dtype,
                tuple(var.shape),
                id(var),
                lambda x=var, d=dtype: _bytes_of(x, d),  # type: ignore[misc]
                frozen=id(var) in frozen,
            )
        )
    return out, []


def checkpoint_sources(
    obj: Any,
    *,
    optimizer: Any = None,
    scheduler: Any = None,
    rng: bool = False,
    snapshot: SnapshotPool | None = None,
) -> tuple[list[Source], list[str], dict[str, Any] | None]:
    """Model, optimizer and RNG as sources plus the manifest's training section.

    With ``snapshot`` (a background save), every variable that training can change (all
    but frozen ones; on JAX all) is copied now, so the save writes the values of the call.
    """
    from ._keras import state as _keras_state

    _keras_state.refuse_scheduler(scheduler)
    sources, skipped = _sources(obj)
    if snapshot is not None:
        # Keras' JAX train step donates every variable's buffer, frozen ones included, so
        # there a live read could meet a deleted array: copy them all.
        live_frozen = keras.backend.backend() != "jax"
        sources = [s if s.frozen and live_frozen else s.copied() for s in sources]
    if optimizer is None and not rng:
        return sources, skipped, None
    if isinstance(obj, Mapping):
        raise TypeError("optimizer= and rng= need the Keras model, not a dict of variables")
    extra, training = _keras_state.training_sources(obj, optimizer=optimizer, rng=rng)
    return sources + extra, skipped, training


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
) -> SaveReport:
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

    Returns:
        What was stored, aliased and copied, and the bytes saved.

    Example:
        >>> report = save(model, "model.safetensors")
        >>> report.aliases
        {'tied_1/shared_kernel': 'tied/shared_kernel'}
    """
    sources, skipped, training = checkpoint_sources(
        obj, optimizer=optimizer, scheduler=scheduler, rng=rng
    )
    return _writer.save_sources(
        path,
        sources,
        framework=FRAMEWORK,
        metadata=dict(metadata or {}),
        checksum=checksum,
        dedupe_copies=dedupe_copies,
        skipped=skipped,
        training=training,
    )


def _value(ckpt: Checkpoint, name: str, base: Any) -> Any:
    e = ckpt.entry(name)
    if e.view is None:
        return base
    v = e.view
    dtype = NUMPY[v.dtype]
    if v.span() <= 0:
        return np.empty(v.shape, dtype=dtype)
    # as_strided goes through __array_interface__, which loses ml_dtypes' types: stride
    # over unsigned integers of the same width, then reinterpret.
    word = np.dtype(f"<u{dtype.itemsize}")
    flat = base.reshape(-1).view(np.uint8)[v.offset : v.offset + v.span()].view(word)
    strides = tuple(s * dtype.itemsize for s in v.stride)
    return np.lib.stride_tricks.as_strided(flat, v.shape, strides).view(dtype)


def _read(ckpt: Checkpoint, name: str) -> Any:
    e = ckpt.entry(name)
    return _value(ckpt, name, _base(ckpt, e.stored))


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
        FormatError: The file is not a valid checkpoint, or would exceed ``max_bytes``.
        ChecksumError: ``verify`` and a tensor's bytes are damaged.

    Example:
        >>> arrays = load_file("model.safetensors")
        >>> arrays["tied_1/shared_kernel"] is arrays["tied/shared_kernel"]
        True
    """
    ckpt = open_checkpoint(path)
    try:
        # Views are views of their base and aliases share one array; what allocates is
        # every base read without mmap and every copy.
        copies = {e.group: e.nbytes for e in ckpt.entries.values() if ckpt.owns_memory(e)}
        cost = sum(copies.values())
        if not mmap:
            cost += sum(t.nbytes for t in ckpt.stored.values())
        ckpt.materializing(cost, f"reading {len(ckpt.names)} arrays", max_bytes)
        if verify:
            ckpt.verify()
        if mmap:
            bases = {s: _base(ckpt, s) for s in ckpt.stored}
        else:
            # Private copies read with preadv: a file truncated meanwhile is a
            # FormatError, where copying out of the map would die of SIGBUS.
            bases = {
                s: np.frombuffer(ckpt.read(s), dtype=NUMPY[t.dtype]).reshape(t.shape)
                for s, t in ckpt.stored.items()
            }
        out: dict[str, Any] = {}
        groups: dict[str, Any] = {}
        for name in ckpt.names:
            e = ckpt.entry(name)
            if e.group not in groups:
                value = _value(ckpt, name, bases[e.stored])
                # A copy is an array of its own, shared only with its aliases.
                groups[e.group] = value.copy() if ckpt.owns_memory(e) else value
            out[name] = groups[e.group]
        return out
    finally:
        if ckpt is not path:
            ckpt.close()


class _Renamed(Checkpoint):
    """A checkpoint whose names are translated; bytes come from the one it wraps.

    Used to read Keras' ``<path>/vars/<i>`` names as weightvault names of the target
    model, before the user's own rules apply. Names mapped to ``None`` disappear (their
    bytes stay, since another name may be a copy of them).
    """

    def __init__(self, inner: Checkpoint, mapping: Mapping[str, str | None]) -> None:
        self._inner = inner
        m = inner.manifest

        def keep(n: str) -> bool:
            return mapping.get(n, n) is not None

        def new(n: str) -> str:
            return mapping.get(n) or n

        stored: dict[str, TensorInfo] = {}
        self._back: dict[str, str] = {}
        for s, info in inner.stored.items():
            stored[new(s)] = TensorInfo(new(s), info.dtype, info.shape, info.start, info.end)
            self._back[new(s)] = s
        manifest = Manifest(
            aliases={new(a): new(k) for a, k in m.aliases.items() if keep(a)},
            copies={new(c): new(k) for c, k in m.copies.items() if keep(c)},
            views={
                new(n): View(new(v.base), v.dtype, v.shape, v.stride, v.offset)
                for n, v in m.views.items()
                if keep(n)
            },
            frozen=[new(n) for n in m.frozen if keep(n)],
            names=[new(n) for n in m.names if keep(n)],
            sums={new(k): v for k, v in m.sums.items()},
            checksum=m.checksum,
            metadata=m.metadata,
            version=m.version,
            ours=m.ours,
        )
        super().__init__(inner.path, stored, manifest)

    @property
    def size(self) -> int:
        return self._inner.size

    @property
    def framework(self) -> str | None:
        return self._inner.framework

    def raw(self, stored: str) -> memoryview:
        return self._inner.raw(self._back[stored])

    def check(self, stored: str) -> bool:
        return self._inner.check(self._back[stored])


def _as_ours(ckpt: Checkpoint, vs: list[_Var]) -> Checkpoint:
    """Read a Keras-written file (``layers/dense/vars/0``) under the target's names.

    Keras matches its files by these paths, computed on the target model; so do we. The
    optimizer's state is not for the model and is dropped.
    """
    ours = {v.name for v in vs}
    names = ckpt.names
    if any(n in ours for n in names) or not any(_KERAS_FILE_NAME.search(n) for n in names):
        return ckpt
    mapping: dict[str, str | None] = {}
    for n in names:
        if n.startswith("optimizer/"):
            mapping[n] = None
    for v in vs:
        if v.keras_name:
            mapping.setdefault(v.keras_name, v.name)
    # Readers may write "/layers/..." for the h5 root; accept both spellings.
    for n in names:
        if n.startswith("/") and n[1:] in mapping:
            mapping[n] = mapping[n[1:]]
    return _Renamed(ckpt, mapping)


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
    transforms: _transforms.Transforms | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    rng: bool = False,
) -> LoadReport:
    """Fill a built Keras ``model`` from ``path`` in place, all or nothing.

    Every check (names, shapes, dtypes, ties and, with ``verify``, checksums) runs before
    the first variable is assigned. A variable several layers share is assigned once;
    where the file ties names that the model holds as separate variables, each one is
    filled and the group is listed in ``report.untied``.

    Args:
        model: A built ``keras.Model`` or layer.
        path: A weightvault file, any safetensors file, or Keras' own ``.weights.h5``
            (read without modifying it; its names are matched the way Keras does).
        strict: Raise on missing, unexpected or mismatched names; with ``False`` they are
            only reported.
        rules: ``(pattern, replacement)`` renames of the names on disk, or ``"auto"``.
        tie: Keras cannot make built layers share a variable, so ``True`` raises if the
            file ties variables the model holds apart; share them when building instead.
        restore_frozen: Set each loaded variable's ``trainable`` flag from the file, and
            ``layer.trainable = False`` on layers whose variables are all frozen.
            Recompile before ``fit`` for the change to take effect.
        verify: Check the checksums of everything to be read first.
        cast: Allow dtypes to differ; values are converted.
        transforms: ``{pattern: transform}`` that rearrange values before assignment,
            matched against the model's names: ``{"*/kernel": "transpose"}`` loads a
            PyTorch ``Linear.weight`` ``(out, in)`` into a ``Dense.kernel`` ``(in, out)``.
        optimizer: Also restore this Keras optimizer's slots, ``iterations`` and learning
            rate, matched by variable path (``rules`` apply), so it may list its variables
            in another order or hold fewer after a freeze. An optimizer that is not built
            yet is built on ``model.trainable_variables`` first. ``strict`` applies; see
            ``report.optimizer``.
        scheduler: Not taken (see :func:`save`); passing one raises ``TypeError``.
        rng: Also restore the Python, numpy, Keras ``SeedGenerator`` and torch RNG states.

    Returns:
        A report of what was loaded, renamed, missing, unexpected, mismatched and untied.

    Raises:
        KeyMismatchError: ``strict`` and names disagree; the message proposes a rule.
        ShapeMismatchError: A shape or dtype differs.
        TieConflictError: The model shares a variable the file holds with different values.
        ChecksumError: ``verify`` and a tensor's bytes are damaged.

    Example:
        >>> report = load(model, "gpt.safetensors", rules=[("h.*", "blocks/*")])
        >>> report.untied
        []
    """
    from ._keras import state as _keras_state

    _keras_state.refuse_scheduler(scheduler)
    vs = _model_vars(model, "load")
    by_name = {v.name: v for v in vs}
    targets = [
        Target(
            v.name,
            id(v.variable),
            NAMES.get(str(v.variable.dtype), str(v.variable.dtype)),
            tuple(v.variable.shape),
            is_param=v.is_param,
        )
        for v in vs
    ]
    pairs = _transforms.check(transforms)
    with opened(open_checkpoint(path)) as raw_ckpt:
        ckpt = _as_ours(raw_ckpt, vs)

        def equal(a: str, b: str) -> bool:
            return bool(np.array_equal(_read(ckpt, a), _read(ckpt, b)))

        lp = plan_load(
            ckpt,
            targets,
            rules=rules,
            strict=strict,
            cast=cast,
            tie=tie,
            equal=equal,
            label=type(model).__name__,
            shape_of=_transforms.shape_hook(transforms),
        )
        if lp.tie:
            raise LoadOptionError(
                f"Cannot tie {capped(' / '.join(g) for g in lp.tie)} in {type(model).__name__}: "
                "Keras cannot make built layers share a variable. Pass the shared variable "
                "to the layers when building the model, or load with tie=False (each "
                "variable is filled and reported as untied)."
            )
        # Training state is read and checked before the first variable is assigned too.
        prepared = _keras_state.prepare(
            ckpt,
            model,
            optimizer=optimizer,
            rng=rng,
            rules=rules,
            renamed=lp.report.renamed,
            strict=strict,
            verify=verify,
        )
        needed = sorted({ckpt.entry(a.source).stored for a in lp.assignments})
        if verify:
            ckpt.verify(needed)
        values = []
        for a in lp.assignments:
            var = by_name[a.names[0]].variable
            value = _read(ckpt, a.source)
            t = _transforms.resolve(pairs, a.names)
            if t is not None:
                value = value.transpose(t.axes_for(value.ndim))
            want = NUMPY.get(NAMES.get(str(var.dtype), ""))
            if want is not None and value.dtype != want:
                value = value.astype(want)
            # Every value is read (and converted) before the first assignment.
            values.append((var, np.array(value, copy=True, order="C")))
        for var, value in values:
            var.assign(value)
    if restore_frozen:
        frozen = {id(by_name[n].variable) for n, f in lp.frozen.items() if f}
        chosen = {id(by_name[n].variable) for n in lp.frozen}
        _set_trainable(model, vs, chosen, frozen)
        lp.report.frozen = [n for n, f in lp.frozen.items() if f]
    prepared.apply(lp.report)
    return lp.report


def _set_trainable(model: Any, vs: list[_Var], chosen: set[int], frozen: set[int]) -> None:
    """Set ``trainable`` of the ``chosen`` variables (frozen if in ``frozen``) and of layers.

    Keras' ``layer.trainable`` setter rewrites the flags of all the layer's variables, so
    layers are set first and the variables' own flags last. A layer whose parameters are
    all frozen gets ``trainable = False`` (BatchNormalization then runs in inference mode,
    as Keras documents); any other layer that holds a chosen variable gets ``True``.
    """
    flags = {id(v.variable): bool(v.variable.trainable) for v in vs}
    for i in chosen:
        flags[i] = i not in frozen
    params = {id(v.variable) for v in vs if v.is_param}
    layers = [model, *sublayers(model)]
    for layer in layers:
        mine = {id(x) for x in layer.variables} & params
        if not mine or not mine & chosen:
            continue
        layer.trainable = not all(not flags[i] for i in mine)
    for v in vs:
        if id(v.variable) in flags:
            v.variable.trainable = flags[id(v.variable)]


def _select(model: Any, patterns: Iterable[str], verb: str) -> tuple[list[_Var], list[_Var]]:
    """The chosen parameters (every name) and all of the model's names."""
    vs = _model_vars(model, verb)
    params = [v for v in vs if v.is_param]
    names = [v.name for v in params]
    ids: set[int] = set()
    for pat in list(patterns) or ["*"]:
        hits = set(_rules.select(pat, names, "/"))
        chosen = {id(v.variable) for v in params if v.name in hits}
        # Keras layer names (``layer.name``) select all of that layer's parameters.
        for layer in sublayers(model):
            if _rules.match(pat, str(layer.name)) is not None:
                chosen |= {id(x) for x in layer.variables} & {id(v.variable) for v in params}
        if not chosen:
            layer_names = [str(x.name) for x in sublayers(model)]
            what = f"variable path or layer name of {type(model).__name__}"
            raise _rules.unmatched(verb, pat, names + layer_names, what, "/")
        ids |= chosen
    return [v for v in params if id(v.variable) in ids], vs


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
    chosen, vs = _select(model, patterns, "freeze")
    ids = {id(v.variable) for v in chosen}
    _set_trainable(model, vs, ids, ids)
    return [v.name for v in chosen]


def unfreeze(model: Any, *patterns: str) -> list[str]:
    """Make the variables matching ``patterns`` trainable again; return every name.

    Recompile the model afterwards so its optimizer gets them.
    """
    chosen, vs = _select(model, patterns, "unfreeze")
    _set_trainable(model, vs, {id(v.variable) for v in chosen}, set())
    return [v.name for v in chosen]


def trainable(model: Any) -> list[Any]:
    """Each trainable variable once, in model order: what an optimizer should get.

    Example:
        >>> opt = keras.optimizers.AdamW(1e-4)
        >>> opt.build(trainable(model))
    """
    return list(model.trainable_variables)


# -- the adapter contract (weightvault._adapters.Adapter), used by the vault --------------


def owns(obj: Any) -> bool:
    """Whether ``obj`` is a Keras layer or model, or a dict holding Keras variables."""
    if isinstance(obj, Mapping):
        return any(isinstance(v, keras.Variable) for v in obj.values())
    return isinstance(obj, keras.layers.Layer)


def sources(obj: Any) -> tuple[list[Source], list[str]]:
    """``(sources, skipped)`` of a model or variable dict, as :func:`save` would store them."""
    return _sources(obj)
