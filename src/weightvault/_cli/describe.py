"""What ``inspect`` and ``vault show`` print about one checkpoint: its names and its
training state.

A checkpoint saved with ``optimizer=``, ``scheduler=`` or ``rng=True`` stores tensors that
are no model name (under a reserved prefix, or outside a DCP record's model); they are
listed as training state, never as a model tensor's storage.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from .._base.progress import human
from .._file.checkpoint import Checkpoint
from .._file.layout import OPTIM_PREFIX, RNG_PREFIX, is_training
from .._tools.inspect import Inspection, inspect
from .._vault.records.dcp import DcpCheckpoint
from .common import print_json, table

#: How the first line of ``inspect`` names a file a foreign reader decoded.
FOREIGN_NAMES = {
    "mxnet": "MXNet .params",
    "pt": "PyTorch pickle",
    "torch": "PyTorch pickle",
    "numpy": "NumPy",
    "keras": "Keras .weights.h5",
}


#: Where a DCP record made by ``weightvault.dcp.save`` keeps per-parameter optimizer state.
DCP_OPTIM = "optim.state."


@dataclass
class TrainingTensor:
    """One stored training-state tensor (optimizer slot, RNG state, DCP state)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass
class TrainingState:
    """Optimizer, scheduler and RNG state stored beside a checkpoint's model tensors.

    Attributes:
        optimizer: The optimizer's class (``"AdamW"``), ``"DCP"`` for a DCP record's
            optimizer state, or ``None``.
        parameters: How many parameters have optimizer state.
        slots: The optimizer's per-parameter state keys (``exp_avg``, ...).
        scheduler: The LR scheduler's class, or ``None``.
        rng: The RNG states held (``torch``, ``python``, ``numpy``, ...).
        tensors: Every stored training tensor, by its stored name.
        nbytes: Their bytes.
    """

    optimizer: str | None = None
    parameters: int = 0
    slots: list[str] = field(default_factory=list)
    scheduler: str | None = None
    rng: list[str] = field(default_factory=list)
    tensors: dict[str, TrainingTensor] = field(default_factory=dict)
    nbytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.tensors or self.optimizer or self.scheduler or self.rng)


def _class(section: Any) -> str | None:
    """The ``"class"`` a training section records, if it is a readable string."""
    if isinstance(section, dict) and isinstance(section.get("class"), str):
        return str(section["class"])
    return None


def training_state(ckpt: Checkpoint) -> TrainingState:
    """The training state ``ckpt`` stores; empty for a weights-only checkpoint.

    The manifest's training section is read as untrusted input: anything it does not
    hold in the expected shape is left out, never raised.
    """
    if isinstance(ckpt, DcpCheckpoint):
        return _dcp_state(ckpt)
    out = TrainingState()
    params: set[str] = set()
    for name, info in ckpt.stored.items():
        if not is_training(name):
            continue
        out.tensors[name] = TrainingTensor(info.dtype, tuple(info.shape), info.nbytes)
        out.nbytes += info.nbytes
        if name.startswith(OPTIM_PREFIX) and "/" in name[len(OPTIM_PREFIX) :]:
            param, slot = name[len(OPTIM_PREFIX) :].rsplit("/", 1)
            params.add(param)
            out.slots += [] if slot in out.slots else [slot]
        elif name.startswith(RNG_PREFIX):
            which = name[len(RNG_PREFIX) :].split("/")[0]
            out.rng += [] if which in out.rng else [which]
    section = ckpt.manifest.training if isinstance(ckpt.manifest.training, dict) else {}
    out.optimizer = _class(section.get("optimizer"))
    optim = section.get("optimizer")
    if isinstance(optim, dict) and isinstance(optim.get("params"), dict):
        params.update(str(p) for p in optim["params"])
    out.parameters = len(params)
    out.scheduler = _class(section.get("scheduler"))
    rng = section.get("rng")
    if isinstance(rng, dict):
        out.rng += [str(k) for k in rng if str(k) not in out.rng]
    return out


def _dcp_state(ckpt: DcpCheckpoint) -> TrainingState:
    """A DCP record's tensors outside its model (optimizer state and the like)."""
    out = TrainingState()
    params: set[str] = set()
    for fqn, t in ckpt.tensors.items():
        if fqn.startswith(ckpt.prefix):
            continue
        nbytes = sum(c.nbytes(t.dtype) for c in t.chunks)
        out.tensors[fqn] = TrainingTensor(t.dtype, tuple(t.shape), nbytes)
        out.nbytes += nbytes
        if fqn.startswith(DCP_OPTIM) and "." in fqn[len(DCP_OPTIM) :]:
            param, slot = fqn[len(DCP_OPTIM) :].rsplit(".", 1)
            params.add(param)
            out.slots += [] if slot in out.slots else [slot]
    if params:
        out.optimizer, out.parameters = "DCP", len(params)
    return out


def model_stored_bytes(info: Inspection, training: TrainingState) -> int:
    """Bytes of the model's own stored tensors (training state left out)."""
    inside = sum(t.nbytes for n, t in training.tensors.items() if n in info.stored)
    return info.stored_bytes - inside


