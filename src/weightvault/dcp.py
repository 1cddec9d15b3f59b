"""Checkpoints of sharded models on many ranks, through torch.distributed.checkpoint (DCP).

DCP plans and reshards; weightvault stores. Every rank writes the chunks it holds as
content-addressed vault objects, so a chunk that did not change since the last checkpoint
(a frozen backbone) is not written again, and lists them in a chunk table of its own.
When every rank's objects are durable, rank 0 commits one small JSON index naming the
tables: the checkpoint exists from that moment, or not at all. Nothing is pickled,
neither the metadata nor the non-tensor values (they are stored as JSON). A load reads
the index and only the tables and byte ranges its shards need, straight into the
destination tensors, and a box several ranks need (replicas) is read by one of them.

Two levels::

    import weightvault.dcp as wdcp

    # collective: every rank calls it
    wdcp.save(model, "runs/ft", optimizer=opt)           # FSDP2, DDP, TP, plain
    wdcp.load(model, "runs/ft", optimizer=opt)           # on any number of ranks
    wdcp.async_save(model, "runs/ft", optimizer=opt, staging_bytes=2 << 30)

    # or DCP's own calls, with the vault as storage
    dcp_save(state, storage_writer=wdcp.VaultWriter("runs/ft", "step-100"),
             planner=wdcp.VaultSavePlanner())
    dcp.load(state, storage_reader=wdcp.VaultReader("runs/ft", "step-100"))

:class:`VaultSavePlanner` stores a tied tensor once: two names whose local shards are
the same memory on every rank become one stored tensor and a recorded tie. The record also
holds a plain safetensors header of the model's tensors, so one process without
torch.distributed loads it with :meth:`weightvault.Vault.load` and exports it with
:meth:`weightvault.Vault.export`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ._base.errors import (
    DistributedCheckpointError,
    TrainingStateError,
    UnstorableValueError,
    capped,
)
from ._dcp.async_save import async_group, start
from ._dcp.index import VaultLoadPlanner
from ._dcp.peers import FIX, OUTCOME, broken
from ._dcp.planner import VaultSavePlanner
from ._dcp.reader import ReadStats, SharingReader, VaultReader
from ._dcp.resume import Flags, apply_flags, fqn, install_state, optimizer_template
from ._dcp.writer import VaultWriter
from ._ranks import agree
from ._vault.records.names import record_key
from ._vault.records.record import CheckpointRecord
from ._vault.vault import Vault, VaultLike, as_vault

__all__ = [
    "ReadStats",
    "UnstorableValueError",
    "VaultReader",
    "VaultSavePlanner",
    "VaultWriter",
    "async_save",
    "load",
    "save",
]

#: Keys of the state :func:`save` hands to DCP; the model's part is what Vault.load reads.
MODEL, OPTIM = "model", "optim"


# -- collective wrappers -------------------------------------------------------------------


def _frozen(model: nn.Module, keys: set[str]) -> list[str]:
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        name = fqn(name)
        if name in keys and not p.requires_grad and name not in out:
            out.append(name)
    return out


def _broadcast(value: Any, group: Any = None) -> Any:
    if _no_dist():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _rank() -> int:
    return 0 if _no_dist() else dist.get_rank()


def _collective(what: str, run: Callable[[], Any]) -> None:
    """Run DCP's ``save`` or ``load``; a rank's failure becomes an ``Exception``.

    DCP raises ``CheckpointException``, a ``BaseException``, which ``except Exception``
    (training loops, retry wrappers) would let through; and a rank that dies makes the
    others' collectives raise a bare ``RuntimeError``. Both become
    :class:`~weightvault.DistributedCheckpointError`.
    """
    try:
        run()
    except DistributedCheckpointError:
        raise
    except RuntimeError as e:
        # DCP turns a rank's own error into CheckpointException; what else escapes is its
        # collectives failing (gloo's "Connection reset by peer" when a rank died).
        raise broken(what, e) from e
    except CheckpointException as e:
        failures = {r: f[0] if isinstance(f, tuple) else f for r, f in e.failures.items()}
        shown = capped(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(failures.items()))
        raise DistributedCheckpointError(
            f"{what} failed on {len(failures)} rank(s): {shown}; fix that rank's error "
            "(the full tracebacks are in this error's __cause__) and call it again",
            failures,
        ) from e


def _save_setup(
    model: nn.Module, v: Vault, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], VaultSavePlanner]:
    """The state DCP saves, and the planner: ties, frozen names, and one plan cache per
    checkpointer (this vault, this model and optimizer), so a save whose local plans did
    not change reuses the coordinator's last global plan."""
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    state: dict[str, Any] = {MODEL: msd}
    if optimizer is not None:
        state[OPTIM] = osd
    planner = VaultSavePlanner(
        [f"{MODEL}.{n}" for n in _frozen(model, set(msd))],
        [f"{MODEL}.{n}" for n in msd],
        model_prefix=f"{MODEL}.",
        enable_plan_caching=True,
        cache_key=f"wdcp.save|{v.url}|{id(model)}|{id(optimizer)}",
    )
    return state, planner


