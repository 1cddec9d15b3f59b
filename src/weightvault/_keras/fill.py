"""Filling a Keras model's variables from a load plan, one variable at a time.

A load used to read every value first and assign them afterwards, which held a whole
second copy of the model (208 MiB for a 192 MiB model). Here each variable is read and
assigned before the next is read, so a load holds at most one variable's value beside
the model; on the PyTorch backend the bytes are read straight into the variable's own
memory, and nothing beside the model is held at all. A variable several layers share is
one assignment of the plan, so it is read and assigned once.

Every check (names, shapes, dtypes, ties) ran in the load plan before this starts, and
the caller staged every stored tensor (:meth:`~weightvault.Checkpoint.stage`: reached,
decoded and, with ``verify``, checksummed, within a small memory budget for a vault), so
a file that cannot be read fails before the first variable changes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._file.checkpoint import Checkpoint
from .._load.plan import Assignment, LoadPlan
from .._load.values import read_value


def fill(
    ckpt: Checkpoint,
    lp: LoadPlan,
    variables: Mapping[str, Any],
    dtype_of: Callable[[Assignment], Any],
) -> None:
    """Assign every planned value to its variable (``variables`` by model name).

    Args:
        ckpt: The open checkpoint.
        lp: The load plan, already checked.
        variables: ``{name: keras.Variable}`` for the first name of every assignment.
        dtype_of: The numpy dtype of an assignment's variable (for a cast).

    Raises:
        FormatError: A stored tensor changed since it was staged.
    """
    bases: dict[str, memoryview] = {}
    for a in lp.assignments:
        if ckpt.unchanged(a.stored):
            continue  # a walk's previous checkpoint put these very bytes there
        variable = variables[a.names[0]]
        if _read_in_place(ckpt, a, variable):
            # The new bytes are in the variable already; assign() still runs Keras' own
            # bookkeeping (and any subclass's) with that value, which copies nothing.
            variable.assign(variable.value)
            continue
        value = read_value(ckpt, a, bases, dtype_of)
        variable.assign(value)
        # JAX copies asynchronously and holds the array until it has: wait, or every
        # value read would be alive at once.
        ready = getattr(variable.value, "block_until_ready", None)
        if ready is not None:
            ready()
        del value  # before the next one is read


def _read_in_place(ckpt: Checkpoint, a: Assignment, variable: Any) -> bool:
    """Read ``a``'s bytes straight into a PyTorch-backed variable's memory, if possible.

    Keras' torch backend holds some dtypes wider (uint16 as int32); then the dtypes
    differ, nothing is read here, and ``assign()`` converts the value.
    """
    tensor: Any = getattr(variable, "value", None)
    if a.transform is not None or a.cast or type(tensor).__module__.split(".")[0] != "torch":
        return False
    from .._torch.assign import read_direct

    return read_direct(ckpt, a.source, tensor)
