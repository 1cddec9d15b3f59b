"""Value transforms applied to tensors on load, kept apart from renames.

Rules say *which* name on disk fills a model name; transforms say *how* its values must be
rearranged first. They are needed across frameworks: PyTorch stores ``Linear.weight`` as
``(out, in)`` and Keras stores ``Dense.kernel`` as ``(in, out)``, so a rename alone loads
the right numbers into the wrong places (or fails the shape check).

A transform is an axis permutation, so the load policy can predict the shape it produces
before any byte is read and keep its all-or-nothing checks. Three spellings are accepted:

* ``"transpose"``: reverse every axis (the matrix transpose for 2-D tensors);
* ``"permute(3, 2, 0, 1)"``, or the tuple ``(3, 2, 0, 1)``: output axis ``i`` is input
  axis ``axes[i]``, as ``numpy.transpose`` and ``torch.permute`` read it.

``transforms`` maps ``*`` patterns to transforms. A pattern is matched against the
*model's* names (after renaming), so it is written in the vocabulary of the model being
loaded; the first pattern that matches a name wins.

Example:
    >>> t = resolve({"*/kernel": "transpose"}, ["fc1/kernel"])
    >>> t.axes_for(2), t.shape((10, 4))
    ((1, 0), (4, 10))
    >>> conv = parse("permute(2, 3, 1, 0)")   # torch (out, in, kh, kw) -> keras (kh, kw, in, out)
    >>> conv.shape((8, 3, 5, 5))
    (5, 5, 3, 8)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .._base.errors import RuleError, ShapeMismatchError
from . import rules as _rules

TransformSpec = str | tuple[int, ...] | list[int]
Transforms = Mapping[str, TransformSpec]

_PERMUTE = re.compile(r"^\s*permute\s*\(([\d\s,]*)\)\s*$")


@dataclass(frozen=True)
class Permute:
    """Reorder axes; ``axes=None`` reverses them all (``"transpose"``)."""

    axes: tuple[int, ...] | None = None

    def axes_for(self, ndim: int) -> tuple[int, ...]:
        """The permutation to apply to a tensor of ``ndim`` axes.

        Raises:
            ShapeMismatchError: The permutation has another number of axes.
        """
        if self.axes is None:
            return tuple(range(ndim - 1, -1, -1))
        if len(self.axes) != ndim:
            raise ShapeMismatchError(
                f"transform {self} reorders {len(self.axes)} axes but the tensor has {ndim}; "
                "give a permutation with one entry per axis"
            )
        return self.axes

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a tensor of ``shape`` has after the transform."""
        return tuple(shape[a] for a in self.axes_for(len(shape)))

    def __str__(self) -> str:
        return "transpose" if self.axes is None else f"permute{self.axes}"


def parse(spec: TransformSpec | Permute) -> Permute:
    """Turn one user spelling of a transform into a :class:`Permute`.

    Raises:
        RuleError: The spelling is unknown or the axes are not a permutation.
    """
    if isinstance(spec, Permute):
        return spec
    axes: tuple[int, ...] | None
    if isinstance(spec, str):
        if spec.strip() in ("transpose", "T"):
            return Permute()
        m = _PERMUTE.match(spec)
        if m is None:
            raise RuleError(
                f"unknown transform {spec!r}; use 'transpose', 'permute(1, 0)' or a tuple "
                "of axes such as (2, 3, 1, 0)"
            )
        axes = tuple(int(a) for a in m.group(1).replace(",", " ").split())
    elif isinstance(spec, tuple | list) and all(isinstance(a, int) for a in spec):
        axes = tuple(spec)
    else:
        raise RuleError(
            f"transform {spec!r} is neither a string such as 'transpose' nor a tuple of axes"
        )
    if sorted(axes) != list(range(len(axes))):
        raise RuleError(f"transform axes {axes} are not a permutation of 0..{len(axes) - 1}")
    return Permute(axes)


def check(transforms: Transforms | None) -> list[tuple[str, Permute]]:
    """Validate ``transforms`` up front and return ``(pattern, Permute)`` pairs in order.

    Raises:
        RuleError: A pattern is not a string or a transform is malformed.
    """
    out: list[tuple[str, Permute]] = []
    for pattern, spec in (transforms or {}).items():
        if not isinstance(pattern, str):
            raise RuleError(f"transform pattern {pattern!r} must be a string such as '*/kernel'")
        out.append((pattern, parse(spec)))
    return out


def resolve(
    transforms: Transforms | list[tuple[str, Permute]] | None, names: Iterable[str]
) -> Permute | None:
    """The transform for a model tensor known by ``names`` (first pattern, first name wins)."""
    pairs = transforms if isinstance(transforms, list) else check(transforms)
    for name in names:
        for pattern, t in pairs:
            if _rules.match(pattern, name) is not None:
                return t
    return None
