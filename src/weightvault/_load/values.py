"""Planned values as numpy arrays: the read step of the numpy-backed adapters' loads.

``weightvault.numpy``, ``.jax`` and ``.keras`` fill a model from numpy arrays. Each one
reads the values of the load plan here, one at a time, with the one decoder of stored
bytes (:mod:`weightvault._file.arrays`), rearranges each by its transform and converts
its dtype. A load stages the checkpoint first (:meth:`~weightvault.Checkpoint.stage`),
so a file that cannot be read fails before the model is touched, and then holds at most
one value beside the model (or none: :func:`read_value_into` reads straight into it).
Importing this module needs numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._file.arrays import read_array
from .._file.checkpoint import Checkpoint
from .plan import Assignment, LoadPlan


def read_values(
    ckpt: Checkpoint, plan: LoadPlan, dtype_of: Callable[[Assignment], Any]
) -> list[tuple[Assignment, Any]]:
    """Each assignment with a fresh C-contiguous array of the value it copies.

    Args:
        ckpt: The open checkpoint.
        plan: The load plan.
        dtype_of: The model's numpy dtype for an assignment, or ``None`` if numpy has
            none; a value whose dtype on disk differs (``cast``) is converted to it.

    Raises:
        FormatError: The file was truncated while it was read.
    """
    bases: dict[str, memoryview] = {}
    return [(a, read_value(ckpt, a, bases, dtype_of)) for a in plan.assignments]


def read_value(
    ckpt: Checkpoint,
    a: Assignment,
    bases: dict[str, memoryview],
    dtype_of: Callable[[Assignment], Any],
) -> Any:
    """A fresh C-contiguous array of the value assignment ``a`` copies, transformed and
    converted as :func:`read_values` does; ``bases`` keeps stored tensors views read."""
    value = read_array(ckpt, ckpt.entry(a.source), bases)
    if a.transform is not None:
        value = np.ascontiguousarray(value.transpose(a.transform.axes_for(value.ndim)))
    want = dtype_of(a) if a.cast else None
    if want is not None:
        value = value.astype(want)
    return value


def read_value_into(ckpt: Checkpoint, a: Assignment, out: Any) -> bool:
    """Read ``a``'s stored bytes straight into numpy array ``out``, if the layouts allow
    it (a whole stored tensor, no transform or cast, ``out`` C-contiguous, writable and
    little-endian); ``False`` if they do not, and nothing was read."""
    e = ckpt.entry(a.source)
    if (
        e.view is not None
        or a.transform is not None
        or a.cast
        or not isinstance(out, np.ndarray)
        or not out.flags.c_contiguous
        or not out.flags.writeable
        or out.dtype.byteorder == ">"
        or out.nbytes != ckpt.stored[e.stored].nbytes
        or out.nbytes == 0
    ):
        return False
    return ckpt.read_into(e.stored, out.reshape(-1).view(np.uint8).data)
