"""Why a strict load failed, and the one rename rule that would fix it.

A step of the load plan (:func:`weightvault._load.plan.plan_load`): when names or shapes
disagree, the error lists what differs (capped), names the closest name on disk for each
missing one, and proposes a ``rules=[...]`` fix only if that fix is certain to load what
it renames (:func:`propose_rule`).

Example:
    >>> propose_rule(["encoder.w"], ["enc.w"], {"encoder.w": "enc.w"})
    (('enc.*', 'encoder.*'), ['encoder.w'])
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence

from .._base.errors import EVIDENCE_CAP, KeyMismatchError, ShapeMismatchError, capped
from .._base.reports import LoadReport
from .._file.checkpoint import Checkpoint
from . import rules as _rules

#: ``fits(name_on_disk, model_name)``: whether the one could fill the other.
Fits = Callable[[str, str], bool]


def raise_if_mismatched(
    ckpt: Checkpoint, report: LoadReport, label: str, fits: Fits | None = None
) -> None:
    """Raise if ``report`` lists a mismatched, missing or unexpected name.

    Raises:
        ShapeMismatchError: A shape or dtype differs (the fix says whether ``cast`` helps).
        KeyMismatchError: Names are missing or unexpected; the message proposes a rule.
    """
    if report.mismatched:
        _raise_shapes(ckpt, report, label)
    if report.missing or report.unexpected:
        _raise_keys(ckpt, report, label, fits)


def _raise_shapes(ckpt: Checkpoint, report: LoadReport, label: str) -> None:
    lines = [
        f"    {n}: {disk} on disk, {mine} in the model"
        for n, disk, mine in report.mismatched[:EVIDENCE_CAP]
    ]
    dtype_only = all(d.split("[")[1] == m.split("[")[1] for _, d, m in report.mismatched)
    fix = (
        "Pass cast=True to convert dtypes on load."
        if dtype_only
        else "Check that the model was built with the same config, or drop these "
        "names with a rule such as (name, None) and strict=False."
    )
    msg = (
        f"Cannot load {ckpt.path!r} into {label}: {len(report.mismatched)} "
        "tensor(s) differ in shape or dtype.\n" + "\n".join(lines) + f"\n{fix}"
    )
    raise ShapeMismatchError(msg, report.mismatched)


def _raise_keys(ckpt: Checkpoint, report: LoadReport, label: str, fits: Fits | None) -> None:
    suggestions: dict[str, str] = {}
    for name in report.missing:
        close = difflib.get_close_matches(name, report.unexpected, n=1, cutoff=0.6)
        if close:
            suggestions[name] = close[0]
    rule, fixes = propose_rule(
        report.missing,
        report.unexpected,
        suggestions,
        fits=fits,
        loaded=report.loaded,
        aliases=_aliases(ckpt, report),
    )
    missing = [
        f"{n} (did you mean {suggestions[n]!r}?)" if n in suggestions else n for n in report.missing
    ]
    lines = [
        f"Cannot load {ckpt.path!r} into {label}: {len(report.missing)} missing, "
        f"{len(report.unexpected)} unexpected."
    ]
    if missing:
        lines.append(f"    Missing key(s):    {capped(missing)}")
    if report.unexpected:
        lines.append(f"    Unexpected key(s): {capped(report.unexpected)}")
    lines.append(_fix(rule, len(fixes), len(report.missing)))
    raise KeyMismatchError(
        "\n".join(lines),
        missing=report.missing,
        unexpected=report.unexpected,
        suggestions=suggestions,
        rule=rule,
        rule_fixes=fixes,
    )


def _aliases(ckpt: Checkpoint, report: LoadReport) -> list[tuple[str, str]]:
    """``(alias, unexpected)`` for the other names of each tensor ``report.unexpected``
    lists, as the rules named them.

    A report lists one name per unused tensor, but a rule renames its aliases too: the
    tied ``lm_head.weight`` of ``wte.weight`` is fixed by the rule that fixes the latter.
    """
    new_of = dict(report.renamed)
    old_of = {new: old for old, new in report.renamed}
    names_of: dict[str, list[str]] = {}
    for name in ckpt.names:
        names_of.setdefault(ckpt.entry(name).group, []).append(name)
    out: list[tuple[str, str]] = []
    for name in report.unexpected:
        old = old_of.get(name, name)
        if old in ckpt.entries:
            group = names_of[ckpt.entry(old).group]
            out += [(new_of.get(a, a), name) for a in group if a != old]
    return out


def _fix(rule: tuple[str, str] | None, fixed: int, missing: int) -> str:
    """The last line of a key mismatch: the rule to pass, if one is certain."""
    if rule is None:
        return "Pass rules=... to rename names, or strict=False to load what matches."
    if fixed < missing:
        return (
            f"Pass rules=[{rule!r}] to rename {fixed} of the {missing} missing names (a "
            "partial fix: the others need rules of their own), or strict=False to load "
            "what matches."
        )
    return f"Pass rules=[{rule!r}] to rename, or strict=False to load what matches."


def _candidate(unexpected: str, missing: str) -> tuple[str, str]:
    u, m = unexpected.split("."), missing.split(".")
    p = 0
    while p < min(len(u), len(m)) and u[p] == m[p]:
        p += 1
    s = 0
    while s < min(len(u), len(m)) - p and u[-1 - s] == m[-1 - s]:
        s += 1
    u_mid, m_mid = u[p : len(u) - s], m[p : len(m) - s]
    head = ".".join(u[:p])
    if s:
        pat = ".".join([*u[:p], *u_mid, "*"])
        rep = ".".join([*m[:p], *m_mid, "*"])
        return pat, rep
    if head:
        return ".".join(["*", *u_mid]), ".".join(["*", *m_mid])
    return unexpected, missing


def propose_rule(
    missing: list[str],
    unexpected: list[str],
    suggestions: dict[str, str],
    *,
    fits: Fits | None = None,
    loaded: Sequence[str] = (),
    aliases: Sequence[tuple[str, str]] = (),
) -> tuple[tuple[str, str] | None, list[str]]:
    """The single rename rule that fixes the most missing names, and the names it fixes.

    A candidate is kept only if every name it renames lands on a missing name it can fill
    (``fits(disk_name, model_name)``, by dtype and shape), no two land on one, and it
    renames no name that already loads: a proposed rule never claims a fix it does not
    make. It may fix only some of the missing names; the caller says so. ``aliases`` pairs
    the other names on disk of the ``unexpected`` tensors with the name listed: a missing
    name the rule renames one of them to is fixed too, as the tied ``lm_head.weight`` is.
    """
    want = set(missing)
    pairs = list(suggestions.items()) or (
        [(missing[0], unexpected[0])] if len(missing) == len(unexpected) == 1 else []
    )
    best: tuple[tuple[str, str], list[str]] | None = None
    for m, u in pairs:
        cand = _candidate(u, m)
        if any(_rules.apply([cand], n)[1] is not None for n in loaded):
            continue
        claimed = [n for n in unexpected if _rules.apply([cand], n)[1] is not None]
        fixed = [
            new
            for n in claimed
            if (new := _rules.rename([cand], n)) in want and (fits is None or fits(n, new))
        ]
        if not fixed or len(fixed) != len(claimed) or len(set(fixed)) != len(fixed):
            continue
        also = _alias_fixes(cand, aliases, want, set(loaded), fits)
        if also is None:
            continue
        done = {*fixed, *also}
        if best is None or len(done) > len(best[1]):
            best = (cand, [n for n in missing if n in done])
    return (None, []) if best is None else best


def _alias_fixes(
    rule: tuple[str, str],
    aliases: Sequence[tuple[str, str]],
    want: set[str],
    loaded: set[str],
    fits: Fits | None,
) -> list[str] | None:
    """The missing names ``rule`` renames an alias to; ``None`` if it renames one onto a
    name that loads already or that the alias cannot fill."""
    out = []
    for name, listed in aliases:
        new, index = _rules.apply([rule], name)
        if index is None or new is None:
            continue
        # An alias is its listed name's tensor: what that one fits, it fits.
        if new in loaded or (new in want and fits is not None and not fits(listed, new)):
            return None
        if new in want:
            out.append(new)
    return out
