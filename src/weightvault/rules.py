"""Rename rules for :func:`weightvault.torch.load` and friends.

A rule is a ``(pattern, replacement)`` pair. ``*`` captures any run of characters and
the captures fill the replacement's ``*`` in order; ``None`` drops the name. Rules are
tried top to bottom and the first match wins.

Example:
    >>> from weightvault.rules import explain
    >>> explain([("l1.*", "l2.*")], ["l1.weight", "l1.bias"])
    [('l1.weight', 'l2.weight', 0), ('l1.bias', 'l2.bias', 0)]
"""

from __future__ import annotations

from ._rules import Rule, Rules, check, explain, invert, rename

__all__ = ["Rule", "Rules", "check", "explain", "invert", "rename"]
