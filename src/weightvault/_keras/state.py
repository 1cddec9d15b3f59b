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

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from .. import _training
from .._base.errors import TrainingStateError, UnsupportedStateError
from .._file import layout
from .._file.arrays import array_bytes, dtype_name, read_stored
from .._file.checkpoint import Checkpoint
from .._file.layout import RNG_PREFIX
from .._file.sharing import Source
from .._load.plan import LoadOptions, LoadPlan
from .._load.resume import check_optimizer_class, training_doc
from .._training import codec as _codec
from .._training.expect import refuse
from .._training.known import keras_group_problems
from .._training.state import Prepared, rename_for as _rename, stored_name as _stored
from .walk import NAMES, walk

#: Configuration keys that are no hyperparameter: a name says nothing about the training.
_NOT_HYPER = frozenset({"name"})
#: The training state Keras saves beside the weights (a schedule is the optimizer's).
_KINDS = ("optimizer", "rng")


def _array_source(name: str, arr: Any) -> Source:
    """A training-state tensor as a source, from a private numpy copy taken now."""
    arr = np.array(arr, copy=True, order="C")  # keeps 0-d arrays 0-d, unlike ascontiguousarray
    dtype = dtype_name(arr.dtype)
    if dtype is None:
        raise UnsupportedStateError(f"{name} has dtype {arr.dtype}, which safetensors cannot store")
    return Source(name, dtype, tuple(arr.shape), ("train", name), lambda: array_bytes(arr))


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


