"""Keras' side of a training checkpoint: optimizer and RNG state, by variable path.

The layout and the matching by name are framework-free (:mod:`weightvault._training`);
this module reads them out of ``keras.optimizers.Optimizer`` objects and writes them back.

**Which optimizer variable belongs to which model variable.** A Keras optimizer creates
each per-variable slot (Adam's ``momentum`` and ``velocity``, SGD's ``momentum``) with
``add_variable_from_reference``, which names it ``<model variable path, '/' as
'_'>_<slot>``; the optimizer's ``build`` list holds the model variables themselves. The
slot's owner is the model variable whose path is the longest such prefix, and the slot is
stored under weightvault's name of that variable (``head/kernel``), never under Keras'
per-process auto-names (``dense_7``). The step counter (``iterations``) and the
configuration (``get_config()``: learning rate or schedule, betas, weight decay, ...) are
JSON.

**RNG.** Python ``random``, numpy's global state, Keras' global ``SeedGenerator`` (if one
was made), every ``SeedGenerator`` of the model's layers (``Dropout``'s, by position in
layer order) and, on the PyTorch backend, torch's CPU generator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import keras
import numpy as np

from .. import _training
from .._base.errors import TrainingStateError, UnsupportedStateError
from .._file import layout
from .._file.checkpoint import Checkpoint
from .._file.layout import RNG_PREFIX
from .._file.sharing import Source
from .._load.plan import RulesArg
from .._training import codec as _codec
from .._training.state import Prepared, rename_for as _rename, stored_name as _stored
from .walk import _BY_NUMPY, NAMES, _base, _dtype_name, _walk

#: Configuration keys that are no hyperparameter: a name says nothing about the training.
_NOT_HYPER = frozenset({"name"})


def _dtype(name: str, value: Any) -> str:
    return _dtype_name(name, str(value.dtype))


def _array_source(name: str, arr: Any) -> Source:
    """A training-state tensor as a source, from a private numpy copy taken now."""
    arr = np.array(arr, copy=True, order="C")  # keeps 0-d arrays 0-d, unlike ascontiguousarray
    dtype = _BY_NUMPY.get(arr.dtype)
    if dtype is None:
        raise UnsupportedStateError(f"{name} has dtype {arr.dtype}, which safetensors cannot store")
    flat: Any = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
    return Source(name, dtype, tuple(arr.shape), ("train", name), lambda: memoryview(flat))


def _variable_array(var: Any) -> Any:
    return np.asarray(keras.ops.convert_to_numpy(var))


def slots(optimizer: Any) -> dict[int, dict[str, Any]]:
    """``{id(model variable): {slot name: optimizer variable}}`` of a built optimizer.

    Raises:
        UnsupportedStateError: An optimizer variable belongs to no model variable (an
            optimizer that creates state some other way), so it has no name to go under.
    """
    trainables = list(optimizer._trainable_variables)
    prefixes = sorted(
        ((str(v.path).replace("/", "_") + "_", v) for v in trainables), key=lambda p: -len(p[0])
    )
    out: dict[int, dict[str, Any]] = {id(v): {} for v in trainables}
    for ov in optimizer.variables:
        if ov is optimizer._iterations or ov is optimizer._learning_rate:
            continue
        name = str(ov.name)
        for prefix, v in prefixes:
            if name.startswith(prefix) and len(name) > len(prefix):
                slot = name[len(prefix) :]
                if slot in out[id(v)]:
                    raise UnsupportedStateError(
                        f"{type(optimizer).__name__} holds two variables named {name!r}; "
                        "their owners cannot be told apart, so the state cannot be saved"
                    )
                out[id(v)][slot] = ov
                break
        else:
            raise UnsupportedStateError(
                f"{type(optimizer).__name__} variable {name!r} belongs to no model variable "
                "(it was not made by add_variable_from_reference), so it has no name to be "
                "saved under; save without optimizer= or use a built-in Keras optimizer"
            )
    return out


def _names(model: Any) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for v in _walk(model):
        out.setdefault(id(v.variable), []).append(v.name)
    return out


def _seed_generators(model: Any) -> list[Any]:
    """The model's own ``SeedGenerator`` objects, in layer order, each once."""
    seen: set[int] = set()
    out = []
    for layer in [model, *model._flatten_layers(include_self=False, recursive=True)]:
        for g in getattr(layer, "_seed_generators", []):
            if id(g) not in seen:
                seen.add(id(g))
                out.append(g)
    return out


def _global_seed_generator() -> Any:
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("global_seed_generator")


def refuse_scheduler(scheduler: Any) -> None:
    """Keras has no scheduler object apart from the optimizer: say so if one is passed."""
    if scheduler is not None:
        raise TypeError(
            "weightvault.keras takes no scheduler=: a Keras learning-rate schedule lives in "
            "the optimizer (keras.optimizers.Adam(learning_rate=schedule)) and is saved with "
            "optimizer=..., its position given by the optimizer's iterations"
        )


