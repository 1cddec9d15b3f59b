"""weightvault: save and load neural-network weights correctly when they are shared or frozen.

``import weightvault`` loads no framework. The framework-free API answers questions about
files; each framework has its own module with the same verbs (``weightvault.torch``)::

    import weightvault
    import weightvault.torch as wv

    wv.save(model, "model.safetensors")          # every distinct tensor once
    wv.load(model, "model.safetensors")          # ties, renames, strictness, report
    weightvault.inspect("model.safetensors")     # names, aliases, copies, frozen, bytes
    weightvault.verify("model.safetensors")      # checksums
    weightvault.convert("old.params", "model.safetensors")  # MXNet, torch, Keras, npz
    weightvault.Vault("runs/ft").save(model)     # a checkpoint store, unchanged tensors once
"""

from __future__ import annotations

from ._base.errors import (
    BackendNotInstalled,
    CheckpointExistsError,
    CheckpointNameError,
    CheckpointNotFoundError,
    ChecksumError,
    CollectivesRequiredError,
    DistributedCheckpointError,
    FormatError,
    InvalidLimitError,
    KerasInternalsChanged,
    KeyMismatchError,
    LoadOptionError,
    ModelNotBuiltError,
    NameCollisionError,
    ReservedNameError,
    RuleError,
    ShapeMismatchError,
    SourceDamagedError,
    TieConflictError,
    TrainingStateError,
    UnstorableValueError,
    UnsupportedDtypeError,
    UnsupportedStateError,
    UnsupportedValueError,
    VaultBusyError,
    VaultNotFoundError,
    WeightvaultError,
)
from ._base.reports import LoadReport, OptimizerReport, SaveReport
from ._base.snapshots import SaveHandle
from ._file.checkpoint import Checkpoint
from ._tools.convert import convert
from ._tools.inspect import DiffReport, Inspection, VerifyReport, diff, inspect, verify
from ._vault.records.record import CheckpointRecord
from ._vault.travel.transfer import TransferReport
from ._vault.upkeep.verify import VaultVerifyReport
from ._vault.vault import Vault

__version__ = "0.1.0"

__all__ = [
    "BackendNotInstalled",
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointNameError",
    "CheckpointNotFoundError",
    "CheckpointRecord",
    "ChecksumError",
    "CollectivesRequiredError",
    "DiffReport",
    "DistributedCheckpointError",
    "FormatError",
    "Inspection",
    "InvalidLimitError",
    "KerasInternalsChanged",
    "KeyMismatchError",
    "LoadOptionError",
    "LoadReport",
    "ModelNotBuiltError",
    "NameCollisionError",
    "OptimizerReport",
    "ReservedNameError",
    "RuleError",
    "SaveHandle",
    "SaveReport",
    "ShapeMismatchError",
    "SourceDamagedError",
    "TieConflictError",
    "TrainingStateError",
    "TransferReport",
    "UnstorableValueError",
    "UnsupportedDtypeError",
    "UnsupportedStateError",
    "UnsupportedValueError",
    "Vault",
    "VaultBusyError",
    "VaultNotFoundError",
    "VaultVerifyReport",
    "VerifyReport",
    "WeightvaultError",
    "__version__",
    "convert",
    "diff",
    "inspect",
    "verify",
]
