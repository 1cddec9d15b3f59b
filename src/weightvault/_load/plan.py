"""Decide, before anything is touched, which name on disk fills which tensor of a model.

This is the whole load policy, shared by every adapter. It works on names, identities,
dtypes and shapes only; the adapter then copies bytes as the returned plan says. Because
every check runs here first, a load that fails leaves the model exactly as it was.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .._base.dtypes import describe
from .._base.errors import (
    EVIDENCE_CAP,
    KeyMismatchError,
    RuleError,
    ShapeMismatchError,
    TieConflictError,
    capped,
)
from .._base.reports import LoadReport
from .._file.checkpoint import Checkpoint
from .._file.sharing import same_bytes
from . import rules as _rules

RulesArg = Sequence[_rules.Rule] | Literal["auto"]


@dataclass(frozen=True)
class Target:
    """One name of the model being loaded into."""

    name: str
    identity: Hashable
    dtype: str
    shape: tuple[int, ...]
    is_param: bool = True


@dataclass
class Assignment:
    """Fill the model tensor known by ``names`` from the name ``source`` on disk."""

    names: list[str]
    source: str
    cast: bool = False


@dataclass
class LoadPlan:
    assignments: list[Assignment] = field(default_factory=list)
    report: LoadReport = field(default_factory=lambda: LoadReport(""))
    frozen: dict[str, bool] = field(default_factory=dict)
    tie: list[tuple[str, ...]] = field(default_factory=list)


Equal = Callable[[str, str], bool]
Fits = Callable[[str, str], bool]


def plan_load(
    ckpt: Checkpoint,
    targets: Sequence[Target],
    *,
    rules: RulesArg = (),
    strict: bool = True,
    cast: bool = False,
    tie: bool = False,
    equal: Equal | None = None,
    label: str = "model",
    shape_of: Callable[[Sequence[str], tuple[int, ...]], tuple[int, ...]] | None = None,
) -> LoadPlan:
    """Match the names in ``ckpt`` to ``targets`` and return what to copy where.

    Args:
        ckpt: The open checkpoint.
        targets: Every name of the model, aliases included, in the model's order.
        rules: Rename rules applied to names on disk, or ``"auto"``.
        strict: Raise on missing, unexpected or mismatched names instead of reporting them.
        cast: Allow a dtype on disk to differ from the model's.
        tie: Plan to make the model share one tensor where the file ties names.
        equal: Compares the values of two names on disk; needed only for views.
        label: The model's class name, for messages.
        shape_of: ``shape_of(model_names, shape_on_disk)`` is the shape a value transform
            (see :mod:`weightvault._transforms`) gives the tensor before it is copied; the
            shape check compares that with the model's shape.

    Raises:
        KeyMismatchError: ``strict`` and names disagree.
        ShapeMismatchError: ``strict`` and a shape (or, without ``cast``, a dtype) differs.
        TieConflictError: The model ties names that the file holds with different values.
        RuleError: The rules are malformed, collide, or ``"auto"`` is ambiguous.
    """
    explicit = [] if rules == "auto" else _rules.check(rules)
    avail, renamed = _rename(ckpt, explicit)
    groups: dict[Hashable, list[Target]] = {}
    for t in targets:
        groups.setdefault(t.identity, []).append(t)

    if rules == "auto":
        _auto(ckpt, groups, avail, renamed)

    report = LoadReport(ckpt.path, renamed=renamed)
    out = LoadPlan(report=report)
    used: set[str] = set()
    filled_by: dict[str, list[list[str]]] = defaultdict(list)
    conflicts: list[str] = []
    mismatched: list[tuple[str, str, str]] = []
    frozen_on_disk = set(ckpt.manifest.frozen)
    compare = equal or _bytes_equal(ckpt)

    for members in groups.values():
        sources = [(t, avail[t.name]) for t in members if t.name in avail]
        if not sources:
            report.missing += [t.name for t in members]
            continue
        first = ckpt.entry(sources[0][1])
        for t, src in sources[1:]:
            e = ckpt.entry(src)
            if (e.value_key != first.value_key or e.value_key is None) and not compare(
                first.name, src
            ):
                conflicts.append(f"{sources[0][0].name} / {t.name}")
        used.update(ckpt.entry(src).group for _, src in sources)
        t0 = members[0]
        # A transform (transpose, ...) changes the shape the model receives; compare that.
        shape = first.shape
        if shape_of is not None:
            shape = shape_of([t.name for t in members], first.shape)
        if shape != t0.shape or (first.dtype != t0.dtype and not cast):
            mismatched += [
                (t.name, describe(first.dtype, shape), describe(t.dtype, t.shape)) for t in members
            ]
            continue
        names = [t.name for t in members]
        out.assignments.append(Assignment(names, first.name, cast=first.dtype != t0.dtype))
        report.loaded += names
        filled_by[first.group].append(names)
        is_frozen = any(src in frozen_on_disk for _, src in sources)
        for t in members:
            if t.is_param:
                out.frozen[t.name] = is_frozen

    if conflicts:
        msg = (
            f"Cannot load {ckpt.path!r} into {label}: the model ties "
            f"{capped(conflicts)} but the file holds different values for them. "
            "Untie them in the model, or drop one name with a rule such as "
            f"rules=[({conflicts[0].split(' / ')[1]!r}, None)]."
        )
        raise TieConflictError(msg, conflicts)

    target_names = {t.name for t in targets}
    # One name per unused group: listing every alias of one tensor would only add noise.
    for new, src in avail.items():
        group = ckpt.entry(src).group
        if new not in target_names and group not in used:
            report.unexpected.append(new)
            used.add(group)
    for filled in filled_by.values():
        if len(filled) > 1:
            group_names = tuple(n for ns in filled for n in ns)
            if tie:
                out.tie.append(tuple(ns[0] for ns in filled))
                report.tied.append(group_names)
            else:
                report.untied.append(group_names)

    report.mismatched = mismatched
    if strict:
        signature = {t.name: (t.dtype, t.shape) for t in targets}

        def fits(disk: str, model: str) -> bool:
            """Whether the unexpected ``disk`` name could fill model name ``model``."""
            if disk not in avail or model not in signature:
                return False
            e = ckpt.entry(avail[disk])
            dtype, shape = signature[model]
            got = e.shape if shape_of is None else shape_of([model], e.shape)
            return got == shape and (cast or e.dtype == dtype)

        _raise_if_mismatched(ckpt, report, label, fits)
    return out


def _bytes_equal(ckpt: Checkpoint) -> Equal:
    def equal(a: str, b: str) -> bool:
        ea, eb = ckpt.entry(a), ckpt.entry(b)
        if ea.view is not None or eb.view is not None:
            # Views need a framework to gather strided bytes; without one, be safe.
            return False
        return same_bytes(ckpt.raw(ea.stored), ckpt.raw(eb.stored))

    return equal


def _rename(
    ckpt: Checkpoint, rules: list[_rules.Rule]
) -> tuple[dict[str, str], list[tuple[str, str]]]:
    avail: dict[str, str] = {}
    renamed: list[tuple[str, str]] = []
    for name in ckpt.names:
        new, index = _rules.apply(rules, name)
        if new is None:
            continue
        if new in avail:
            other = avail[new]
            if ckpt.entry(other).value_key != ckpt.entry(name).value_key:
                raise RuleError(
                    f"{ckpt.path}: rules map both {other!r} and {name!r} to {new!r}; "
                    "make the patterns more specific so each name has one source"
                )
            continue
        avail[new] = name
        if index is not None and new != name:
            renamed.append((name, new))
    return avail, renamed


def _auto(
    ckpt: Checkpoint,
    groups: dict[Hashable, list[Target]],
    avail: dict[str, str],
    renamed: list[tuple[str, str]],
) -> None:
    """Pair unmatched names of one dtype and shape when their names make the pairs unique."""
    target_names = {t.name for ms in groups.values() for t in ms}
    used = {
        ckpt.entry(avail[t.name]).group for ms in groups.values() for t in ms if t.name in avail
    }
    need = [ms for ms in groups.values() if not any(t.name in avail for t in ms)]
    spare: dict[str, str] = {}
    for new, src in avail.items():
        group = ckpt.entry(src).group
        if new not in target_names and group not in used and group not in spare:
            spare[group] = new
    by_sig_need: dict[tuple[str, tuple[int, ...]], list[list[Target]]] = defaultdict(list)
    by_sig_spare: dict[tuple[str, tuple[int, ...]], list[str]] = defaultdict(list)
    for ms in need:
        by_sig_need[(ms[0].dtype, ms[0].shape)].append(ms)
    for new in spare.values():
        e = ckpt.entry(avail[new])
        by_sig_spare[(e.dtype, e.shape)].append(new)
    problems = []
    for sig in sorted(set(by_sig_need) | set(by_sig_spare), key=str):
        a, b = by_sig_need.get(sig, []), by_sig_spare.get(sig, [])
        if len(a) != len(b):
            problems.append(
                f"{describe(*sig)}: {len(a)} unmatched in the model "
                f"({capped([ms[0].name for ms in a], 3) or 'none'}) but {len(b)} on disk "
                f"({capped(b, 3) or 'none'})"
            )
    if problems:
        raise RuleError(
            f"{ckpt.path}: rules='auto' cannot pair the remaining names unambiguously, "
            f"because the counts per dtype and shape differ: {'; '.join(problems[:4])}. "
            "Pass explicit rules instead, such as rules=[('old.*', 'new.*')]."
        )
    pairs: list[tuple[list[Target], str]] = []
    ambiguous = []
    for sig, needs in sorted(by_sig_need.items(), key=lambda kv: str(kv[0])):
        paired = _pair_by_names([ms[0].name for ms in needs], by_sig_spare[sig])
        if paired is None:
            ambiguous.append(
                f"{describe(*sig)}: model {capped([ms[0].name for ms in needs], 4)} / "
                f"file {capped(by_sig_spare[sig], 4)}"
            )
            continue
        pairs += [(needs[i], by_sig_spare[sig][k]) for i, k in enumerate(paired)]
    if ambiguous:
        raise RuleError(
            f"{ckpt.path}: rules='auto' cannot tell which name on disk fills which model "
            f"name, since several share a dtype and shape and their names differ in more "
            f"than a common prefix or suffix: {'; '.join(ambiguous[:4])}"
            + (f"; ... and {len(ambiguous) - 4} more groups" if len(ambiguous) > 4 else "")
            + ". Pass explicit rules instead, such as rules=[('*.query.*', '*.q_proj.*')]."
        )
    for ms, new in pairs:
        src = avail.pop(new)
        for t in ms:
            avail[t.name] = src
            renamed.append((src, t.name))


def _residues(names: list[str]) -> list[tuple[str, ...]]:
    """Each name's dotted parts after removing the parts all ``names`` start and end with."""
    parts = [n.split(".") for n in names]
    shortest = min(len(p) for p in parts)
    head = 0
    while head < shortest and len({p[head] for p in parts}) == 1:
        head += 1
    tail = 0
    while tail < shortest - head and len({p[len(p) - 1 - tail] for p in parts}) == 1:
        tail += 1
    return [tuple(p[head : len(p) - tail]) for p in parts]


