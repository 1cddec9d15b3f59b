"""Errors raised by weightvault.

Every error subclasses :class:`WeightvaultError` and the builtin a caller would already
catch, so ``except ValueError`` keeps working for code that does not know us::

    WeightvaultError
      FormatError          (ValueError)   the file is not a valid checkpoint
        ChecksumError      (ValueError)   a stored tensor's bytes do not match its checksum
      KeyMismatchError     (ValueError)   names on disk and in the model disagree
      ShapeMismatchError   (ValueError)   same name, different shape or dtype
      TieConflictError     (ValueError)   the model ties names the file holds apart
      RuleError            (ValueError)   a rename rule or pattern is malformed or unusable
      ReservedNameError    (ValueError)   a name or metadata key the file cannot hold
      UnsupportedValueError    (TypeError)        a value to save is not a dense tensor
      CheckpointExistsError    (FileExistsError)  a vault checkpoint name is taken
      CheckpointNotFoundError  (LookupError)      no vault checkpoint has that name
      CheckpointNameError      (ValueError)       a string is not a valid checkpoint name
      SourceDamagedError   (ValueError)   a push or pull found damaged source objects
      BackendNotInstalled  (ImportError)  the framework extra is missing

Messages name the file and the tensor, show capped evidence and suggest one fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = [
    "BackendNotInstalled",
    "CheckpointExistsError",
    "CheckpointNameError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "FormatError",
    "KeyMismatchError",
    "ReservedNameError",
    "RuleError",
    "ShapeMismatchError",
    "TieConflictError",
    "UnsupportedValueError",
    "WeightvaultError",
]

#: How many names an error message lists before it says "... and N more".
EVIDENCE_CAP = 8


def capped(items: Iterable[str], cap: int = EVIDENCE_CAP) -> str:
    """Join ``items`` for a message, keeping at most ``cap`` of them."""
    items = list(items)
    shown = ", ".join(items[:cap])
    if len(items) > cap:
        shown += f", ... and {len(items) - cap} more"
    return shown


class WeightvaultError(Exception):
    """Base class of every error weightvault raises on purpose."""


class FormatError(WeightvaultError, ValueError):
    """The file is not a valid checkpoint: bad header, offsets, dtype, manifest or bytes."""


class ChecksumError(FormatError):
    """A stored tensor's bytes do not match the checksum recorded when it was saved.

    Attributes:
        names: Every stored tensor whose checksum failed.
    """

    def __init__(self, message: str, names: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.names = list(names)


class KeyMismatchError(WeightvaultError, ValueError):
    """Names on disk and in the model disagree after renaming.

    Attributes:
        missing: Names the model has that the file cannot fill.
        unexpected: Names the file holds that the model does not use.
        suggestions: ``{missing_name: closest_unexpected_name}`` for near misses.
        rule: A rename rule that would fix at least one mismatch, if one was found.
            Every name it renames lands on a missing name of matching dtype and shape.
        rule_fixes: The missing names ``rule`` fixes; fewer than ``missing`` means the
            rule is a partial fix (the message says so).
    """

    def __init__(
        self,
        message: str,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        suggestions: dict[str, str] | None = None,
        rule: tuple[str, str] | None = None,
        rule_fixes: Sequence[str] = (),
    ) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.suggestions = dict(suggestions or {})
        self.rule = rule
        self.rule_fixes = list(rule_fixes)


class ShapeMismatchError(WeightvaultError, ValueError):
    """A name exists on both sides but its shape or dtype differs.

    Attributes:
        mismatched: ``(name, on_disk, in_model)`` triples, each side as ``"F32[3, 4]"``.
    """

    def __init__(self, message: str, mismatched: Sequence[tuple[str, str, str]] = ()) -> None:
        super().__init__(message)
        self.mismatched = list(mismatched)


class TieConflictError(WeightvaultError, ValueError):
    """The model shares one tensor between names that the file holds with different values.

    Attributes:
        names: The tied model names whose values on disk disagree.
    """

    def __init__(self, message: str, names: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.names = list(names)


class RuleError(WeightvaultError, ValueError):
    """A rename rule or a name pattern is malformed, not invertible, or matched nothing."""


class ReservedNameError(WeightvaultError, ValueError):
    """A tensor name or metadata key that the file format reserves or that is already used.

    ``__metadata__`` is the safetensors header's own key; ``format`` and ``weightvault``
    are metadata keys with a meaning of their own; and a metadata key equal to a tensor
    name would read as a tie to plain safetensors readers.
    """


class UnsupportedValueError(WeightvaultError, TypeError):
    """A value to save is not a dense tensor: a sparse tensor, or a Python object in a dict."""


class CheckpointExistsError(WeightvaultError, FileExistsError):
    """A vault checkpoint of that name exists already; names are never reused."""


class CheckpointNotFoundError(WeightvaultError, LookupError):
    """No vault checkpoint has that name."""


class CheckpointNameError(WeightvaultError, ValueError):
    """A string is not a valid vault checkpoint name (it could reach outside the vault)."""


class BackendNotInstalled(WeightvaultError, ImportError):
    """An adapter's framework is not installed; the message gives the pip command."""


