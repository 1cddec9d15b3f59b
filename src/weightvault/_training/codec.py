"""The one tagged-JSON codec for non-tensor state (optimizer values, schedulers, DCP values).

JSON lacks tuples, non-finite floats and dicts with non-string keys, so those are tagged;
everything else is plain JSON, readable by any tool:

* ``{"$tuple": [...]}``: a tuple (AdamW's ``betas`` comes back as the tuple it was);
* ``{"$float": "inf"}``: ``inf``, ``-inf`` or ``nan``;
* ``{"$items": [[key, value], ...]}``: a dict whose keys are not all plain strings (an
  optimizer's ``{0: {...}}``), or whose string keys would read as a tag;
* ``{"$tensor": "<name>"}``: a tensor stored beside the JSON, when the caller passes a
  ``tensor`` hook (Lightning checkpoints hold tensors inside their dicts).

Records written before this codec by ``weightvault.dcp`` tagged tuples ``{"__tuple__":
[...]}``; :func:`decode` still reads them.

Example:
    >>> doc = encode({"betas": (0.9, 0.999), "eps": float("inf"), 0: "x"}, "state")
    >>> decode(doc, "state") == {"betas": (0.9, 0.999), "eps": float("inf"), 0: "x"}
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from .._base.errors import FormatError, UnsupportedStateError

#: ``(value, where) -> stored name``, or ``None`` when ``value`` is no tensor.
TensorHook = Callable[[Any, str], "str | None"]

_LEGACY_TUPLE = "__tuple__"
_TAGS = ("$tuple", "$float", "$items", "$tensor")


def encode(value: Any, where: str, *, tensor: TensorHook | None = None, hint: str = "") -> Any:
    """``value`` as JSON, tagging what JSON lacks.

    Args:
        value: Numbers, strings, ``None``, lists, tuples and dicts of those (and tensors,
            when ``tensor`` is given).
        where: Where ``value`` was found, for the error (``"optimizer group 0 'lr'"``).
        tensor: Stores a tensor and returns the name it was stored under, or returns
            ``None`` for a value that is not a tensor.
        hint: The one fix to suggest when a value has no JSON form.

    Raises:
        UnsupportedStateError: A value has no JSON form (a function, an object), naming
            where it was found.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$float": repr(float(value))}
    if tensor is not None:
        name = tensor(value, where)
        if name is not None:
            return {"$tensor": name}
    if isinstance(value, tuple):
        return {
            "$tuple": [
                encode(v, f"{where}[{i}]", tensor=tensor, hint=hint) for i, v in enumerate(value)
            ]
        }
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]", tensor=tensor, hint=hint) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(_plain_key(k) for k in value):
            return {
                k: encode(v, f"{where}[{k!r}]", tensor=tensor, hint=hint) for k, v in value.items()
            }
        return {
            "$items": [
                [
                    encode(k, f"{where} key {k!r}", tensor=tensor, hint=hint),
                    encode(v, f"{where}[{k!r}]", tensor=tensor, hint=hint),
                ]
                for k, v in value.items()
            ]
        }
    raise UnsupportedStateError(
        f"{where} is a {type(value).__name__}, which has no JSON form; checkpoints hold "
        "numbers, strings, lists, tuples, dicts and tensors only (never pickle). "
        + (hint or "Keep such values out of the state, or rebuild them after loading")
    )


def decode(value: Any, where: str, *, tensors: Mapping[str, Any] | None = None) -> Any:
    """The inverse of :func:`encode`; also reads the older ``{"__tuple__": [...]}`` tag.

    Raises:
        FormatError: A tag is unknown or malformed, or names a tensor not in ``tensors``.
    """
    if isinstance(value, list):
        return [decode(v, where, tensors=tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag in ("$tuple", _LEGACY_TUPLE) and isinstance(inner, list):
            return tuple(decode(v, where, tensors=tensors) for v in inner)
        if tag == "$float" and inner in ("inf", "-inf", "nan"):
            return float(inner)
        if tag == "$items" and isinstance(inner, list):
            return _decode_items(inner, where, tensors)
        if tag == "$tensor" and tensors is not None and isinstance(inner, str) and inner in tensors:
            return tensors[inner]
    if any(not _plain_key(k) for k in value):
        raise FormatError(
            f"{where}: unknown or malformed tagged value {str(value)[:80]}; the checkpoint's "
            "state was damaged or written by a newer weightvault: upgrade weightvault"
        )
    return {k: decode(v, where, tensors=tensors) for k, v in value.items()}


def _plain_key(key: Any) -> bool:
    return isinstance(key, str) and not key.startswith("$") and key != _LEGACY_TUPLE


def _decode_items(items: list[Any], where: str, tensors: Mapping[str, Any] | None) -> Any:
    out = {}
    for pair in items:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise FormatError(
                f"{where}: a '$items' entry is not a [key, value] pair: {str(pair)[:80]}"
            )
        key = decode(pair[0], where, tensors=tensors)
        try:
            out[key] = decode(pair[1], where, tensors=tensors)
        except TypeError as e:  # an unhashable key, such as a list
            raise FormatError(
                f"{where}: a '$items' key {str(key)[:80]} cannot be a dict key"
            ) from e
    return out