def _pair_by_names(model: list[str], disk: list[str]) -> list[int] | None:
    """For each model name, the index of the disk name it pairs with; ``None`` if unsure.

    One name on each side pairs trivially. Otherwise each side loses the prefix and
    suffix its names all share, and the rest must be equal, one to one: ``blocks.0.w`` and
    ``layers.0.w`` pair, but ``attn.q_proj.w`` never pairs with ``attn.key.w`` or
    ``attn.query.w`` merely because they come in the same order.
    """
    if len(model) == 1:
        return [0]
    want, have = _residues(model), _residues(disk)
    index = {r: k for k, r in enumerate(have)}
    if len(index) != len(have) or len(set(want)) != len(want):
        return None
    out = [index.get(r) for r in want]
    if any(k is None for k in out):
        return None
    return [k for k in out if k is not None]


def _raise_if_mismatched(
    ckpt: Checkpoint, report: LoadReport, label: str, fits: Fits | None = None
) -> None:
    if report.mismatched:
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
    if not (report.missing or report.unexpected):
        return
    suggestions: dict[str, str] = {}
    for name in report.missing:
        close = difflib.get_close_matches(name, report.unexpected, n=1, cutoff=0.6)
        if close:
            suggestions[name] = close[0]
    rule, fixes = propose_rule(
        report.missing, report.unexpected, suggestions, fits=fits, loaded=report.loaded
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
    if rule is not None and len(fixes) < len(report.missing):
        lines.append(
            f"Pass rules=[{rule!r}] to rename {len(fixes)} of the {len(report.missing)} "
            "missing names (a partial fix: the others need rules of their own), or "
            "strict=False to load what matches."
        )
    elif rule is not None:
        lines.append(f"Pass rules=[{rule!r}] to rename, or strict=False to load what matches.")
    else:
        lines.append("Pass rules=... to rename names, or strict=False to load what matches.")
    raise KeyMismatchError(
        "\n".join(lines),
        missing=report.missing,
        unexpected=report.unexpected,
        suggestions=suggestions,
        rule=rule,
        rule_fixes=fixes,
    )


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
) -> tuple[tuple[str, str] | None, list[str]]:
    """The single rename rule that fixes the most missing names, and the names it fixes.

    A candidate is kept only if every name it renames lands on a missing name it can fill
    (``fits(disk_name, model_name)``, by dtype and shape), no two land on one, and it
    renames no name that already loads: a proposed rule never claims a fix it does not
    make. It may fix only some of the missing names; the caller says so.
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
        if best is None or len(fixed) > len(best[1]):
            best = (cand, [n for n in missing if n in set(fixed)])
    return (None, []) if best is None else best
