"""Rename rules: ordered ``(pattern, replacement)`` pairs applied to names on disk.

Each ``*`` in a pattern captures any run of characters, dots included, and the captures
fill the ``*`` of the replacement in order. A replacement of ``None`` drops the name. The
first rule that matches wins; a name no rule matches keeps its name.

Example:
    >>> rename([("h.*", "transformer.h.*"), ("*.attn.bias", None)], "h.0.mlp.c_fc.weight")
    'transformer.h.0.mlp.c_fc.weight'
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

from .._base.errors import RuleError

Rule = tuple[str, str | None]
Rules = Sequence[Rule]


@lru_cache(maxsize=1024)
def _regex(pattern: str) -> re.Pattern[str]:
    # Lazy captures make "a.*.b" split the same way however many dots follow.
    return re.compile("^" + "(.*?)".join(re.escape(p) for p in pattern.split("*")) + "$")


def check(rules: Iterable[object]) -> list[Rule]:
    """Validate ``rules`` and return them as a list of pairs.

    Raises:
        RuleError: A rule is not a ``(str, str | None)`` pair, or its replacement has more
            ``*`` than its pattern can fill.
    """
    out: list[Rule] = []
    for i, rule in enumerate(rules):
        if (
            not isinstance(rule, tuple | list)
            or len(rule) != 2
            or not isinstance(rule[0], str)
            or not (rule[1] is None or isinstance(rule[1], str))
        ):
            raise RuleError(
                f"rule {i} is {rule!r}; a rule is a (pattern, replacement) pair such as "
                '("h.*", "transformer.h.*"), or (pattern, None) to drop names'
            )
        pattern, replacement = rule[0], rule[1]
        if replacement is not None and replacement.count("*") > pattern.count("*"):
            raise RuleError(
                f"rule {i} ({pattern!r} -> {replacement!r}) has more '*' on the right than "
                "the pattern captures; add a '*' to the pattern or remove one from the right"
            )
        out.append((pattern, replacement))
    return out


def match(pattern: str, name: str) -> tuple[str, ...] | None:
    """The captures of ``pattern`` in ``name``, or ``None`` if it does not match."""
    m = _regex(pattern).match(name)
    return None if m is None else m.groups()


def _fill(replacement: str, captures: tuple[str, ...]) -> str:
    parts = replacement.split("*")
    out = parts[0]
    for capture, part in zip(captures, parts[1:], strict=False):
        out += capture + part
    return out


def apply(rules: Rules, name: str) -> tuple[str | None, int | None]:
    """Rename ``name``: the new name (``None`` if dropped) and the index of the rule used."""
    for i, (pattern, replacement) in enumerate(rules):
        captures = match(pattern, name)
        if captures is not None:
            return (None if replacement is None else _fill(replacement, captures)), i
    return name, None


def rename(rules: Rules, name: str) -> str | None:
    """The name ``name`` gets under ``rules``, or ``None`` if a rule drops it."""
    return apply(rules, name)[0]


def explain(rules: Rules, names: Iterable[str]) -> list[tuple[str, str | None, int | None]]:
    """``(old, new, rule_index)`` for every name; ``rule_index`` is ``None`` if none matched."""
    rules = check(rules)
    return [(n, *apply(rules, n)) for n in names]


def invert(rules: Rules) -> list[Rule]:
    """Rules that undo ``rules`` (each must be a rename with as many ``*`` on both sides).

    Raises:
        RuleError: A rule drops names or reorders captures, so it has no inverse.
    """
    out: list[Rule] = []
    for pattern, replacement in check(rules):
        if replacement is None or replacement.count("*") != pattern.count("*"):
            raise RuleError(
                f"rule ({pattern!r} -> {replacement!r}) cannot be inverted: it drops names or "
                "discards a capture; write the reverse rules by hand"
            )
        out.append((replacement, pattern))
    return out


def glob(patterns: Iterable[str], names: Iterable[str]) -> list[str]:
    """Names (in their order) that match any of ``patterns``, where ``*`` matches anything."""
    pats = list(patterns)
    return [n for n in names if any(match(p, n) is not None for p in pats)]


def select(pattern: str, names: Sequence[str], sep: str) -> list[str]:
    """Names matching ``pattern``; a bare prefix (no ``*``) selects everything under it.

    Example:
        >>> select("encoder", ["encoder.w", "encoder.b", "head.w"], ".")
        ['encoder.w', 'encoder.b']
    """
    hits = glob([pattern], names)
    if not hits and "*" not in pattern:
        hits = glob([f"{pattern}{sep}*"], names)
    return hits


def unmatched(verb: str, pattern: str, candidates: Iterable[str], what: str, sep: str) -> RuleError:
    """The error for a pattern that selected nothing, with the nearest name as a hint."""
    close = difflib.get_close_matches(pattern, list(candidates), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return RuleError(
        f"{verb}(): pattern {pattern!r} matches no {what}.{hint} Use '*' to match any "
        f"characters, as in 'encoder{sep}*'."
    )


def choose(
    patterns: Iterable[str], names: Sequence[str], sep: str, verb: str, what: str
) -> set[str]:
    """The names any of ``patterns`` selects (see :func:`select`); all of them if none.

    Args:
        patterns: What the user passed to ``freeze``/``unfreeze``.
        names: The names to choose from.
        sep: The separator of the names (``"."`` or ``"/"``).
        verb: The caller, for the message (``"freeze"``).
        what: What a name is, for the message (``"parameter of Net"``).

    Raises:
        RuleError: A pattern selects nothing; the message names the closest name.

    Example:
        >>> sorted(choose(["enc"], ["enc.w", "enc.b", "head.w"], ".", "freeze", "name"))
        ['enc.b', 'enc.w']
    """
    chosen: set[str] = set()
    for pattern in list(patterns) or ["*"]:
        hits = select(pattern, names, sep)
        if not hits:
            raise unmatched(verb, pattern, names, what, sep)
        chosen.update(hits)
    return chosen
