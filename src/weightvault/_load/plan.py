"""The load plan: which name on disk fills which tensor of a model, decided up front.

This is the whole load policy, shared by every adapter (the save plan is its mirror,
:mod:`weightvault._file.sharing`). It works on names, identities, dtypes and shapes only;
the adapter then copies bytes as the returned :class:`LoadPlan` says. Because every check
runs here first, a load that fails leaves the model exactly as it was.

:func:`plan_load` runs in readable steps: rename the names on disk (:func:`_available`,
and :mod:`.auto` for ``rules="auto"``), match each tensor of the model with one of them
(:class:`_Matcher`), refuse ties the file contradicts, list what is left over, and, when
``strict``, explain every mismatch with a fix (:mod:`.mismatch`).

Example:
    >>> lp = plan_load(ckpt, [Target("w", id(w), "F32", (2, 2))], LoadOptions(strict=False))
    >>> [a.source for a in lp.assignments], lp.report.missing
    (['w'], [])
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from .._base.dtypes import describe
from .._base.errors import RuleError, TieConflictError, capped
from .._base.reports import LoadReport
from .._file.checkpoint import Checkpoint, Entry
from .._file.sharing import same_bytes
from . import rules as _rules, transforms as _transforms
from .auto import pair_leftovers
from .mismatch import Fits, raise_if_mismatched

RulesArg = Sequence[_rules.Rule] | Literal["auto"]


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a load matches and checks names: what every adapter's ``load`` takes.

    Attributes:
        rules: Rename rules applied to names on disk, or ``"auto"``.
        strict: Raise on missing, unexpected or mismatched names instead of reporting them.
        cast: Allow a dtype on disk to differ from the model's.
        tie: Plan to make the model share one tensor where the file ties names.
        verify: Check the checksums of what is read before the first byte is copied.
        transforms: ``{pattern: transform}`` over the model's names
            (:mod:`weightvault._load.transforms`); the shape check compares the shape a
            value has after its transform.
    """

    rules: RulesArg = ()
    strict: bool = True
    cast: bool = False
    tie: bool = False
    verify: bool = False
    transforms: _transforms.Transforms | None = None


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
    """Fill the model tensor known by ``names`` from the name ``source`` on disk.

    ``stored`` is the stored tensor whose bytes ``source`` reads; ``cast`` says the dtype
    on disk differs from the model's (``dtype``); ``transform`` rearranges the value first.
    """

    names: list[str]
    source: str
    stored: str = ""
    dtype: str = ""
    cast: bool = False
    transform: _transforms.Permute | None = None


@dataclass
class LoadPlan:
    """What to copy where, the report so far, the file's frozen flags and ties to make."""

    assignments: list[Assignment] = field(default_factory=list)
    report: LoadReport = field(default_factory=lambda: LoadReport(""))
    frozen: dict[str, bool] = field(default_factory=dict)
    tie: list[tuple[str, ...]] = field(default_factory=list)

    def reads(self) -> list[str]:
        """The stored tensors the assignments read, each once (what ``verify`` checks)."""
        return sorted({a.stored for a in self.assignments})

    def report_frozen(self) -> list[str]:
        """Record in the report, and return, the names the file marks frozen.

        An adapter calls it once it has set the model's flags (``restore_frozen=True``).
        """
        self.report.frozen = [n for n, f in self.frozen.items() if f]
        return self.report.frozen


def plan_load(
    ckpt: Checkpoint,
    targets: Sequence[Target],
    options: LoadOptions = LoadOptions(),
    label: str = "model",
) -> LoadPlan:
    """Match the names in ``ckpt`` to ``targets`` and return what to copy where.

    Args:
        ckpt: The open checkpoint.
        targets: Every name of the model, aliases included, in the model's order.
        options: Rules, strictness, casting, ties and transforms.
        label: The model's class name, for messages.

    Raises:
        KeyMismatchError: ``strict`` and names disagree.
        ShapeMismatchError: ``strict`` and a shape (or, without ``cast``, a dtype) differs.
        TieConflictError: The model ties names that the file holds with different values.
        RuleError: The rules are malformed, collide, or ``"auto"`` is ambiguous.
    """
    explicit = [] if options.rules == "auto" else _rules.check(options.rules)
    avail, renamed = _available(ckpt, explicit)
    groups: dict[Hashable, list[Target]] = {}
    for t in targets:
        groups.setdefault(t.identity, []).append(t)
    if options.rules == "auto":
        tensors = [([t.name for t in ms], ms[0].dtype, ms[0].shape) for ms in groups.values()]
        pair_leftovers(ckpt, tensors, avail, renamed)
    matcher = _Matcher(ckpt, options, LoadPlan(report=LoadReport(ckpt.path, renamed=renamed)))
    for members in groups.values():
        matcher.match(members, avail)
    matcher.refuse_conflicts(label)
    matcher.leftovers(avail, {t.name for t in targets})
    plan = matcher.plan
    if options.strict:
        raise_if_mismatched(ckpt, plan.report, label, _fits(ckpt, avail, targets, options))
    return plan


