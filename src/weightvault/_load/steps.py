"""The framework-free steps every adapter repeats around the load (and save) plans.

Each adapter's ``load_file`` hands out every name of a checkpoint as its framework's
array. What an eager read may cost, when checksums are checked, and which names share one
value are the same for all of them, so they are decided here: aliases share one value
(they are one tensor), a copy gets its own, and a view is a view of its base where the
framework can express one (:func:`values_by_group`). Every adapter's ``save`` writes its
sources the same way too (:func:`save_file`).

Example:
    >>> with opened("model.safetensors") as ckpt:
    ...     tensors = values_by_group(
    ...         ckpt, False, "tensors", None, False,
    ...         stored=lambda s: stored_tensor(ckpt, s, mmap=False), value=entry_tensor,
    ...         own=torch.clone,
    ...     )
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .._base.reports import SaveReport
from .._base.types import PathLike
from .._file.checkpoint import Checkpoint, Entry
from .._file.sharing import Source
from .._file.writer import save_sources

T = TypeVar("T")
B = TypeVar("B")

#: What an adapter saves: ``(sources, names left out, the manifest's training section)``.
Found = tuple[list[Source], list[str], dict[str, Any] | None]


def save_file(
    path: PathLike,
    found: Found,
    framework: str,
    metadata: Mapping[str, str] | None,
    checksum: bool,
    dedupe_copies: bool,
) -> SaveReport:
    """Write what an adapter found to ``path``, as its public ``save`` was asked to.

    Raises:
        ReservedNameError: A name or metadata key is reserved.
    """
    sources, skipped, training = found
    return save_sources(
        path,
        sources,
        framework=framework,
        metadata=dict(metadata or {}),
        checksum=checksum,
        dedupe_copies=dedupe_copies,
        skipped=skipped,
        training=training,
    )


def shared_cost(ckpt: Checkpoint, *, mapped: bool) -> int:
    """Bytes a read allocates where aliases share a value and views are views of their base.

    Every copy takes memory of its own; every stored tensor does too, unless it is
    ``mapped`` (values over the file mapping).
    """
    copies = {e.group: e.nbytes for e in ckpt.entries.values() if ckpt.owns_memory(e)}
    cost = sum(copies.values())
    if not mapped:
        cost += sum(t.nbytes for t in ckpt.stored.values())
    return cost


def separate_cost(ckpt: Checkpoint) -> int:
    """Bytes a read allocates where every name is an array of its own.

    Each name's value, plus each stored tensor that views are read from.
    """
    entries = [ckpt.entry(n) for n in ckpt.names]
    return sum(e.nbytes for e in entries) + _view_bases(ckpt, entries)


def grouped_cost(ckpt: Checkpoint) -> int:
    """Bytes a read allocates where the names of one tensor share a value: one per alias
    group, and each stored tensor that views are read from."""
    entries = [ckpt.entry(n) for n in ckpt.names]
    groups = {e.group: e.nbytes for e in entries}
    return sum(groups.values()) + _view_bases(ckpt, entries)


def _view_bases(ckpt: Checkpoint, entries: list[Entry]) -> int:
    return sum(ckpt.stored[s].nbytes for s in {e.stored for e in entries if e.view is not None})


def start_reading(
    ckpt: Checkpoint, cost: int, what: str, max_bytes: int | None, verify: bool
) -> None:
    """Refuse a read out of all proportion to the file, then check checksums if asked.

    Args:
        ckpt: The open checkpoint.
        cost: Bytes the read will allocate (:func:`shared_cost`, :func:`separate_cost`).
        what: What is read (``"tensors"``, ``"arrays"``), for the message.
        max_bytes: The caller's cap; by default the checkpoint's
            (:func:`~weightvault._file.checkpoint.materialize_limit`).
        verify: Check every checksum first.

    Raises:
        FormatError: The read would allocate more than the cap.
        ChecksumError: ``verify`` and a tensor's bytes are damaged.
    """
    ckpt.materializing(cost, f"reading {len(ckpt.names)} {what}", max_bytes)
    if verify:
        ckpt.verify()


def by_group(
    ckpt: Checkpoint, value: Callable[[Entry], T], own: Callable[[T], T] | None = None
) -> dict[str, T]:
    """Every name of ``ckpt`` with its value; the names of one tensor share one value.

    Args:
        ckpt: The open checkpoint.
        value: The value of a name, built once per tensor (group).
        own: Gives a copy memory of its own (``clone``), where ``value`` may share its
            stored tensor's memory; ``None`` if every value is fresh already.

    Example:
        >>> tensors = by_group(ckpt, lambda e: read_tensor(ckpt, e.name), own=torch.clone)
        >>> tensors["lm_head.weight"] is tensors["wte.weight"]
        True
    """
    groups: dict[str, T] = {}
    out: dict[str, T] = {}
    for name in ckpt.names:
        e = ckpt.entry(name)
        if e.group not in groups:
            v = value(e)
            groups[e.group] = own(v) if own is not None and ckpt.owns_memory(e) else v
        out[name] = groups[e.group]
    return out


def values_by_group(
    ckpt: Checkpoint,
    mapped: bool,
    what: str,
    max_bytes: int | None,
    verify: bool,
    *,
    stored: Callable[[str], B],
    value: Callable[[Entry, B], T],
    own: Callable[[T], T],
) -> dict[str, T]:
    """What ``load_file`` does once the file is open, where values are views of their
    stored tensors: every name with its value, aliases sharing one, copies their own.

    Args:
        ckpt: The open checkpoint.
        mapped: Whether ``stored`` builds its tensors over the file mapping.
        what: What is read, for messages (``"tensors"``).
        max_bytes: The caller's cap on what is allocated (see :func:`start_reading`).
        verify: Check every checksum first.
        stored: A stored tensor by name, built once each.
        value: A name's value over its stored tensor (itself, or a view of it).
        own: Gives a copy memory of its own.

    Raises:
        FormatError: The read would allocate more than the cap.
        ChecksumError: ``verify`` and a tensor's bytes are damaged.
    """
    start_reading(ckpt, shared_cost(ckpt, mapped=mapped), what, max_bytes, verify)
    bases = {s: stored(s) for s in ckpt.stored}
    return by_group(ckpt, lambda e: value(e, bases[e.stored]), own)
