"""What a save or a load did, as plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SaveReport:
    """What :func:`save` wrote.

    Attributes:
        path: The file written.
        stored: Names physically stored, in file order.
        aliases: ``{alias: kept_name}`` for tied names.
        copies: ``{copy: stored_name}`` for distinct tensors with equal bytes.
        views: Names stored as views into another stored tensor.
        duplicates: ``{name: equal_name}`` for copies stored again because
            ``dedupe_copies=False`` (the default), so plain readers see them.
        dedupe_savings: Tensor bytes ``dedupe_copies=True`` would have left out.
        frozen: Names saved as frozen.
        skipped: State-dict entries that are not tensors and were left out.
        logical_bytes: What the tensors take if every name is written out.
        stored_bytes: The tensor bytes actually written.
        file_bytes: The size of the file, header included.
    """

    path: str
    stored: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    copies: dict[str, str] = field(default_factory=dict)
    views: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    logical_bytes: int = 0
    stored_bytes: int = 0
    file_bytes: int = 0
    duplicates: dict[str, str] = field(default_factory=dict)
    dedupe_savings: int = 0

    @property
    def bytes_saved(self) -> int:
        """Bytes deduplication saved against writing every name out."""
        return self.logical_bytes - self.stored_bytes


@dataclass
class LoadReport:
    """What :func:`load` did to the model.

    Attributes:
        path: The file read.
        loaded: Model names that received values.
        renamed: ``(name_on_disk, model_name)`` for names a rule (or ``"auto"``) changed.
        missing: Model names the file could not fill (left as they were).
        unexpected: Names on disk the model does not use.
        mismatched: ``(name, on_disk, in_model)`` that were skipped (``strict=False``).
        untied: Groups of model names that are tied in the file but separate in the model;
            each got the same values. With ``tie=True`` they are tied instead.
        tied: Groups of model names that ``tie=True`` made share one tensor.
        frozen: Model names frozen by ``restore_frozen=True``.
        optimizer: What the optimizer received, when ``optimizer=`` was given.
        restored: The rest of the training state restored: ``"scheduler"``,
            ``"rng:python"``, ``"rng:numpy"``, ``"rng:torch"``, ``"rng:cuda"``.
    """

    path: str
    loaded: list[str] = field(default_factory=list)
    renamed: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, str, str]] = field(default_factory=list)
    untied: list[tuple[str, ...]] = field(default_factory=list)
    tied: list[tuple[str, ...]] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    optimizer: OptimizerReport | None = None
    restored: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every model name was filled and nothing on disk went unused."""
        bad = self.missing or self.unexpected or self.mismatched
        return not bad and (self.optimizer is None or self.optimizer.ok)


@dataclass
class OptimizerReport:
    """What a load gave the optimizer, by parameter name (the model's first name of each).

    Attributes:
        loaded: Parameters that received their saved state.
        without_state: Parameters that received none: unknown to the checkpoint, never
            stepped when it was saved, or of another shape.
        missing: Parameters the checkpoint has no record of (a subset of ``without_state``).
        unused: Names on disk whose saved state no parameter of the optimizer took.
        renamed: ``(name_on_disk, model_name)`` for state a rule moved.
        mismatched: ``(name, shape_on_disk, shape_in_model)`` skipped (``strict=False``).
        groups_kept: Groups whose parameters come from saved groups with different
            hyperparameters; they keep their own.
    """

    loaded: list[str] = field(default_factory=list)
    without_state: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    renamed: list[tuple[str, str]] = field(default_factory=list)
    mismatched: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    groups_kept: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every parameter was known to the checkpoint and no saved state went unused."""
        return not (self.missing or self.unused or self.mismatched)
