"""PyTorch's side of a training checkpoint: optimizer, LR scheduler and RNG state.

The layout and the matching by name are framework-free (:mod:`weightvault._training`);
this module reads them out of ``torch.optim`` objects and writes them back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import wait
from typing import Any

import torch
from torch import nn

from .. import _training
from .._base.errors import TrainingStateError
from .._base.pools import LazyPool
from .._base.snapshots import SnapshotPool
from .._file import layout
from .._file.checkpoint import Checkpoint
from .._file.layout import RNG_PREFIX
from .._file.sharing import Source
from .._load.plan import LoadOptions, LoadPlan
from .._load.resume import check_optimizer_class, training_doc
from .._training import codec as _codec
from .._training.expect import Expect, keys_problems, param_problems, refuse
from .._training.optimizer import SavedOptimizer, SavedParam
from .._training.state import Prepared, rename_for as _rename, stored_name as _stored
from .expect import NOT_HYPER as _NOT_HYPER, group_needs, param_expectations, scheduler_reference
from .tensors import _dtype_name, bytes_reader, stored_tensor
from .wrappers import unwrap

Optimizer = torch.optim.Optimizer
Scheduler = Any  # torch.optim.lr_scheduler.LRScheduler, or anything with state_dict()

#: The training state torch saves beside the weights.
_KINDS = ("optimizer", "scheduler", "rng")


def _param_names(obj: nn.Module | Mapping[str, torch.Tensor]) -> dict[int, list[str]]:
    """Every name of every parameter, by object id, in model order (a tie has several).

    A wrapped model's parameters are named as the model inside names them.
    """
    obj = unwrap(obj)
    items = (
        obj.named_parameters(remove_duplicate=False)
        if isinstance(obj, nn.Module)
        else ((n, t) for n, t in obj.items() if isinstance(t, torch.Tensor))
    )
    out: dict[int, list[str]] = {}
    for name, p in items:
        out.setdefault(id(p), []).append(name)
    return out


def _private_copy(t: torch.Tensor, pool: SnapshotPool | None) -> torch.Tensor:
    """A copy of ``t``, into a buffer of the previous snapshot when there is one, made by
    the save's thread when the pool defers (optimizer state changes only in a step, and
    steps wait for it: see staging.py)."""
    if pool is None:
        return t.clone()
    key = ("tensor", str(t.device), t.dtype, tuple(t.shape))
    if t.device.type != "cpu":  # a GPU copy is queued on the device at once anyway
        return pool.copy(key, t.clone, lambda buffer: buffer.copy_(t))  # type: ignore[no-any-return]
    return pool.later(  # type: ignore[no-any-return]
        key, lambda: torch.empty_like(t), lambda buffer: buffer.copy_(t)
    )


def _tensor_source(name: str, t: torch.Tensor, snapshot: bool | SnapshotPool) -> Source:
    if snapshot:
        t = _private_copy(t.detach(), snapshot if isinstance(snapshot, SnapshotPool) else None)
    # No storage key: optimizer state is stored whole, never as a view of something else.
    return Source(name, _dtype_name(name, t), tuple(t.shape), ("train", name), bytes_reader(t))


def training_sources(
    obj: nn.Module | Mapping[str, torch.Tensor],
    *,
    optimizer: Optimizer | None,
    scheduler: Scheduler | None,
    rng: bool,
    snapshot: bool | SnapshotPool,
) -> tuple[list[Source], dict[str, Any] | None]:
    """The tensors and the manifest section that record the training state.

    With ``snapshot``, every tensor is copied now, so the caller may change the live
    ones while a background save writes.

    Raises:
        TrainingStateError: The optimizer holds a parameter the model does not have.
        UnsupportedStateError: A value has no JSON or tensor form.
    """
    if optimizer is None and scheduler is None and not rng:
        return [], None
    sources: list[Source] = []
    doc: dict[str, Any] = {"version": layout.VERSION}
    if optimizer is not None:
        doc["optimizer"] = _optimizer_section(obj, optimizer, snapshot, sources)
    if scheduler is not None:
        label = type(scheduler).__name__
        state = scheduler.state_dict()
        doc["scheduler"] = {
            "class": label,
            "state": {k: _codec.encode(v, f"{label} state {k!r}") for k, v in state.items()},
        }
    if rng:
        doc["rng"] = _rng_section(sources)
    return sources, doc


def _groups(
    obj: nn.Module | Mapping[str, torch.Tensor], optimizer: Optimizer
) -> list[list[tuple[list[str], torch.Tensor]]]:
    """Each of the optimizer's groups as ``(every model name, parameter)`` pairs.

    Raises:
        TrainingStateError: A parameter is not the model's, so it has no name.
    """
    names = _param_names(obj)
    label = type(optimizer).__name__
    obj = unwrap(obj)
    owner = type(obj).__name__ if isinstance(obj, nn.Module) else "the model"
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise TrainingStateError(
                    f"{label} group {gi} holds a parameter of shape {list(p.shape)} that "
                    f"{owner} does not have, so its state has no name to be saved or found "
                    "under; build the optimizer from the model's parameters"
                )
        out.append([(names[id(p)], p) for p in group["params"]])
    return out


def _optimizer_section(
    obj: nn.Module | Mapping[str, torch.Tensor],
    optimizer: Optimizer,
    snapshot: bool | SnapshotPool,
    sources: list[Source],
) -> dict[str, Any]:
    """The optimizer section; its state tensors are added to ``sources``."""
    groups = []
    params: dict[str, tuple[Any, dict[str, str], dict[str, Any]]] = {}
    for group, members in zip(optimizer.param_groups, _groups(obj, optimizer), strict=True):
        for names, p in members:
            tensors: dict[str, str] = {}
            values: dict[str, Any] = {}
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    stored = layout.state_name(names[0], str(key))
                    sources.append(_tensor_source(stored, value, snapshot))
                    tensors[str(key)] = stored
                else:
                    values[str(key)] = value
            params[names[0]] = (list(p.shape), tensors, values)
        hyper = {k: v for k, v in group.items() if k not in _NOT_HYPER}
        groups.append((hyper, [names[0] for names, _ in members]))
    return _training.encode_optimizer(type(optimizer).__name__, groups, params)


def _rng_section(sources: list[Source]) -> dict[str, Any]:
    """The RNG section; the torch CPU and CUDA states are added to ``sources``."""
    r: dict[str, Any] = {"python": _training.python_rng(), "numpy": _training.numpy_rng()}
    r["torch"] = RNG_PREFIX + "torch"
    sources.append(_tensor_source(r["torch"], torch.get_rng_state(), False))
    if torch.cuda.is_available():
        r["cuda"] = []
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            r["cuda"].append(f"{RNG_PREFIX}cuda/{i}")
            sources.append(_tensor_source(r["cuda"][-1], state, False))
    return r


def _read(ckpt: Checkpoint, name: str) -> torch.Tensor:
    """A tensor of its own (a private copy read from the file, never its mapping) for a
    stored training-state name."""
    return stored_tensor(ckpt, _stored_of(ckpt, name), mmap=False)


def _stored_of(ckpt: Checkpoint, name: str) -> str:
    stored = _stored(ckpt, name)
    assert stored is not None  # checked by _known before anything is read
    return stored


def _read_all(ckpt: Checkpoint, names: list[str]) -> list[torch.Tensor]:
    """:func:`_read` of each name: tensors of :data:`_THREADED` bytes or more on the
    reader threads (reads and decoding release the GIL; an optimizer's state is most of a
    checkpoint's bytes), the smaller ones meanwhile on the calling thread.

    Handing a small tensor to a thread costs more than reading it: on the 13 MB GPT-2
    of docs/benchmarks-log.md (section 21), whose 156 AdamW tensors are all 1 MiB or less,
    a resume took 20.6 ms with only the 1 MiB ones on the threads against 22.5 ms with
    every one there (34 against 42 ms from a compressed vault); thresholds of 128 and
    256 KiB were slower than 1 MiB, compressed or not.
    """
    stored = [_stored_of(ckpt, n) for n in names]
    pending = {
        i: _state_readers().submit(stored_tensor, ckpt, s, mmap=False)
        for i, s in enumerate(stored)
        if ckpt.stored[s].nbytes >= _THREADED
    }
    try:
        small = {
            i: stored_tensor(ckpt, s, mmap=False) for i, s in enumerate(stored) if i not in pending
        }
    finally:
        wait(pending.values())  # even after a failure: no thread reads on once it returns
    return [small[i] if i in small else pending[i].result() for i in range(len(names))]


#: Training-state tensors of at least this many bytes are read on the reader threads.
_THREADED = 1 << 20


#: The threads that read optimizer state, kept between loads.
_state_readers = LazyPool(min(4, os.cpu_count() or 1), "weightvault-state")


def _known(ckpt: Checkpoint) -> Callable[[str], bool]:
    return lambda n: _stored(ckpt, n) is not None


def prepare(
    ckpt: Checkpoint,
    model: nn.Module,
    plan: LoadPlan,
    options: LoadOptions,
    *,
    optimizer: Optimizer | None,
    scheduler: Scheduler | None,
    rng: bool,
) -> Prepared:
    """Check and read everything now, so that applying it cannot fail half-way.

    ``plan`` is the weights' load plan: optimizer state follows its renames.

    Raises:
        TrainingStateError: Something asked for is not in the checkpoint, or is malformed.
        KeyMismatchError, ShapeMismatchError: ``options.strict`` and the optimizer's
            parameters do not match the saved state.
    """
    out = Prepared()
    if optimizer is None and scheduler is None and not rng:
        return out
    training = _training.read_training(training_doc(ckpt, _KINDS), ckpt.path)
    needed: list[str] = []
    if optimizer is not None:
        load = _prepare_optimizer(ckpt, model, optimizer, training, plan, options, out, needed)
        out.steps.append(load)
    if scheduler is not None:
        out.steps.append(_prepare_scheduler(scheduler, training, ckpt.path))
        out.restored.append("scheduler")
    if rng:
        _prepare_rng(ckpt, training, out, needed)
    if options.verify:
        ckpt.verify(sorted({ckpt.manifest.copies.get(n, n) for n in needed}))
    return out


def _prepare_optimizer(
    ckpt: Checkpoint,
    model: nn.Module,
    optimizer: Optimizer,
    training: Mapping[str, Any],
    plan: LoadPlan,
    options: LoadOptions,
    out: Prepared,
    needed: list[str],
) -> Callable[[], None]:
    label = type(optimizer).__name__
    saved = _training.read_optimizer(training, _known(ckpt), ckpt.path)
    check_optimizer_class(ckpt.path, saved.cls, label)
    groups = [[(n, tuple(p.shape)) for n, p in members] for members in _groups(model, optimizer)]
    rename = _rename(options.rules, plan.report.renamed)
    fill = _training.plan_optimizer(
        saved, groups, rename, strict=options.strict, where=ckpt.path, label=label
    )
    out.optimizer = fill.report
    # Checked against what the class needs before torch sees it (_torch/expect.py), so
    # applying can neither raise torch's own KeyError nor leave the optimizer half-loaded.
    problems = _group_problems(saved, optimizer, label)
    # Read every tensor now: the file may be closed, and nothing may fail, once applying.
    state_dict: dict[str, Any] = {"state": {}, "param_groups": []}
    reads: list[tuple[int, str, str]] = []  # (state index, key, stored name)
    index = 0
    for gi, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        source = fill.hyper_from[gi]
        if source is not None:
            hyper.update(saved.groups[source].hyper)
        hyper["params"] = list(range(index, index + len(group["params"])))
        expect = param_expectations(optimizer, hyper)
        for pi in range(len(group["params"])):
            disk = fill.fill.get((gi, pi))
            if disk is not None:
                rec = saved.params[disk]
                expected = expect(group["params"][pi])
                problems += _state_problems(ckpt, disk, rec, expected, label)
                state_dict["state"][index + pi] = dict(rec.values)
                reads += [(index + pi, k, t) for k, t in rec.tensors.items()]
                needed += rec.tensors.values()
        index += len(group["params"])
        state_dict["param_groups"].append(hyper)
    refuse(ckpt.path, "optimizer", label, problems)
    for (i, key, _), tensor in zip(reads, _read_all(ckpt, [t for *_, t in reads]), strict=True):
        state_dict["state"][i][key] = tensor
    return lambda: optimizer.load_state_dict(state_dict)


def _group_problems(saved: SavedOptimizer, optimizer: Optimizer, label: str) -> list[str]:
    """What each saved group lacks of the hyperparameters ``optimizer`` needs."""
    required, reference = group_needs(optimizer)
    return [
        p
        for gi, g in enumerate(saved.groups)
        for p in keys_problems(g.hyper, required, reference, f"group {gi} hyperparameter", label)
    ]


def _state_problems(
    ckpt: Checkpoint, disk: str, rec: SavedParam, expected: Mapping[str, Expect] | None, label: str
) -> list[str]:
    """What saved parameter ``disk`` lacks of the state its parameter needs (``expected``)."""
    if expected is None:
        return []
    shapes = {k: tuple(ckpt.stored[_stored_of(ckpt, t)].shape) for k, t in rec.tensors.items()}
    return param_problems(disk, shapes, rec.values, rec.shape, expected, label)


def _prepare_scheduler(
    scheduler: Scheduler, training: Mapping[str, Any], where: str
) -> Callable[[], None]:
    doc = training.get("scheduler")
    label = type(scheduler).__name__
    if not isinstance(doc, dict) or not isinstance(doc.get("state"), dict):
        raise TrainingStateError(
            f"{where} holds no scheduler state; it was saved without scheduler=..., so load "
            "without scheduler="
        )
    if doc.get("class") != label:
        raise TrainingStateError(
            f"{where} holds the state of a {str(doc.get('class'))[:40]} scheduler, which a "
            f"{label} cannot take; build a {str(doc.get('class'))[:40]} to resume"
        )
    state = {k: _codec.decode(v, where) for k, v in doc["state"].items()}
    reference = scheduler_reference(scheduler)
    problems = keys_problems(state, list(reference), reference, "state key", label)
    refuse(where, "scheduler", label, problems)
    return lambda: scheduler.load_state_dict(state)


def _prepare_rng(
    ckpt: Checkpoint, training: Mapping[str, Any], out: Prepared, needed: list[str]
) -> None:
    where = ckpt.path
    doc = _training.prepare_host_rng(training, where, out)
    cpu = _rng_tensor(ckpt, doc.get("torch"), torch.get_rng_state(), needed)
    out.steps.append(lambda: torch.set_rng_state(cpu))
    out.restored.append("rng:torch")
    cuda = doc.get("cuda") or []
    if cuda and torch.cuda.is_available():
        current = torch.cuda.get_rng_state_all()
        if len(cuda) != len(current):
            raise TrainingStateError(
                f"{where} holds RNG states of {len(cuda)} CUDA devices, but {len(current)} are "
                "visible; make as many visible (CUDA_VISIBLE_DEVICES) to resume exactly"
            )
        states = [_rng_tensor(ckpt, n, c, needed) for n, c in zip(cuda, current, strict=True)]
        out.steps.append(lambda: torch.cuda.set_rng_state_all(states))
        out.restored.append("rng:cuda")


def _rng_tensor(ckpt: Checkpoint, name: Any, like: torch.Tensor, needed: list[str]) -> torch.Tensor:
    where = ckpt.path
    if not isinstance(name, str) or not _known(ckpt)(name):
        raise TrainingStateError(f"{where}: the saved torch RNG state is missing")
    t = _read(ckpt, name)
    if t.dtype != like.dtype or t.shape != like.shape:
        raise TrainingStateError(
            f"{where}: the saved torch RNG state {name!r} is {t.dtype}{list(t.shape)}, but "
            f"this torch expects {like.dtype}{list(like.shape)}; resume with the torch build "
            "that saved it, or load without rng="
        )
    needed.append(name)
    return t