def _members(model: Any, variables: list[Any], label: str) -> list[tuple[list[str], Any]]:
    """Each of the optimizer's ``variables`` as ``(every model name, shape)``.

    Raises:
        TrainingStateError: A variable is not the model's, so it has no name.
    """
    names: dict[int, list[str]] = {}
    for v in walk(model):
        names.setdefault(id(v.variable), []).append(v.name)
    for v in variables:
        if id(v) not in names:
            raise TrainingStateError(
                f"{label} holds a variable {v.path!r} of shape {list(v.shape)} that "
                f"{type(model).__name__} does not have, so its state has no name to be saved "
                "or found under; build the optimizer from model.trainable_variables"
            )
    return [(names[id(v)], tuple(v.shape)) for v in variables]


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
        TrainingStateError: The optimizer holds a variable the model does not have.
        UnsupportedStateError: A value has no JSON or tensor form.
    """
    if optimizer is None and not rng:
        return [], None
    sources: list[Source] = []
    doc: dict[str, Any] = {"version": layout.VERSION}
    if optimizer is not None:
        doc["optimizer"] = _optimizer_section(model, optimizer, sources)
    if rng:
        doc["rng"] = _rng_section(model, sources)
    return sources, doc


def _optimizer_section(model: Any, optimizer: Any, sources: list[Source]) -> dict[str, Any]:
    """The optimizer section; its slots are added to ``sources``."""
    label = type(optimizer).__name__
    built = bool(optimizer.built)
    variables = list(optimizer._trainable_variables) if built else model.trainable_variables
    owned = slots(optimizer) if built else {}
    params: dict[str, tuple[Any, dict[str, str], dict[str, Any]]] = {}
    for v, (names, shape) in zip(variables, _members(model, variables, label), strict=True):
        tensors: dict[str, str] = {}
        for slot, ov in owned.get(id(v), {}).items():
            tensors[slot] = layout.state_name(names[0], slot)
            sources.append(_array_source(tensors[slot], _variable_array(ov)))
        params[names[0]] = (list(shape), tensors, {})
    config = {k: v for k, v in optimizer.get_config().items() if k not in _NOT_HYPER}
    doc = _training.encode_optimizer(label, [(config, list(params))], params)
    doc["iterations"] = int(np.asarray(_variable_array(optimizer._iterations)))
    return doc


def _rng_section(model: Any, sources: list[Source]) -> dict[str, Any]:
    """The RNG section; Keras' seed states (and torch's, on its backend) go to ``sources``."""
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
    return r


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
    return read_stored(ckpt, stored)


def prepare(
    ckpt: Checkpoint, model: Any, plan: LoadPlan, options: LoadOptions, *, optimizer: Any, rng: bool
) -> Prepared:
    """Check and read everything now, so that applying it cannot fail half-way.

    ``plan`` is the weights' load plan: optimizer state follows its renames. An optimizer
    that is not built yet is built on ``model.trainable_variables`` first (what ``fit``
    would do), so that it has variables to fill.

    Raises:
        TrainingStateError: Something asked for is not in the checkpoint, or is malformed.
        KeyMismatchError, ShapeMismatchError: ``options.strict`` and the optimizer's
            variables do not match the saved state.
    """
    out = Prepared()
    if optimizer is None and not rng:
        return out
    training = _training.read_training(training_doc(ckpt, _KINDS), ckpt.path)
    needed: list[str] = []
    if optimizer is not None:
        assignments = _optimizer_values(
            ckpt, model, optimizer, training, plan, options, out, needed
        )
        out.steps.append(lambda: _assign(assignments))
    if rng:
        _prepare_rng(ckpt, model, training, out, needed)
    if options.verify:
        ckpt.verify(sorted(set(needed)))
    return out


def _assign(assignments: list[tuple[Any, Any]]) -> None:
    for var, value in assignments:
        var.assign(value)


def _optimizer_values(
    ckpt: Checkpoint,
    model: Any,
    optimizer: Any,
    training: Mapping[str, Any],
    plan: LoadPlan,
    options: LoadOptions,
    out: Prepared,
    needed: list[str],
) -> list[tuple[Any, Any]]:
    """``(optimizer variable, value)`` for every slot, the learning rate and the step."""
    label = type(optimizer).__name__
    saved = _training.read_optimizer(training, lambda n: _stored(ckpt, n) is not None, ckpt.path)
    check_optimizer_class(ckpt.path, saved.cls, label)
    iterations = training["optimizer"].get("iterations")
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 0:
        raise TrainingStateError(f"{ckpt.path}: the optimizer's iterations are malformed")
    _check_learning_rate(ckpt.path, saved.groups[0].hyper if saved.groups else {}, label)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    variables = list(optimizer._trainable_variables)
    members = _members(model, variables, label)
    rename = _rename(options.rules, plan.report.renamed)
    fill = _training.plan_optimizer(
        saved, [members], rename, strict=options.strict, where=ckpt.path, label=label
    )
    out.optimizer = fill.report
    # Read every tensor now: the file may be closed, and nothing may fail, once applying.
    owned = slots(optimizer)
    assignments: list[tuple[Any, Any]] = []
    for (_, pi), disk in sorted(fill.fill.items()):
        mine = owned[id(variables[pi])]
        rec = saved.params[disk]
        if set(rec.tensors) != set(mine):
            raise TrainingStateError(
                f"{ckpt.path}: the saved state of {disk!r} has slots {sorted(rec.tensors)}, "
                f"but this {label} keeps {sorted(mine)} for {members[pi][0][0]!r}; build the "
                "optimizer with the saved run's options (see its get_config())"
            )
        for slot, stored in rec.tensors.items():
            what = f"optimizer slot {slot!r} of {disk!r}"
            assignments.append((mine[slot], _read(ckpt, stored, mine[slot], needed, what)))
    hyper = saved.groups[0].hyper if saved.groups else {}
    if not _same_config(optimizer, hyper):
        fill.report.groups_kept.append(0)
    return assignments + _schedule_values(optimizer, hyper, iterations)


def _check_learning_rate(where: str, hyper: Mapping[str, Any], label: str) -> None:
    """Refuse a saved configuration whose learning rate could not be restored.

    Raises:
        FormatError: It lacks ``learning_rate``, or holds neither a number nor a
            schedule's configuration there.
    """
    refuse(where, "optimizer", label, keras_group_problems(hyper, "hyperparameter", label))


def _same_config(optimizer: Any, hyper: Mapping[str, Any]) -> bool:
    """Whether ``optimizer``'s configuration, learning rate aside, is the saved one."""
    config = {k: v for k, v in optimizer.get_config().items() if k not in _NOT_HYPER}
    mine = {
        k: _codec.decode(_codec.encode(v, k), k) for k, v in config.items() if k != "learning_rate"
    }
    return {k: v for k, v in hyper.items() if k != "learning_rate"} == mine


def _schedule_values(
    optimizer: Any, hyper: Mapping[str, Any], iterations: int
) -> list[tuple[Any, Any]]:
    """The saved learning rate (where the optimizer keeps one variable) and step."""
    out: list[tuple[Any, Any]] = []
    lr = hyper.get("learning_rate")
    lr_var = optimizer._learning_rate
    if isinstance(lr_var, keras.Variable) and isinstance(lr, (int, float)):
        out.append((lr_var, np.asarray(lr, dtype=np.dtype(str(lr_var.dtype)))))
    step = np.asarray(iterations, dtype=np.dtype(str(optimizer._iterations.dtype)))
    out.append((optimizer._iterations, step))
    return out


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
    out.steps.insert(0, lambda: _assign(assignments))
