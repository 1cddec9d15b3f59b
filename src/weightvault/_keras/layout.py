"""Keras' own ``.weights.h5`` layout of a model, recorded from Keras' own save walk.

``model.save_weights`` runs ``saving_lib._save_state``, which walks the model (layers,
then the optimizer and whatever else Keras saves, in Keras' order), opens a group per
saveable (``layers/dense/vars``, with the layer's ``name`` as an attribute) and hands
every value to a store. Here the store is a :class:`Layout` recorder: the same walk
runs, nothing is written, and :func:`weightvault.keras.save_weights` then writes the
recorded layout with each variable once. So the file's names and attributes are Keras'
by construction, whatever Keras version is installed.

The same recording tells which variables several layers hold (:func:`check`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import keras

from .._base.dtypes import ITEMSIZE, numel
from .._base.errors import UnsupportedValueError
from .._base.progress import human
from .internals import saving_lib, sublayers
from .walk import dtype_name, model_vars, require_built


@dataclass
class Layout:
    """What Keras' save walk would write.

    Attributes:
        groups: ``(path, attributes)`` of every group Keras creates, in its order.
        datasets: ``(path, value)`` of every dataset: a ``keras.Variable``, or the
            array a layer computes (a quantized or LoRA layer's merged kernel).
    """

    groups: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    datasets: list[tuple[str, Any]] = field(default_factory=list)

    def linked(self) -> list[tuple[str, Any, str | None]]:
        """``(path, value, first path)``: the first path of a variable written before
        under another path (the dataset to hard-link), else ``None``."""
        first: dict[int, str] = {}
        out: list[tuple[str, Any, str | None]] = []
        for path, value in self.datasets:
            earlier = None
            if isinstance(value, keras.Variable):
                earlier = first.setdefault(id(value), path)
            out.append((path, value, earlier if earlier != path else None))
        return out

    def paths_by_variable(self) -> dict[int, list[str]]:
        """``{id(variable): [every path Keras writes it under]}``, in the file's order."""
        out: dict[int, list[str]] = {}
        for path, value in self.datasets:
            if isinstance(value, keras.Variable):
                out.setdefault(id(value), []).append(path)
        return out


@functools.cache
def _recorder() -> type:
    """A subclass of Keras' ``H5IOStore`` that records instead of writing.

    Keras' walk checks that its store is an ``H5IOStore``; this one opens no file.
    """
    base: type = saving_lib("H5IOStore")

    class Recorder(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:  # no file: the base would open one
            self.layout = Layout()
            self._at = ""
            self._open = False

        def __bool__(self) -> bool:
            return True

        def make(self, path: str, metadata: Mapping[str, Any] | None = None) -> Any:
            self._at, self._open = path, False
            if metadata:  # Keras creates the group at once when it has attributes
                self._group(metadata)
            return self

        def _group(self, metadata: Mapping[str, Any] | None) -> None:
            group = f"{self._at}/vars" if self._at else "vars"
            self.layout.groups.append((group, dict(metadata or {})))
            self._open = True

        def __setitem__(self, key: str, value: Any) -> None:
            if not self._open:
                self._group(None)
            prefix = f"{self._at}/vars" if self._at else "vars"
            self.layout.datasets.append((f"{prefix}/{key}", value))

        def __contains__(self, key: object) -> bool:
            prefix = f"{self._at}/vars/" if self._at else "vars/"
            return any(p == f"{prefix}{key}" for p, _ in self.layout.datasets)

    return Recorder


def record(model: Any) -> Layout:
    """Run Keras' own save walk over a built ``model`` and return what it would write.

    Raises:
        ModelNotBuiltError: The model has no variables yet.
        KerasInternalsChanged: This Keras has no ``saving_lib`` walk weightvault knows.
    """
    require_built(model, "save_weights")
    store = _recorder()()
    save_state = saving_lib("_save_state")
    save_state(
        model, weights_store=store, assets_store=None, inner_path="", visited_saveables=set()
    )
    layout: Layout = store.layout
    return layout


def frozen_paths(model: Any, layout: Layout) -> list[str]:
    """Every dataset path of the parameters (variables created trainable) that an
    optimizer would not get: frozen, by their own flag or their layer's."""
    params = {id(v) for layer in [model, *sublayers(model)] for v in layer._trainable_variables}
    live = {id(v) for v in model.trainable_variables}
    return [
        path
        for path, value in layout.datasets
        if id(value) in params and id(value) not in live and isinstance(value, keras.Variable)
    ]


@dataclass(frozen=True)
class SharedVariable:
    """A variable that several layers hold, so Keras writes it once per layer.

    Attributes:
        names: Its weightvault names, one per layer that holds it.
        paths: The dataset paths Keras' ``save_weights`` writes it under, in order.
        dtype: Its safetensors dtype.
        shape: Its shape.
        nbytes: Its size.
    """

    names: tuple[str, ...]
    paths: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def extra_bytes(self) -> int:
        """What Keras writes again: every path after the first."""
        return self.nbytes * (len(self.paths) - 1)


@dataclass
class SharingReport:
    """What :func:`weightvault.keras.check` found.

    Attributes:
        shared: Every variable that Keras writes more than once, largest waste first.
    """

    shared: list[SharedVariable] = field(default_factory=list)

    @property
    def extra_bytes(self) -> int:
        """Bytes Keras' ``save_weights`` writes again; ``save_weights`` writes none."""
        return sum(s.extra_bytes for s in self.shared)

    @property
    def ok(self) -> bool:
        """Whether no variable is written twice."""
        return not self.shared

    def __str__(self) -> str:
        if not self.shared:
            return "no variable is held by several layers"
        lines = [
            f"{len(self.shared)} variable(s) held by several layers; Keras' save_weights "
            f"writes {human(self.extra_bytes)} again (weightvault.keras.save_weights: none)"
        ]
        for s in self.shared:
            lines.append(
                f"  {' = '.join(s.names)}: {s.dtype}{list(s.shape)}, written "
                f"{len(s.paths)} times (+{human(s.extra_bytes)})"
            )
        return "\n".join(lines)


def check(model: Any) -> SharingReport:
    """Every variable of ``model`` that Keras' ``save_weights`` would write several times."""
    layout = record(model)
    names: dict[int, list[str]] = {}
    try:
        for v in model_vars(model, "check"):
            names.setdefault(id(v.variable), []).append(v.name)
    except UnsupportedValueError:
        pass  # a layer saves a computed value (LoRA): weightvault names none, Keras paths do
    values = {id(v): v for _, v in layout.datasets}
    out = []
    for ident, paths in layout.paths_by_variable().items():
        if len(paths) < 2:
            continue
        var = values[ident]
        dtype = dtype_name(paths[0], var.dtype)
        shape = tuple(var.shape)
        nbytes = numel(shape) * ITEMSIZE[dtype]
        out.append(SharedVariable(tuple(names.get(ident, [])), tuple(paths), dtype, shape, nbytes))
    out.sort(key=lambda s: -s.extra_bytes)
    return SharingReport(out)
