"""The one tagged-JSON codec: what it encodes comes back as it was, through real JSON text.

Optimizer and scheduler state, ``weightvault.dcp`` values and Lightning checkpoints all
go through :mod:`weightvault._training.codec`; the standard ``json`` module is the
oracle that the encoded form is plain JSON (``allow_nan=False``: no ``NaN`` tokens).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from weightvault import FormatError, UnsupportedStateError
from weightvault._training.codec import decode, encode

#: Strings that read like the codec's tags, as keys and values.
TAGGY = st.sampled_from(["$tuple", "$float", "$items", "$tensor", "__tuple__", "$", "$x"])
TEXT = st.text(max_size=6) | TAGGY
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
SCALARS = st.none() | st.booleans() | st.integers() | FLOATS | TEXT
#: Dict keys of every hashable kind; nan is left out, as no dict can find a nan key again.
KEYS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.tuples(inner) | st.tuples(inner, inner),
    max_leaves=4,
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(TEXT, inner, max_size=4)
        | st.dictionaries(KEYS, inner, max_size=4)
    ),
    max_leaves=20,
)
#: Any JSON document, as a damaged or hostile record may hold.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=15,
)


def same(a: Any, b: Any) -> bool:
    """Equal, of the same type all the way down; nan equals nan, and -0.0 is not 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        # Key order is kept too: an optimizer's state dict is read in order.
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    return bool(a == b)


def through_json(value: Any, **tensors: Any) -> Any:
    text = json.dumps(encode(value, "state"), allow_nan=False)
    return decode(json.loads(text), "state", tensors=tensors or None)


@settings(max_examples=300, deadline=None)
@given(VALUES)
def test_every_value_round_trips_through_json_text(value: Any) -> None:
    back = through_json(value)
    assert same(back, value), (value, back)


def test_the_types_json_lacks_come_back_as_they_were() -> None:
    value = {
        "betas": (0.9, 0.999),
        "best": float("-inf"),
        "nan": float("nan"),
        0: {"step": 3},
        (1, "a"): None,
        "$odd": {"$tensor": "not a tag"},
        "__tuple__": [1, 2],
    }
    back = through_json(value)
    assert same(back, value)
    assert back["betas"] == (0.9, 0.999) and isinstance(back["betas"], tuple)
    assert back["__tuple__"] == [1, 2]  # a key of that name is no tag


def test_tensors_are_stored_by_the_hook_and_found_again_by_name() -> None:
    class Tensor:  # any object the hook recognises
        pass

    a, b = Tensor(), Tensor()
    stored: dict[str, Any] = {}

    def hook(value: Any, where: str) -> str | None:
        if not isinstance(value, Tensor):
            return None
        stored[where] = value
        return where

    doc = encode({"w": a, "pair": (b, 1)}, "ckpt", tensor=hook)
    assert doc == {
        "w": {"$tensor": "ckpt['w']"},
        "pair": {"$tuple": [{"$tensor": "ckpt['pair'][0]"}, 1]},
    }
    back = decode(json.loads(json.dumps(doc)), "ckpt", tensors=stored)
    assert back["w"] is a and back["pair"][0] is b and back["pair"][1] == 1


def test_records_written_with_the_old_tuple_tag_still_decode() -> None:
    # weightvault.dcp wrote {"__tuple__": [...]} before the one codec.
    old = json.loads('{"betas": {"__tuple__": [0.9, 0.999]}, "x": [{"__tuple__": []}]}')
    assert same(decode(old, "record"), {"betas": (0.9, 0.999), "x": [()]})


@pytest.mark.parametrize(
    "doc",
    [
        {"$float": "1.5"},
        {"$float": 1.0},
        {"$tuple": 3},
        {"__tuple__": "abc"},
        {"$items": "x"},
        {"$items": [[1]]},
        {"$items": [[1, 2, 3]]},
        {"$items": [[[1], 2]]},  # a list cannot be a key
        {"$items": [[{"$tuple": [[1]]}, 2]]},  # nor a tuple holding one
        {"$tensor": "w"},  # no tensors given
        {"$tensor": ["w"]},
        {"$tuple": [1], "x": 2},
        {"$unknown": 1},
        [{"ok": {"$what": 0}}],
    ],
)
def test_malformed_tags_are_a_format_error(doc: Any) -> None:
    with pytest.raises(FormatError, match="record"):
        decode(doc, "record")


def test_a_tensor_name_not_among_the_tensors_is_a_format_error() -> None:
    with pytest.raises(FormatError):
        decode({"$tensor": "missing"}, "record", tensors={"w": object()})


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_any_json_decodes_or_is_a_format_error(doc: Any) -> None:
    """Never another exception; and JSON with no tag-like key is its own decoding."""
    try:
        back = decode(doc, "record")
    except FormatError:
        assert not untagged(doc)
    else:
        if untagged(doc):
            assert same(back, doc)


def untagged(doc: Any) -> bool:
    if isinstance(doc, list):
        return all(untagged(v) for v in doc)
    if isinstance(doc, dict):
        return all(
            not k.startswith("$") and k != "__tuple__" and untagged(v) for k, v in doc.items()
        )
    return True


def test_a_value_without_json_form_is_refused_where_it_was_found() -> None:
    with pytest.raises(UnsupportedStateError, match=r"state\['a'\]\[1\] is a object") as e:
        encode({"a": [1, object()]}, "state", hint="Drop it before saving")
    assert isinstance(e.value, TypeError)
    assert str(e.value).endswith("Drop it before saving")
    with pytest.raises(UnsupportedStateError, match="key"):
        encode({frozenset(): 1}, "state")