def training_sources(
    model: Any, *, optimizer: Any, rng: bool
) -> tuple[list[Source], dict[str, Any] | None]:
    """The tensors and the manifest section that record the training state.

    Every tensor is copied now, so the caller may keep training while a background save
    writes.

    Raises:
        WeightvaultError: The optimizer holds a variable the model does not have.
        UnsupportedStateError: A value has no JSON or tensor form.
    """
    if optimizer is None and not rng:
        return [], None
    sources: list[Source] = []
    doc: dict[str, Any] = {"version": layout.VERSION}
    if optimizer is not None:
        label = type(optimizer).__name__
        names = _names(model)
        built = bool(optimizer.built)
        variables = list(optimizer._trainable_variables) if built else model.trainable_variables
        owned = slots(optimizer) if built else {}
        listed: list[str] = []
        params: dict[str, tuple[Any, dict[str, str], dict[str, Any]]] = {}
        for v in variables:
            if id(v) not in names:
                raise TrainingStateError(
                    f"{label} holds a variable {v.path!r} of shape {list(v.shape)} that "
                    f"{type(model).__name__} does not have, so it has no name to be saved "
                    "under; build the optimizer from model.trainable_variables"
                )
            name = names[id(v)][0]
            listed.append(name)
            tensors: dict[str, str] = {}
            for slot, ov in owned.get(id(v), {}).items():
                stored = layout.state_name(name, slot)
                sources.append(_array_source(stored, _variable_array(ov)))
                tensors[slot] = stored
            params[name] = (list(v.shape), tensors, {})
        config = {k: v for k, v in optimizer.get_config().items() if k not in _NOT_HYPER}
        doc["optimizer"] = _training.encode_optimizer(label, [(config, listed)], params)
        doc["optimizer"]["iterations"] = int(np.asarray(_variable_array(optimizer._iterations)))
    if rng:
        r: dict[str, Any] = {"python": _training.python_rng(), "numpy": _training.numpy_rng()}
        g = _global_seed_generator()
        if g is not None:
            r["keras"] = RNG_PREFIX + "keras"
            sources.append(_array_source(r["keras"], _variable_array(g.state)))
        r["keras_layers"] = []
        for i, g in enumerate(_seed_generators(model)):
            r["keras_layers"].append(f"{RNG_PREFIX}keras_layers/{i}")
            sources.append(_array_source(r["keras_layers"][-1], _variable_array(g.state)))
        if keras.backend.backend() == "torch":
            import torch

            r["torch"] = RNG_PREFIX + "torch"
            sources.append(_array_source(r["torch"], torch.get_rng_state().numpy()))
        doc["rng"] = r
    return sources, doc


def _read(ckpt: Checkpoint, name: str, like: Any, needed: list[str], what: str) -> Any:
    """A private array of stored training tensor ``name``, checked against ``like``."""
    where = ckpt.path
    stored = _stored(ckpt, name) if isinstance(name, str) else None
    if stored is None:
        raise TrainingStateError(f"{where}: {what} is missing (no tensor {str(name)[:80]!r})")
    info = ckpt.stored[stored]
    want = NAMES.get(str(like.dtype), str(like.dtype))
    if info.dtype != want or tuple(info.shape) != tuple(like.shape):
        raise TrainingStateError(
            f"{where}: {what} is {info.dtype}{list(info.shape)}, but it must fill a "
            f"{want}{list(like.shape)}; build the optimizer (and model) as the saved run did"
        )
    needed.append(stored)
    return np.array(_base(ckpt, stored), copy=True, order="C")


def prepare(
    ckpt: Checkpoint,
    model: Any,
    *,
    optimizer: Any,
    rng: bool,
    rules: RulesArg,
    renamed: list[tuple[str, str]],
    strict: bool,
    verify: bool,
) -> Prepared:
    """Check and read everything now, so that applying it cannot fail half-way.

    An optimizer that is not built yet is built on ``model.trainable_variables`` first
    (what ``fit`` would do), so that it has variables to fill.

    Raises:
        TrainingStateError: Something asked for is not in the checkpoint, or is malformed.
        KeyMismatchError, ShapeMismatchError: ``strict`` and the optimizer's variables do
            not match the saved state.
    """
    out = Prepared()
    if optimizer is None and not rng:
        return out
    where = ckpt.path
    if ckpt.manifest.training is None:
        raise TrainingStateError(
            f"{where} holds weights only: no optimizer or RNG state. Save with "
            "optimizer=..., rng=True to resume training from it"
        )
    training = _training.read_training(ckpt.manifest.training, where)
    needed: list[str] = []
    if optimizer is not None:
        out.steps.append(
            _prepare_optimizer(
                ckpt, model, optimizer, training, rules, renamed, strict, out, needed
            )
        )
    if rng:
        _prepare_rng(ckpt, model, training, out, needed)
    if verify:
        ckpt.verify(sorted(set(needed)))
    return out