def _committed(writer: VaultWriter, group: Any = None) -> CheckpointRecord:
    """The record the coordinator committed, on every rank (no rank reads it again)."""
    record = _broadcast(writer.record, group)
    if not isinstance(record, CheckpointRecord):  # DCP ran finish, or raised everywhere
        raise DistributedCheckpointError(f"{writer.vault.url}: the coordinator committed no record")
    return record


def save(
    model: nn.Module,
    vault: VaultLike,
    name: str | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    metadata: Mapping[str, str] | None = None,
) -> CheckpointRecord:
    """Commit a checkpoint of a (possibly sharded) model, and its optimizer, on every rank.

    Collective: every rank of the default process group calls it with its own shards.
    Names and optimizer state are mapped by DCP's ``get_state_dict``, so the checkpoint
    loads into any parallelism. Tied tensors are stored once, frozen tensors keep their
    flag (and any optimizer state they had), and chunks already in the vault are not
    written again. A save whose local plans equal the last save's (same model, same
    vault) reuses the coordinator's global plan.

    Args:
        model: The model (FSDP2 ``fully_shard``, DDP, tensor parallel or plain).
        vault: A :class:`~weightvault.Vault`, or its root or URL.
        name: The checkpoint's name; by default the next number.
        optimizer: Its optimizer, saved alongside.
        metadata: Your ``str -> str`` metadata.

    Returns:
        The committed record, on every rank.

    Raises:
        CheckpointExistsError: ``name`` is already taken.
        DistributedCheckpointError: A rank failed; nothing was committed. Raised on
            every rank within moments (no rank waits for a failed one), naming the failed
            ranks: ``failures`` holds each one's error, ``__cause__`` DCP's exception. A
            rank that failed before DCP started (making its state dict or writer)
            raises its own error instead.

    Example:
        >>> try:
        ...     wdcp.save(model, "runs/ft", optimizer=opt)
        ... except weightvault.WeightvaultError as e:   # a failed rank included
        ...     log.warning("checkpoint skipped: %s", e)
    """
    v = as_vault(vault)
    what = f"{v.url}: saving checkpoint {name or '(next)'}"
    error = None
    try:
        state, planner = _save_setup(model, v, optimizer)
        writer = VaultWriter(v, name, metadata=metadata)
    except Exception as e:  # every rank must reach the vote, or the others wait in DCP
        error = e
    agree(error, what, FIX, outcome=OUTCOME, raise_own=True, broken=broken)
    _collective(
        what,
        lambda: dcp_save(state, storage_writer=writer, planner=planner, no_dist=_no_dist()),
    )
    return _committed(writer)


def async_save(
    model: nn.Module,
    vault: VaultLike,
    name: str | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    metadata: Mapping[str, str] | None = None,
    staging_bytes: int | None = None,
) -> Future[CheckpointRecord]:
    """Start :func:`save`; return once the state may change again, and finish behind.

    Collective, like :func:`save`. Each rank copies what it will write after returning
    into host memory; with ``staging_bytes=N`` it holds at most ``N`` bytes of copies:
    the chunks beyond that are written before this call returns (so the call blocks
    longer, and host memory stays bounded). The rest of the save, its collectives
    included, runs on a background thread over a gloo group of its own.

    Args:
        model: The model, as for :func:`save`.
        vault: A :class:`~weightvault.Vault`, or its root or URL.
        name: The checkpoint's name; by default the next number.
        optimizer: Its optimizer, saved alongside.
        metadata: Your ``str -> str`` metadata.
        staging_bytes: Host bytes this rank may hold for copies (``None``: the whole
            state, as DCP's own stager copies it).

    Returns:
        A future of the committed record; ``result()`` raises
        :class:`~weightvault.DistributedCheckpointError` if a rank failed.

    Example:
        >>> pending = wdcp.async_save(model, "runs/ft", optimizer=opt, staging_bytes=2 << 30)
        >>> train_step()                                 # the checkpoint is unaffected
        >>> pending.result().name
        '000008'
    """
    v = as_vault(vault)
    error = None
    try:
        state, planner = _save_setup(model, v, optimizer)
        budget = sys.maxsize if staging_bytes is None else max(int(staging_bytes), 0)
        writer = VaultWriter(v, name, metadata=metadata, staging_bytes=budget)
    except Exception as e:  # every rank must reach the vote, or the others wait in DCP
        error = e
    agree(
        error,
        f"{v.url}: starting the save of checkpoint {name or '(next)'}",
        FIX,
        outcome=OUTCOME,
        raise_own=True,
        broken=broken,
    )
    group = async_group()

    def run() -> CheckpointRecord:
        _collective(
            f"{v.url}: saving checkpoint {name or '(next)'} in the background",
            lambda: dcp_save(
                state, storage_writer=writer, planner=planner, process_group=group,
                no_dist=group is None,
            ),
        )  # fmt: skip
        return _committed(writer, group)

    return start(run, writer.staged)


