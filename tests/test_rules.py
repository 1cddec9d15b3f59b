"""Rename rules: a pure core, so properties hold for any names."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from weightvault import RuleError
from weightvault.rules import explain, invert, rename

segment = st.text(alphabet="abcdefgh_0123", min_size=1, max_size=6)
names = st.lists(segment, min_size=1, max_size=5).map(".".join)


def test_captures_fill_in_order():
    assert rename([("h.*.attn.*", "blocks.*.a.*")], "h.3.attn.c.weight") == "blocks.3.a.c.weight"
    assert rename([("a.*", None)], "a.b") is None
    assert rename([("x.*", "y.*")], "z.w") == "z.w"


def test_first_matching_rule_wins():
    rules = [("a.*", "first.*"), ("a.b", "second")]
    assert explain(rules, ["a.b", "c"]) == [("a.b", "first.b", 0), ("c", "c", None)]


def test_dropping_rules_cannot_be_inverted():
    with pytest.raises(RuleError, match="cannot be inverted"):
        invert([("a.*", None)])


@given(prefix_a=segment, prefix_b=segment, name=names)
def test_invert_undoes_a_prefix_rename(prefix_a, prefix_b, name):
    rules = [(f"{prefix_a}.*", f"{prefix_b}.*")]
    original = f"{prefix_a}.{name}"
    renamed = rename(rules, original)
    assert renamed == f"{prefix_b}.{name}"
    assert rename(invert(rules), renamed) == original


@given(name=names)
def test_star_alone_is_identity(name):
    assert rename([("*", "*")], name) == name
