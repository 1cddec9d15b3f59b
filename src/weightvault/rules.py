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

from ._load.rules import Rule, Rules, check, explain, invert, rename

__all__ = [
    "GLUON_TO_TORCH",
    "MXNET_PREFIXES",
    "Rule",
    "Rules",
    "check",
    "explain",
    "invert",
    "rename",
]

#: Strip the ``arg:``/``aux:`` prefixes of MXNet ``Module``/``export`` files, as Gluon's
#: ``load_dict`` does: ``arg:fc1_weight`` -> ``fc1_weight``.
MXNET_PREFIXES: list[Rule] = [("arg:*", "*"), ("aux:*", "*")]

# Gluon -> PyTorch parameter names, for structural Gluon names (``features.1.gamma``).
# Dense, Conv and Embedding already agree (``weight``, ``bias``); norm layers call their
# affine parameters gamma/beta; PReLU's slope is alpha; RNN layers name weights by layer.
_GLUON_SUFFIXES: list[tuple[str, str]] = [
    ("gamma", "weight"),
    ("beta", "bias"),
    ("alpha", "weight"),
    ("l*_i2h_weight", "weight_ih_l*"),
    ("l*_h2h_weight", "weight_hh_l*"),
    ("l*_i2h_bias", "bias_ih_l*"),
    ("l*_h2h_bias", "bias_hh_l*"),
    ("r*_i2h_weight", "weight_ih_l*_reverse"),
    ("r*_h2h_weight", "weight_hh_l*_reverse"),
    ("r*_i2h_bias", "bias_ih_l*_reverse"),
    ("r*_h2h_bias", "bias_hh_l*_reverse"),
]

#: Gluon names -> PyTorch names: ``bn.gamma`` -> ``bn.weight``, ``bn.beta`` -> ``bn.bias``
#: (BatchNorm, LayerNorm, InstanceNorm, GroupNorm), ``rnn.l0_i2h_weight`` ->
#: ``rnn.weight_ih_l0``; ``running_mean``/``running_var``, ``weight`` and ``bias`` keep
#: their names. ``arg:``/``aux:`` prefixes are stripped too. PyTorch's BatchNorm has a
#: ``num_batches_tracked`` buffer that Gluon files lack: load with ``strict=False``.
GLUON_TO_TORCH: list[Rule] = [
    (f"{prefix}{dot}{gluon}", f"{dot}{torch}")
    for prefix in ("arg:", "aux:", "")
    for gluon, torch in _GLUON_SUFFIXES
    for dot in ("*.", "")
] + MXNET_PREFIXES