def _available(
    ckpt: Checkpoint, rules: list[_rules.Rule]
) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """``{name after the rules: name on disk}``, and the ``(old, new)`` renames made."""
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


class _Matcher:
    """Matches each tensor of the model (a group of names) with one name on disk."""

    def __init__(self, ckpt: Checkpoint, options: LoadOptions, plan: LoadPlan) -> None:
        self.ckpt, self.options, self.plan = ckpt, options, plan
        self.pairs = _transforms.check(options.transforms)
        self.used: set[str] = set()  # groups on disk that fill something
        self.filled_by: dict[str, list[list[str]]] = defaultdict(list)
        self.conflicts: list[str] = []
        self.frozen_on_disk = set(ckpt.manifest.frozen)

    def match(self, members: list[Target], avail: dict[str, str]) -> None:
        """Plan one model tensor, known by ``members``, or report why it cannot be filled."""
        report = self.plan.report
        sources = [(t, avail[t.name]) for t in members if t.name in avail]
        if not sources:
            report.missing += [t.name for t in members]
            return
        first = self.ckpt.entry(sources[0][1])
        for t, src in sources[1:]:
            if not _same_values(self.ckpt, first, self.ckpt.entry(src)):
                self.conflicts.append(f"{sources[0][0].name} / {t.name}")
        self.used.update(self.ckpt.entry(src).group for _, src in sources)
        t0, names = members[0], [t.name for t in members]
        transform = _transforms.resolve(self.pairs, names)
        # A transform (transpose, ...) changes the shape the model receives; compare that.
        shape = first.shape if transform is None else transform.shape(first.shape)
        if shape != t0.shape or (first.dtype != t0.dtype and not self.options.cast):
            mine = [(t.name, describe(t.dtype, t.shape)) for t in members]
            report.mismatched += [(n, describe(first.dtype, shape), m) for n, m in mine]
            return
        cast = first.dtype != t0.dtype
        self.plan.assignments.append(
            Assignment(names, first.name, first.stored, t0.dtype, cast, transform)
        )
        report.loaded += names
        self.filled_by[first.group].append(names)
        is_frozen = any(src in self.frozen_on_disk for _, src in sources)
        self.plan.frozen.update({t.name: is_frozen for t in members if t.is_param})

    def refuse_conflicts(self, label: str) -> None:
        if self.conflicts:
            msg = (
                f"Cannot load {self.ckpt.path!r} into {label}: the model ties "
                f"{capped(self.conflicts)} but the file holds different values for them. "
                "Untie them in the model, or drop one name with a rule such as "
                f"rules=[({self.conflicts[0].split(' / ')[1]!r}, None)]."
            )
            raise TieConflictError(msg, self.conflicts)

    def leftovers(self, avail: dict[str, str], target_names: set[str]) -> None:
        """Report names on disk that fill nothing, and the file's ties the model lacks."""
        report = self.plan.report
        # One name per unused group: listing every alias of one tensor would only add noise.
        for new, src in avail.items():
            group = self.ckpt.entry(src).group
            if new not in target_names and group not in self.used:
                report.unexpected.append(new)
                self.used.add(group)
        for filled in self.filled_by.values():
            if len(filled) > 1:
                group_names = tuple(n for ns in filled for n in ns)
                if self.options.tie:
                    self.plan.tie.append(tuple(ns[0] for ns in filled))
                    report.tied.append(group_names)
                else:
                    report.untied.append(group_names)


def _same_values(ckpt: Checkpoint, a: Entry, b: Entry) -> bool:
    """Whether two names on disk hold the same dtype, shape and bits."""
    if a.value_key is not None and a.value_key == b.value_key:
        return True
    if a.view is None and b.view is None:
        same = (a.dtype, a.shape) == (b.dtype, b.shape)
        return same and same_bytes(ckpt.raw(a.stored), ckpt.raw(b.stored))
    from .._file.arrays import same_values  # numpy, which only views need

    return same_values(ckpt, a, b)


def _fits(
    ckpt: Checkpoint, avail: dict[str, str], targets: Sequence[Target], options: LoadOptions
) -> Fits:
    """Whether an unexpected name on disk could fill a model name, by dtype and shape."""
    signature = {t.name: (t.dtype, t.shape) for t in targets}
    pairs = _transforms.check(options.transforms)

    def fits(disk: str, model: str) -> bool:
        if disk not in avail or model not in signature:
            return False
        e = ckpt.entry(avail[disk])
        dtype, shape = signature[model]
        transform = _transforms.resolve(pairs, [model])
        got = e.shape if transform is None else transform.shape(e.shape)
        return got == shape and (options.cast or e.dtype == dtype)

    return fits
