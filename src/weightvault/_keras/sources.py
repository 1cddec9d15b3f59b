"""A Keras model's (or a dict's) variables as sources to save: the save half of the adapter.

Every name of a variable becomes a :class:`~weightvault._file.sharing.Source` whose
identity is the ``Variable`` object, so a variable several layers hold is stored once and
its other names become aliases. A variable is frozen if an optimizer would not get it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from .._base.dtypes import ITEMSIZE, numpy_dtype
from .._file.arrays import array_bytes
from .._file.sharing import Source
from .._numpy.sources import Asked, Found, checkpoint_hook
from . import state as _keras_state
from .walk import Var, dtype_name, model_vars


def _bytes_of(value: Any, dtype: str) -> memoryview:
    """The bytes of a variable (or array) as ``dtype``, without a copy where possible."""
    raw = getattr(value, "value", value)  # a Variable's backend tensor
    if (
        type(raw).__module__.startswith("torch")
        and hasattr(raw, "untyped_storage")
        # Keras' torch backend holds some dtypes wider (uint16 and uint32 as int32): then
        # the tensor's bytes are not the declared dtype's, and numpy converts them.
        and raw.element_size() == ITEMSIZE[dtype]
    ):
        # KERAS_BACKEND=torch: hand out the tensor's own bytes; convert_to_numpy would
        # copy every variable (and widen bfloat16 to float32 and back).
        import torch

        t = raw.detach().cpu().contiguous()
        if t.numel() == 0:
            return memoryview(b"")
        return memoryview(t.reshape(-1).view(torch.uint8).numpy())
    arr = np.asarray(keras.ops.convert_to_numpy(value))
    return array_bytes(arr.astype(numpy_dtype(dtype), copy=False))


def _frozen_ids(model: Any, vs: list[Var]) -> set[int]:
    # What an optimizer would get decides; a non-trainable layer hides all its variables.
    live = {id(v) for v in model.trainable_variables}
    return {id(v.variable) for v in vs if v.is_param and id(v.variable) not in live}


def _source(name: str, value: Any, identity: int, dtype: str, frozen: bool) -> Source:
    shape = tuple(value.shape)
    return Source(name, dtype, shape, identity, lambda: _bytes_of(value, dtype), frozen=frozen)


def model_sources(obj: Any) -> tuple[list[Source], list[str]]:
    """Every named variable of a built model, or every value of a dict, as a source, and
    the names left out (none).

    Raises:
        TypeError: ``obj`` is neither a Keras layer nor a dict.
        ModelNotBuiltError: The model has no variables yet.
        UnsupportedDtypeError: A variable's dtype has no safetensors name.
    """
    out: list[Source] = []
    if isinstance(obj, Mapping):
        for name, value in obj.items():
            is_var = isinstance(value, keras.Variable)
            arr = value if is_var else np.asarray(value)
            dtype = dtype_name(name, value.dtype if is_var else arr.dtype)
            # The identity is the object passed: one array under two names is an alias.
            out.append(_source(name, arr, id(value), dtype, is_var and not value.trainable))
        return out, []
    vs = model_vars(obj, "save")
    frozen = _frozen_ids(obj, vs)
    for v in vs:
        var = v.variable
        dtype = dtype_name(v.name, var.dtype)
        out.append(_source(v.name, var, id(var), dtype, id(var) in frozen))
    return out, []


def _checkpoint_sources(obj: Any, asked: Asked) -> Found:
    """Model, optimizer and RNG as sources plus the manifest's training section.

    With ``snapshot`` (a background save), every variable that training can change (all
    but frozen ones; on JAX all) is copied now, so the save writes the values of the call.
    """
    optimizer, rng = asked.optimizer, asked.rng
    _keras_state.refuse_scheduler(asked.scheduler)
    sources, skipped = model_sources(obj)
    if asked.snapshot is not None:
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


#: The vault's ``checkpoint_sources(obj, *, optimizer, scheduler, rng, snapshot)``.
checkpoint_sources = checkpoint_hook(_checkpoint_sources)