def _prepare_optimizer(
    ckpt: Checkpoint,
    model: Any,
    optimizer: Any,
    training: Mapping[str, Any],
    rules: RulesArg,
    renamed: list[tuple[str, str]],
    strict: bool,
    out: Prepared,
    needed: list[str],
) -> Callable[[], None]:
    where = ckpt.path
    label = type(optimizer).__name__
    saved = _training.read_optimizer(training, lambda n: _stored(ckpt, n) is not None, where)
    if saved.cls != label:
        raise TrainingStateError(
            f"{where} holds the state of a {saved.cls} optimizer, which a {label} cannot "
            f"take; build a {saved.cls} to resume, or load without optimizer="
        )
    doc = training["optimizer"]
    iterations = doc.get("iterations")
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 0:
        raise TrainingStateError(f"{where}: the optimizer's iterations are malformed")
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    names = _names(model)
    variables = list(optimizer._trainable_variables)
    members = []
    for v in variables:
        if id(v) not in names:
            raise TrainingStateError(
                f"{label} holds a variable {v.path!r} of shape {list(v.shape)} that "
                f"{type(model).__name__} does not have; its state cannot be found by name"
            )
        members.append((names[id(v)], tuple(v.shape)))
    plan = _training.plan_optimizer(
        saved, [members], _rename(rules, renamed), strict=strict, where=where, label=label
    )
    out.optimizer = plan.report
    owned = slots(optimizer)
    # Read every tensor now: the file may be closed, and nothing may fail, once applying.
    assignments: list[tuple[Any, Any]] = []
    for (_, pi), disk in sorted(plan.fill.items()):
        var = variables[pi]
        rec = saved.params[disk]
        mine = owned[id(var)]
        if set(rec.tensors) != set(mine):
            raise TrainingStateError(
                f"{where}: the saved state of {disk!r} has slots {sorted(rec.tensors)}, but "
                f"this {label} keeps {sorted(mine)} for {members[pi][0][0]!r}; build the "
                "optimizer with the saved run's options (see its get_config())"
            )
        for slot, stored in rec.tensors.items():
            what = f"optimizer slot {slot!r} of {disk!r}"
            assignments.append((mine[slot], _read(ckpt, stored, mine[slot], needed, what)))
    config = {k: v for k, v in optimizer.get_config().items() if k not in _NOT_HYPER}
    hyper = saved.groups[0].hyper if saved.groups else {}
    lr = hyper.get("learning_rate")
    lr_var = optimizer._learning_rate
    if isinstance(lr_var, keras.Variable) and isinstance(lr, (int, float)):
        assignments.append((lr_var, np.asarray(lr, dtype=np.dtype(str(lr_var.dtype)))))
    if {k: v for k, v in hyper.items() if k != "learning_rate"} != {
        k: _codec.decode(_codec.encode(v, k), k) for k, v in config.items() if k != "learning_rate"
    }:
        plan.report.groups_kept.append(0)
    step = np.asarray(iterations, dtype=np.dtype(str(optimizer._iterations.dtype)))
    assignments.append((optimizer._iterations, step))

    def apply() -> None:
        for var, value in assignments:
            var.assign(value)

    return apply


def _prepare_rng(
    ckpt: Checkpoint, model: Any, training: Mapping[str, Any], out: Prepared, needed: list[str]
) -> None:
    where = ckpt.path
    doc = _training.prepare_host_rng(training, where, out)
    assignments: list[tuple[Any, Any]] = []
    if doc.get("keras") is not None:
        from keras.src.random.seed_generator import global_seed_generator

        g = global_seed_generator()  # made now if this process has none yet
        state = _read(ckpt, doc["keras"], g.state, needed, "Keras' global seed state")
        assignments.append((g.state, state))
    layers = doc.get("keras_layers") or []
    gens = _seed_generators(model)
    if not isinstance(layers, list) or len(layers) != len(gens):
        raise TrainingStateError(
            f"{where} holds the seed states of {len(layers)} SeedGenerators (Dropout and "
            f"other random layers), but {type(model).__name__} has {len(gens)}; resume into "
            "the same architecture, or load without rng="
        )
    for i, (name, g) in enumerate(zip(layers, gens, strict=True)):
        state = _read(ckpt, name, g.state, needed, f"the seed state of random layer {i}")
        assignments.append((g.state, state))
    if assignments:
        out.restored.append("rng:keras")
    if doc.get("torch") is not None and keras.backend.backend() == "torch":
        import torch

        like = torch.get_rng_state().numpy()
        cpu = torch.from_numpy(_read(ckpt, doc["torch"], like, needed, "the torch RNG state"))
        out.steps.append(lambda: torch.set_rng_state(cpu))
        out.restored.append("rng:torch")

    def apply() -> None:
        for var, value in assignments:
            var.assign(value)

    out.steps.insert(0, apply)
