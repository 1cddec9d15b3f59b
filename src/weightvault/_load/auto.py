"""``rules="auto"``: pair the names left unmatched on each side by dtype, shape and name.

A step of the load plan (:func:`weightvault._load.plan.plan_load`). After the names that
match as they are, every model tensor still without a source and every name on disk
still unused are grouped by dtype and shape. Each group must hold as many on both sides,
and within a group the names must pair one to one once the prefix and suffix they all
share are removed; anything less certain is a :class:`~weightvault.RuleError` that asks
for explicit rules, never a guess.

Example:
    >>> _pair_by_names(["blocks.0.w", "blocks.1.w"], ["layers.1.w", "layers.0.w"])
    [1, 0]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from .._base.dtypes import describe
from .._base.errors import RuleError, capped
from .._file.checkpoint import Checkpoint

Signature = tuple[str, tuple[int, ...]]
#: One tensor of the model: its names (a tie has several), dtype and shape.
Tensor = tuple[list[str], str, tuple[int, ...]]


def pair_leftovers(
    ckpt: Checkpoint,
    tensors: Sequence[Tensor],
    avail: dict[str, str],
    renamed: list[tuple[str, str]],
) -> None:
    """Give every unmatched model tensor its unmatched name on disk, in ``avail``.

    Args:
        ckpt: The open checkpoint.
        tensors: The model's tensors, as ``(names, dtype, shape)``.
        avail: ``{name after the rules: name on disk}``; pairs are added to it.
        renamed: The ``(old, new)`` renames made so far; pairs are added to it.

    Raises:
        RuleError: The counts per dtype and shape differ, or names do not pair uniquely.
    """
    need, spare = _leftovers(ckpt, tensors, avail)
    _check_counts(ckpt, need, spare)
    pairs: list[tuple[list[str], str]] = []
    ambiguous = []
    for sig, needs in sorted(need.items(), key=lambda kv: str(kv[0])):
        paired = _pair_by_names([names[0] for names in needs], spare[sig])
        if paired is None:
            ambiguous.append(
                f"{describe(*sig)}: model {capped([names[0] for names in needs], 4)} / "
                f"file {capped(spare[sig], 4)}"
            )
            continue
        pairs += [(needs[i], spare[sig][k]) for i, k in enumerate(paired)]
    if ambiguous:
        raise RuleError(
            f"{ckpt.path}: rules='auto' cannot tell which name on disk fills which model "
            f"name, since several share a dtype and shape and their names differ in more "
            f"than a common prefix or suffix: {'; '.join(ambiguous[:4])}"
            + (f"; ... and {len(ambiguous) - 4} more groups" if len(ambiguous) > 4 else "")
            + ". Pass explicit rules instead, such as rules=[('*.query.*', '*.q_proj.*')]."
        )
    for names, new in pairs:
        src = avail.pop(new)
        for name in names:
            avail[name] = src
            renamed.append((src, name))


def _leftovers(
    ckpt: Checkpoint, tensors: Sequence[Tensor], avail: dict[str, str]
) -> tuple[dict[Signature, list[list[str]]], dict[Signature, list[str]]]:
    """The names of each model tensor without a source, and one unused name per group on
    disk, by dtype and shape."""
    target_names = {n for names, _, _ in tensors for n in names}
    used = {ckpt.entry(avail[n]).group for n in target_names if n in avail}
    first_unused: dict[str, str] = {}
    for new, src in avail.items():
        group = ckpt.entry(src).group
        if new not in target_names and group not in used and group not in first_unused:
            first_unused[group] = new
    need: dict[Signature, list[list[str]]] = defaultdict(list)
    spare: dict[Signature, list[str]] = defaultdict(list)
    for names, dtype, shape in tensors:
        if not any(n in avail for n in names):
            need[(dtype, shape)].append(names)
    for new in first_unused.values():
        e = ckpt.entry(avail[new])
        spare[(e.dtype, e.shape)].append(new)
    return need, spare


def _check_counts(
    ckpt: Checkpoint, need: dict[Signature, list[list[str]]], spare: dict[Signature, list[str]]
) -> None:
    problems = []
    for sig in sorted(set(need) | set(spare), key=str):
        a, b = need.get(sig, []), spare.get(sig, [])
        if len(a) != len(b):
            problems.append(
                f"{describe(*sig)}: {len(a)} unmatched in the model "
                f"({capped([names[0] for names in a], 3) or 'none'}) but {len(b)} on disk "
                f"({capped(b, 3) or 'none'})"
            )
    if problems:
        raise RuleError(
            f"{ckpt.path}: rules='auto' cannot pair the remaining names unambiguously, "
            f"because the counts per dtype and shape differ: {'; '.join(problems[:4])}. "
            "Pass explicit rules instead, such as rules=[('old.*', 'new.*')]."
        )


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
