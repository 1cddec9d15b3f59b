"""Training wrappers (``torch.compile``, DDP, ``DataParallel``) kept out of stored names.

``torch.compile(model)`` names every tensor ``_orig_mod.<name>``, and DDP and
``nn.DataParallel`` name it ``module.<name>``: the same weights under other names, which
a plain model could not load. weightvault saves the model inside the wrappers
(:func:`unwrap`), so ``save(torch.compile(m))`` writes what ``save(m)`` writes, as DCP's
``get_state_dict`` and transformers do. Files written before, with the prefixes, still
load: :func:`prefix_rules` strips them from the names on disk when the model has no
name that starts with them, as transformers does.

Example:
    >>> unwrap(nn.DataParallel(torch.compile(model))) is model
    True
    >>> prefix_rules(["_orig_mod.w"], ["w"], [])
    [('_orig_mod.*', '*')]
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from torch import nn

from .._load.rules import Rule

#: The prefixes the wrappers put in front of every name, in the order they are stripped.
PREFIXES = ("_orig_mod.", "module.")

M = TypeVar("M")


def _compiled_class() -> type | None:
    """``OptimizedModule``, if ``torch.compile`` was ever used (else nothing is one)."""
    # Importing torch._dynamo costs seconds; a module it has not loaded cannot exist.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    cls = getattr(eval_frame, "OptimizedModule", None)
    return cls if isinstance(cls, type) else None


def _inner(model: nn.Module) -> nn.Module | None:
    """The module ``model`` wraps, or ``None`` if it is not a wrapper."""
    compiled = _compiled_class()
    if compiled is not None and isinstance(model, compiled):
        inner = getattr(model, "_orig_mod", None)
    elif isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
        inner = getattr(model, "module", None)
    else:
        return None
    return inner if isinstance(inner, nn.Module) else None


def unwrap(model: M) -> M:
    """The model inside any nesting of ``torch.compile``, DDP and ``DataParallel``.

    Anything else (a plain module, a dict of tensors) is returned as it is. The inner
    module holds the very tensors the wrapper does, so saving or loading it is saving or
    loading the wrapped model, under the names the model has on its own.

    Example:
        >>> unwrap(torch.compile(model, backend="eager")) is model
        True
    """
    out: Any = model
    while isinstance(out, nn.Module) and (inner := _inner(out)) is not None:
        out = inner
    return out  # type: ignore[no-any-return]


def _chain(name: str, strippable: Sequence[str]) -> str:
    """The wrapper prefixes ``name`` starts with, outermost first, as one string."""
    chain = ""
    while True:
        rest = name[len(chain) :]
        head = next((p for p in strippable if rest.startswith(p)), None)
        if head is None or len(rest) == len(head):
            return chain
        chain += head


def without_prefixes(name: str) -> str:
    """``name`` without the wrapper prefixes it starts with (a name or a pattern).

    Example:
        >>> without_prefixes("module._orig_mod.h.0.*")
        'h.0.*'
    """
    return name[len(_chain(name, PREFIXES)) :]


def prefix_rules(disk: Iterable[str], model: Iterable[str], rules: Sequence[Rule]) -> list[Rule]:
    """``rules``, extended to strip wrapper prefixes the model's names do not have.

    A prefix is stripped only if no model name starts with it. The ``rules`` still see
    each name on disk as it is first; a name none of them matches loses its prefixes and
    meets them again, so rules written for the model's names work on an old file too.

    Args:
        disk: The names in the file.
        model: The names of the (unwrapped) model.
        rules: The caller's checked rules.

    Returns:
        ``rules`` unchanged if no name on disk has a prefix to strip.

    Example:
        >>> prefix_rules(["module.h.0.w"], ["blocks.0.w"], [("h.*", "blocks.*")])
        [('h.*', 'blocks.*'), ('module.h.*', 'blocks.*'), ('module.*', '*')]
    """
    names = list(model)
    strippable = [p for p in PREFIXES if not any(n.startswith(p) for n in names)]
    chains = {_chain(n, strippable) for n in disk} - {""}
    if not chains:
        return list(rules)
    longest_first = sorted(chains, key=lambda c: (-len(c), c))
    composed = [(c + pattern, new) for c in longest_first for pattern, new in rules]
    return [*rules, *composed, *((c + "*", "*") for c in longest_first)]