def dedupe_savings(info: Inspection, training: TrainingState) -> int:
    """Bytes ``dedupe_copies=True`` would leave out, training-state copies included."""
    sizes = {n: t.nbytes for n, t in info.tensors.items()}
    sizes.update((n, t.nbytes) for n, t in training.tensors.items())
    return sum(sizes.get(n, 0) for n in info.duplicates)


def inspection_doc(info: Inspection, training: TrainingState) -> dict[str, Any]:
    """The ``--json`` document of one checkpoint: the inspection and its training state."""
    doc = asdict(info)
    doc["bytes_saved"] = info.logical_bytes - model_stored_bytes(info, training)
    doc["dedupe_savings"] = dedupe_savings(info, training)
    doc["training"] = asdict(training) if training else None
    return doc


def describe(ckpt: Checkpoint) -> tuple[Inspection, TrainingState]:
    """Inspect an open checkpoint and read its training state."""
    return inspect(ckpt), training_state(ckpt)


def show(
    info: Inspection,
    training: TrainingState,
    heading: str,
    out: TextIO,
    *,
    as_json: bool,
    extra: dict[str, Any] | None = None,
) -> None:
    """Print one checkpoint: ``heading`` and the table, or ``extra`` and the inspection
    as one JSON document."""
    if as_json:
        print_json({**(extra or {}), **inspection_doc(info, training)}, out)
        return
    out.write(heading + "\n\n")
    print_inspection(info, training, out)


def kind_of(info: Inspection) -> str:
    """How the first line of ``inspect`` names the file's kind."""
    if info.format_version:
        return f"weightvault v{info.format_version}"
    if info.container == "safetensors":
        return "plain safetensors"
    label = FOREIGN_NAMES.get(info.container, info.container)
    return f"{label} file, read without its framework"


def print_inspection(info: Inspection, training: TrainingState, out: TextIO) -> None:
    """The table of names grouped by the tensor they share, the totals, and training state."""
    rows = [["name", "dtype", "shape", "size", "held as"]]
    members: dict[str, list[str]] = {}
    for name, rec in info.tensors.items():
        if rec.kind != "stored":
            members.setdefault(rec.stored, []).append(name)
    for name in info.stored:
        t = info.tensors.get(name)
        if name in training.tensors:
            continue  # listed below, with the rest of the training state
        if t is None:  # storage that several views share, not itself a model name
            size = human(info.shared_storage.get(name, 0))
            rows.append([name, "U8", "", size, "storage shared by views"])
        else:
            flag = " (frozen)" if name in info.frozen else ""
            if name in info.duplicates:
                flag += f", equal to {info.duplicates[name]}"
            rows.append([name, t.dtype, str(list(t.shape)), human(t.nbytes), "stored" + flag])
        for other in members.get(name, []):
            o = info.tensors[other]
            how = {"alias": "alias of", "copy": "copy of", "view": "view of"}[o.kind]
            rows.append([f"  {other}", o.dtype, str(list(o.shape)), "0 B", f"{how} {name}"])
    table(rows, out)
    saved = info.logical_bytes - model_stored_bytes(info, training)
    out.write(
        f"\nlogical {human(info.logical_bytes)}, stored {human(model_stored_bytes(info, training))}"
        f", saved by deduplication {human(saved)}; {counts(info)}\n"
    )
    # Training state's copies (AdamW's equal "step" scalars) are no model name: not here.
    copies = [n for n in info.duplicates if n in info.tensors]
    if copies:
        out.write(
            f"{len(copies)} copies are stored under their own names for plain readers; "
            f"dedupe_copies=True would save {human(info.dedupe_savings)} more\n"
        )
    if training:
        print_training(training, out)
    if info.metadata:
        out.write(f"metadata: {json.dumps(info.metadata)}\n")


def counts(info: Inspection) -> str:
    """How many model names are aliases, copies, views and frozen (training state's
    own copies, such as AdamW's equal step counts, are not model names)."""
    kinds = [rec.kind for rec in info.tensors.values()]
    return (
        f"{kinds.count('alias')} aliases, {kinds.count('copy')} copies, "
        f"{kinds.count('view')} views, {len(info.frozen)} frozen"
    )


def print_training(training: TrainingState, out: TextIO) -> None:
    """One line each for the optimizer, scheduler and RNG state a checkpoint holds."""
    how = (
        "weightvault.dcp.load(..., optimizer=)"
        if training.optimizer == "DCP"
        else "load(..., optimizer=, scheduler=, rng=True)"
    )
    out.write(
        f"training state: {len(training.tensors)} tensors, {human(training.nbytes)} "
        f"(not model names; {how} restores it)\n"
    )
    if training.optimizer:
        slots = f" ({', '.join(training.slots)})" if training.slots else ""
        per = f" for {training.parameters} parameters" if training.parameters else ""
        out.write(f"  optimizer  {training.optimizer}{per}{slots}\n")
    if training.scheduler:
        out.write(f"  scheduler  {training.scheduler}\n")
    if training.rng:
        out.write(f"  rng        {', '.join(training.rng)}\n")


__all__ = [
    "TrainingState",
    "describe",
    "inspection_doc",
    "kind_of",
    "print_inspection",
    "show",
    "training_state",
]