def load(
    model: nn.Module,
    vault: VaultLike,
    name: str = "latest",
    *,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    restore_frozen: bool = True,
) -> ReadStats:
    """Fill a (possibly sharded) model, and its optimizer, from a vault checkpoint.

    Collective. The checkpoint may have been saved on any number of ranks: DCP reshards,
    and each rank reads only the byte ranges its shards need. A fresh optimizer works:
    parameters get the checkpoint's frozen flags before the optimizer's template is made,
    so it asks for exactly the state the checkpoint holds, frozen parameters' included,
    and nothing is made up for the rest.

    Args:
        model: The model, already sharded the way you want it.
        vault: A :class:`~weightvault.Vault`, or its root or URL.
        name: The checkpoint (``"latest"`` by default, resolved once, on rank 0).
        optimizer: Its optimizer, to fill too.
        strict: Raise when the model has a tensor the checkpoint lacks.
        restore_frozen: Keep the checkpoint's frozen flags on the parameters it holds
            (parameters it does not hold keep theirs); ``False`` puts the model's back.

    Returns:
        This rank's :class:`ReadStats`: bytes read from the store, bytes received from
        the other ranks (a box several ranks need is read once), record bytes read.

    Raises:
        DistributedCheckpointError: A rank failed, at any step: raised on every rank
            within moments, naming the failed ranks in ``failures``. A rank that failed
            before DCP's load (reading the record, the frozen flags, the state dicts) or
            after it (receiving replicas, filling the model) raises its own error instead.
        TrainingStateError: ``optimizer`` is given, but the checkpoint holds weights only
            (its optimizer state was dropped by ``retain(training_state_last=)``); raised
            on every rank before anything is read.

    Example:
        >>> model = build_model()                    # every parameter trainable
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> wdcp.load(model, "runs/ft", optimizer=opt)
        >>> model.backbone.weight.requires_grad      # frozen, as saved
        False
    """
    v = as_vault(vault)
    resolved = _resolve_on_rank0(v, name)
    what = f"{v.url}: loading checkpoint {resolved}"
    reader = SharingReader(v, resolved)
    flags: Flags | None = None
    error: Exception | None = None
    try:
        metadata = reader.prefetch()
        if optimizer is not None and reader.weights_only:  # every rank read the same record
            raise TrainingStateError(
                f"{v.url}/{record_key(resolved)} holds weights only: its optimizer "
                "state was dropped (training_state_last); load it without optimizer=, or "
                "resume from a checkpoint that kept its training state (the newest ones)"
            )
        flags = apply_flags(model, metadata, set(reader.frozen), f"{MODEL}.")
        fresh = optimizer is not None and not optimizer.state
        msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
        state: dict[str, Any] = {MODEL: msd}
        added: dict[str, dict[str, torch.Tensor]] = {}
        if optimizer is not None:
            added = optimizer_template(model, osd, metadata, f"{OPTIM}.", fresh=fresh)
            state[OPTIM] = osd
        planner = VaultLoadPlanner(allow_partial_load=not strict)
    except Exception as e:  # every rank must reach the vote, or the others wait in DCP
        error = e
    try:
        agree(error, what, FIX, outcome=OUTCOME, raise_own=True, broken=broken)
        _collective(
            what,
            lambda: dcp_load(state, storage_reader=reader, planner=planner, no_dist=_no_dist()),
        )
        # Every rank read its part (DCP's last gather said so): the replicas go now.
        error = None
        try:
            try:
                reader.exchange()
            except RuntimeError as e:  # isend/irecv: a rank died since the gather
                raise broken(what, e) from e
            _set_state(model, optimizer, state, strict, added)
        except Exception as e:
            error = e
        agree(error, what, FIX, outcome=OUTCOME, raise_own=True, broken=broken)
    except BaseException:
        if flags is not None:
            flags.restore()  # the load failed: the model keeps its own flags
        raise
    if not restore_frozen and flags is not None:
        flags.restore()
    return reader.stats


def _set_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    strict: bool,
    added: dict[str, dict[str, torch.Tensor]],
) -> None:
    """Put the loaded state into the model and optimizer."""
    set_model_state_dict(model, state[MODEL], options=StateDictOptions(strict=strict))
    if optimizer is not None:
        # Not strict: what the template lacks was never saved (see optimizer_template);
        # the load itself was strict about everything the template asked for.
        lenient = StateDictOptions(strict=False)
        set_optimizer_state_dict(model, optimizer, state[OPTIM], options=lenient)
        install_state(model, optimizer, added)


def _resolve_on_rank0(v: Vault, name: str) -> str:
    """``name`` resolved once, on rank 0, for every rank; its error raised on every rank."""
    got: Any = None
    if _rank() == 0:
        try:
            got = v.resolve(name)
        except Exception as e:  # every rank raises it, rather than wait for rank 0
            got = e
    got = _broadcast(got)
    if isinstance(got, BaseException):
        raise got
    return str(got)