class UnsupportedDtypeError(WeightvaultError, TypeError):
    """A value's dtype has no safetensors name (for example ``complex128`` or ``object``).

    One class for every adapter: ``weightvault.torch.UnsupportedDtypeError`` and
    ``weightvault.numpy.UnsupportedDtypeError`` are this class.
    """


class InvalidLimitError(WeightvaultError, ValueError):
    """``max_decoded_bytes`` or ``WEIGHTVAULT_MAX_DECODED_BYTES`` is not a byte count."""


class KerasInternalsChanged(WeightvaultError, ImportError):
    """The installed Keras lacks a private helper weightvault.keras names weights with."""


class CollectivesRequiredError(WeightvaultError, NotImplementedError):
    """DCP's per-rank metadata mode: the vault's commit needs rank 0 to see every rank."""


class UnsupportedStateError(WeightvaultError, TypeError):
    """A value of the optimizer, scheduler, RNG or DCP state has no JSON or tensor form."""


#: The name ``weightvault.dcp`` gave the same refusal; one class, two names.
UnstorableValueError = UnsupportedStateError


class TrainingStateError(WeightvaultError, ValueError):
    """The training state in a checkpoint is absent, malformed, or cannot fit the objects."""


class ModelNotBuiltError(WeightvaultError, ValueError):
    """The model has no variables yet (a Keras model that was never built or called)."""


class LoadOptionError(WeightvaultError, ValueError):
    """A load option cannot be honoured for this model (``mmap=True``, or ``tie=True``)."""


class NameCollisionError(WeightvaultError, ValueError):
    """Two different variables of one model would be saved under the same name."""


class SourceDamagedError(FormatError):
    """A push or pull found damaged objects or records on the sending vault: the
    checkpoints that need them were not sent, the others were.

    Attributes:
        report: The transfer's report (``.damaged`` lists each damaged object).
    """

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class VaultBusyError(WeightvaultError, TimeoutError):
    """Another process holds the vault (a running gc); the call waited, or changed nothing."""


class VaultNotFoundError(WeightvaultError, FileNotFoundError):
    """The path holds no vault, and the call only reads one (it never creates a vault)."""


class DistributedCheckpointError(WeightvaultError, RuntimeError):
    """A save or load on several ranks failed on some rank (``weightvault.dcp``, or the
    Trainer callback under ``torchrun``), or the ranks could not agree on one checkpoint.

    DCP reports a rank's failure as ``CheckpointException``, a ``BaseException`` that
    ``except Exception`` lets through; this error is raised from it (``__cause__``), on
    every rank, with each failed rank's error in ``failures``.
    """

    def __init__(self, message: str, failures: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, BaseException] = dict(failures or {})
