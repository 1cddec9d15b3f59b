"""Which of a Keras model's variables train: frozen flags on variables and layers.

Shared by ``freeze``/``unfreeze`` and by ``load(restore_frozen=True)``. Keras keeps the
flag on the variable, and a layer's ``trainable`` setter rewrites the flags of all its
variables, so layers are set first and variables last.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .._load import rules as _rules
from .internals import sublayers
from .walk import Var, model_vars


def set_trainable(model: Any, vs: list[Var], chosen: set[int], frozen: set[int]) -> None:
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


def select(model: Any, patterns: Iterable[str], verb: str) -> tuple[list[Var], list[Var]]:
    """The chosen parameters (every name) and all of the model's names."""
    vs = model_vars(model, verb)
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


def restore_flags(model: Any, vs: list[Var], frozen: dict[str, bool]) -> None:
    """Set the flags of the loaded variables to the file's (``{name: frozen}``)."""
    ids = {v.name: id(v.variable) for v in vs}
    chosen = {ids[n] for n in frozen}
    set_trainable(model, vs, chosen, {ids[n] for n, f in frozen.items() if f})
