"""Non-tensor values of a DCP state (epochs, AdamW's betas): JSON, never pickle.

DCP hands such values to a storage writer as ``BYTE_IO`` items and expects them back as
``torch.save`` blobs. The vault stores them in the record as JSON through the one codec
of :mod:`weightvault._training.codec` (records written before it, with ``__tuple__``
tags, still load), and builds the blob a load planner wants in memory from the decoded
values, never from stored bytes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from .._training.codec import decode, encode

__all__ = ["Value", "as_blob", "from_record", "to_record"]

_HINT = (
    "The vault keeps DCP's non-tensor values without pickle: convert it to one of "
    "those or to a tensor"
)


@dataclass(frozen=True)
class Value:
    """A non-tensor value: JSON when written, the Python value when read."""

    value: Any


def _plain_value(planner: SavePlanner, item: WriteItem) -> Any:
    """A non-tensor value of the state, without a pickle round trip where DCP allows."""
    if isinstance(planner, DefaultSavePlanner):
        return planner.lookup_object(item.index)
    # Other planners only hand out a torch.save blob, made in this process from the state;
    # the safe unpickler lets plain values through and refuses anything else.
    data = planner.resolve_data(item)
    assert isinstance(data, io.BytesIO)
    data.seek(0)
    return torch.load(data, weights_only=True)


def to_record(planner: SavePlanner, item: WriteItem, where: str) -> Value:
    """Item ``item``'s value as the JSON the record keeps.

    Raises:
        UnsupportedStateError: The value has no JSON form (it would need pickle).
    """
    return Value(encode(_plain_value(planner, item), where, hint=_HINT))


def from_record(doc: Any, where: str) -> Value:
    """A value as a record keeps it, decoded.

    Raises:
        FormatError: A tag is unknown or malformed.
    """
    return Value(decode(doc, where))


def as_blob(value: Value) -> io.BytesIO:
    """The ``torch.save`` blob DCP's load planners take, built here from a decoded value."""
    buf = io.BytesIO()
    torch.save(value.value, buf)
    buf.seek(0)
    return buf
