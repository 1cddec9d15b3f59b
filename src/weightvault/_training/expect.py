"""What each piece of saved training state must hold, and the comparison with what it holds.

Framework-free. An adapter describes what its framework's loader needs (torch derives it
from the live optimizer and scheduler, :mod:`weightvault._torch.expect`); a check
without a framework (:mod:`weightvault._training.complete`) describes it from the table
of known classes (:mod:`weightvault._training.known`). Both compare here, so a damaged
key reads the same from a load and from ``verify``, and a load refuses it with
:class:`~weightvault.FormatError` before the framework sees it.

Kinds are those of decoded JSON: ``"number"`` (an int or a float), ``"bool"``, ``"str"``,
``"list"`` (a list or a tuple), ``"dict"``, ``"None"``, and ``"tensor"`` for state stored
as a tensor. ``None`` matches anything: a value that may be unset says nothing of its kind.

Example:
    >>> like = Expect("tensor", like_param=True)
    >>> param_problems("w", {"exp_avg": (2, 3)}, {"step": 3}, (2, 3),
    ...                {"exp_avg": like, "step": Expect("tensor", ndim=0)}, "Adam")
    ["parameter 'w': key 'step' is a number, but Adam keeps a 0-d tensor there"]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._base.errors import FormatError

#: How many problems an error message shows before it says how many more there are.
SHOWN = 4


def kind(value: Any) -> str:
    """The kind of a decoded JSON value, as messages name it."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


@dataclass(frozen=True)
class Expect:
    """What one state key of one parameter holds.

    Attributes:
        kind: ``"tensor"``, the kind of a JSON value (see the module's docstring), or
            ``"any"`` (a value the class may leave unset, such as ``None``).
        ndim: A tensor's number of dimensions; ``None``: any.
        like_param: A tensor of the parameter's own shape (Adam's ``exp_avg``).
    """

    kind: str
    ndim: int | None = None
    like_param: bool = False

    def describe(self) -> str:
        if self.kind == "any":
            return "any value"
        if self.kind != "tensor":
            return f"a {self.kind}"
        if self.like_param:
            return "a tensor of the parameter's shape"
        return "a tensor" if self.ndim is None else f"a {self.ndim}-d tensor"

    def fits(self, shape: tuple[int, ...] | None, value: Any, param: Sequence[int]) -> bool:
        """Whether a stored tensor of ``shape`` (``None``: a JSON ``value``) is this."""
        if self.kind == "any":
            return True
        if self.kind != "tensor":
            return shape is None and (value is None or kind(value) == self.kind)
        if shape is None:
            return False
        if self.like_param:
            return tuple(shape) == tuple(param)
        return self.ndim is None or len(shape) == self.ndim


def param_problems(
    name: str,
    tensors: Mapping[str, tuple[int, ...]],
    values: Mapping[str, Any],
    shape: Sequence[int],
    expected: Mapping[str, Expect],
    label: str,
) -> list[str]:
    """What parameter ``name``'s saved state lacks or holds in the wrong kind.

    Args:
        name: The parameter, as the checkpoint names it.
        tensors: Its state keys stored as tensors, each with the stored shape.
        values: Its state keys stored as JSON, decoded.
        shape: The parameter's shape.
        expected: What ``label`` keeps for such a parameter, key by key. Keys beyond
            these are not refused: the optimizer ignores them.
        label: The optimizer's class, for messages.
    """
    out = []
    held = sorted({*tensors, *values})
    for key, want in expected.items():
        if key not in tensors and key not in values:
            out.append(
                f"parameter {name!r}: key {key!r} is missing ({label} keeps "
                f"{', '.join(sorted(expected))}; the checkpoint holds {', '.join(held) or 'none'})"
            )
        elif not want.fits(tensors.get(key), values.get(key), shape):
            have = (
                f"a tensor of shape {list(tensors[key])}"
                if key in tensors
                else f"a {kind(values[key])}"
            )
            out.append(
                f"parameter {name!r}: key {key!r} is {have}, but {label} keeps "
                f"{want.describe()} there"
            )
    return out


def struct_problems(saved: Any, reference: Any, what: str, label: str) -> list[str]:
    """Where ``saved`` lacks a key of ``reference``, or holds another kind, recursively.

    Dicts with string keys are compared key by key (a key ``saved`` has beyond
    ``reference`` is allowed); lists element by element, and must be as long; dicts with
    other keys (a ``Counter`` of milestones) only as dicts. ``None`` on either side
    matches anything.

    Args:
        saved: The decoded saved value.
        reference: A value of the form the loader needs (the live object's own state).
        what: ``saved``'s place, for messages (``"state key 'last_epoch'"``).
        label: Who keeps ``reference``, for messages.
    """
    if saved is None or reference is None:
        return []
    if kind(saved) != kind(reference):
        return [f"{what} is a {kind(saved)}, but {label} keeps a {kind(reference)} there"]
    if isinstance(reference, dict):
        if not all(isinstance(k, str) for k in reference):
            return []
        out = []
        for k, v in reference.items():
            if k not in saved:
                out.append(f"{what}[{k!r}] is missing")
            else:
                out += struct_problems(saved[k], v, f"{what}[{k!r}]", label)
        return out
    if isinstance(reference, (list, tuple)):
        if len(saved) != len(reference):
            return [f"{what} holds {len(saved)} entries, but {label} keeps {len(reference)} there"]
        out = []
        for i, (s, r) in enumerate(zip(saved, reference, strict=True)):
            out += struct_problems(s, r, f"{what}[{i}]", label)
        return out
    return []


def keys_problems(
    saved: Mapping[str, Any],
    required: Mapping[str, str] | Sequence[str],
    reference: Mapping[str, Any],
    what: str,
    label: str,
) -> list[str]:
    """What the mapping ``saved`` lacks of ``required``, and what it holds in the wrong kind.

    Args:
        saved: The decoded mapping (an optimizer group's hyperparameters, a scheduler's
            state).
        required: The keys it must hold; a mapping gives each one's kind as well.
        reference: Values of the form the loader needs, key by key (compared with
            :func:`struct_problems` where ``saved`` holds the key too).
        what: The mapping's place, for messages (``"group 0 hyperparameter"``).
        label: Who keeps ``reference``, for messages.
    """
    out = []
    kinds = required if isinstance(required, Mapping) else {}
    for key in required:
        if key not in saved:
            out.append(f"{what} {key!r} is missing")
        elif key in kinds and saved[key] is not None and kind(saved[key]) != kinds[key]:
            out.append(
                f"{what} {key!r} is a {kind(saved[key])}, but {label} keeps a {kinds[key]} there"
            )
    for key, ref in reference.items():
        if key in saved and key not in kinds:
            out += struct_problems(saved[key], ref, f"{what} {key!r}", label)
    return out


def refuse(where: str, what: str, label: str, problems: Sequence[str]) -> None:
    """Raise if ``problems`` is not empty, before any of it reaches the framework.

    Raises:
        FormatError: Naming the checkpoint, each parameter or key, with one fix.
    """
    if not problems:
        return
    shown = "; ".join(problems[:SHOWN])
    if len(problems) > SHOWN:
        shown += f"; ... and {len(problems) - SHOWN} more"
    raise FormatError(
        f"Cannot load the {what} state of {where!r} into {label}: {shown}. The checkpoint's "
        f"training state is damaged or was not written for this {label}; resume from "
        "another checkpoint of the run"
    )
