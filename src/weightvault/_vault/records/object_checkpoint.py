"""The checkpoint view both vault record kinds share: tensors whose bytes are objects.

A whole-tensor record (:mod:`.checkpoint`) and a DCP record (:mod:`.dcp`) each read as a
:class:`ObjectCheckpoint`: a :class:`~weightvault._file.checkpoint.Checkpoint` whose
tensors are served from vault objects, with the labels gc keeps and verify checks.
"""

from __future__ import annotations

from ..._file.checkpoint import Checkpoint
from ..._file.header import TensorInfo
from ..._file.manifest import Manifest
from ..objects.probe import object_size
from ..store.backend import Store

__all__ = ["ObjectCheckpoint"]


class ObjectCheckpoint(Checkpoint):
    """A checkpoint whose bytes are vault objects, whatever the record's kind.

    Args:
        store: The vault's store.
        where: The record, for messages.
        stored: The tensors, as a single file's header lists them.
        manifest: Their manifest.
        framework: The ``"format"`` the header records.
        objects: ``{label: digest}``, one label per object the checkpoint needs (a stored
            tensor, or a DCP chunk): gc keeps and verify checks each of them.
        sizes: ``{label: nbytes}``, what each of those objects must hold.
    """

    def __init__(
        self,
        store: Store,
        where: str,
        stored: dict[str, TensorInfo],
        manifest: Manifest,
        *,
        framework: str | None,
        objects: dict[str, str],
        sizes: dict[str, int],
    ) -> None:
        self.store = store
        self.objects = objects
        self._sizes = sizes
        self._framework = framework
        super().__init__(where, stored, manifest)

    @property
    def framework(self) -> str | None:
        return self._framework

    @property
    def container(self) -> str:
        return "vault"

    def object_nbytes(self, label: str) -> int:
        """The size the object named under ``label`` in :attr:`objects` must have."""
        return self._sizes[label]

    def missing(self) -> dict[str, str]:
        """``{label: problem}`` for objects that are absent or of the wrong size."""
        out = {}
        for label, digest in self.objects.items():
            size = object_size(self.store, digest, self._sizes[label])
            if size is None:
                out[label] = "object missing"
            elif size != self._sizes[label]:
                out[label] = f"object holds {size} bytes, expected {self._sizes[label]}"
        return out

    def fetch(self) -> None:
        """Bring the objects into memory now, concurrently (used for remote stores)."""
        raise NotImplementedError
