"""The vault: a checkpoint store that keeps every distinct tensor once across a run.

Layout under the root (a folder, or any fsspec URL such as ``s3://bucket/run1``)::

    vault.json                    format marker (:mod:`.store.identity`), written by the
                                  first save
    objects/<h[:2]>/<h>           one tensor's bytes, named by the blake3 hash of its raw
                                  bytes (:mod:`.objects`)
    checkpoints/<name>.json       a committed checkpoint (:mod:`.records`): the safetensors
                                  header it would have as a single file, plus the object of
                                  each stored tensor
    intents/<id>.json             objects an in-flight save is about to reference
    gc/<id>.json                  a gc in progress (its heartbeat: pid, host, time)
    trash/<id>/<h>                objects gc <id> took out of objects/ and may still put back

A save follows the one commit protocol of :mod:`.writing.commit` (intent, wait for gc,
objects, one exclusive create of the record); :mod:`.upkeep.gc` explains why no gc,
however it stalls, deletes an object a checkpoint needs. :class:`Vault` is the public
face of those folders and holds no policy of its own: saving, loading and moving are
here, listing and labelling in :mod:`.records.methods`, compaction, retention, gc and
verify in :mod:`.upkeep.methods`.
"""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .._base.progress import Progress as Bar
from .._base.snapshots import SnapshotPool
from .._file.checkpoint import Checkpoint
from .._file.sharing import Source
from .._tools.convert import rewrite
from .adapters import Adapter, adapter_for
from .objects.codec import DEFAULT, codec_named
from .objects.encoding import DELTA_CHAIN, Storage
from .records.checkpoint import VaultCheckpoint, open_record
from .records.dcp import DcpCheckpoint
from .records.methods import RecordMethods
from .records.reading import check_free, read_doc
from .records.record import CheckpointRecord
from .store.backend import open_store
from .store.identity import create_vault, holds_vault, require_vault
from .travel.moving import moved
from .travel.transfer import TransferReport
from .upkeep.compactor import Compactor
from .upkeep.methods import UpkeepMethods
from .upkeep.pacing import GC_PACE, Timing
from .upkeep.retention import Retention
from .walk import walk, walk_order
from .writing.deferred import Deferred
from .writing.requests import check_save_names, save_bar
from .writing.save import Checksums, Progress, save_sources

__all__ = ["GC_PACE", "Vault", "VaultLike", "as_vault"]

#: When a vault compacts what its saves wrote (see ``Vault(compaction=...)``).
COMPACTIONS = ("background", "after-save", None)


class Vault(RecordMethods, UpkeepMethods):
    """A checkpoint store that keeps every distinct tensor once across checkpoints.

    Opening a vault creates nothing: the first save does (or ``create=True``). Reading a
    path that holds no vault raises :class:`~weightvault.VaultNotFoundError`. A vault
    pickles as its URL, ``gc_wait`` and storage options, and opens again on unpickling
    (DCP's process-based ``async_save`` sends its storage writer to another process).

    Args:
        root: A local folder or an fsspec URL such as ``s3://bucket/run1``.
        create: Make the vault now if there is none yet, instead of at the first save.
        gc_wait: How long a save waits for a running gc before giving up, in seconds.
        compression: How the compactor compresses objects (``"blosc2"``: byte planes,
            then zstd), or ``None`` to keep raw bytes (and not compact). Either way every
            object is named by the blake3 of its raw bytes, and vaults of any mix load.
        delta_chain: The most deltas per anchor. The compactor stores an older
            checkpoint's changed weight as the difference to its tensor's *anchor*, a
            whole object of the same tensor in an earlier checkpoint, when that is
            smaller; never a delta on a delta. Once ``delta_chain`` deltas point at an
            anchor (or a delta stops paying), the next changed weight stays whole and
            is the next anchor. A load reads at most two objects per tensor (one from
            the newest); training state is always whole. 0 turns deltas off.
        compaction: When the compactor runs: ``"background"`` (a thread of this
            process, after each save, yielding to saves and loads), ``"after-save"``
            (inside each save, before it returns), or ``None`` (only on :meth:`compact`
            and :meth:`gc`). A save itself always writes raw bytes and commits.
        training_state_last: Keep optimizer, scheduler and RNG state only in the newest
            ``N`` checkpoints: each save drops it from older ones, whose weights stay
            loadable (see :meth:`retain`), and a paced :meth:`gc` frees what it held: on
            the background compactor's thread, after the save returned (:meth:`wait`
            waits for it), or in the save with ``compaction`` other than
            ``"background"``. ``None`` keeps all of it.
        **storage_options: Passed to fsspec for remote roots (endpoint, credentials).

    Raises:
        FormatError: ``root`` holds something that is not a vault (a file, or another
            ``vault.json``).
        ValueError: ``compression`` or ``compaction`` names no option, or a count is
            negative.

    Example:
        >>> vault = Vault("runs/finetune")
        >>> rec = vault.save(model, metadata={"step": "100"})
        >>> rec.new_bytes < rec.logical_bytes     # the frozen backbone is already there
        True
        >>> vault.load(model, "latest").missing
        []
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        create: bool = False,
        gc_wait: float = 600.0,
        compression: str | None = DEFAULT,
        delta_chain: int = DELTA_CHAIN,
        training_state_last: int | None = None,
        compaction: str | None = "background",
        **storage_options: Any,
    ) -> None:
        self.store = open_store(root, **storage_options)
        self.gc_wait = gc_wait
        self._options = dict(storage_options)
        if delta_chain < 0 or (training_state_last is not None and training_state_last < 0):
            raise ValueError(f"{self.store.url}: delta_chain and training_state_last must be >= 0")
        if compaction not in COMPACTIONS:
            raise ValueError(
                f"{self.store.url}: compaction={compaction!r}; use one of {list(COMPACTIONS)}"
            )
        self.training_state_last = training_state_last
        self.compaction = compaction
        self.storage = Storage(codec_named(compression, self.store.url), max_chain=delta_chain)
        self._compactor = Compactor(self._compact_pass)
        self._saves: Deferred[CheckpointRecord] = Deferred()
        self._snapshots = self._saves.snapshots
        self._sums = Checksums()
        self._retention = Retention(lambda: self.store)
        self._last_gc: Timing | None = None
        #: A save dropped training state: the compactor's thread frees it after its pass.
        self._gc_due = False
        if create:
            create_vault(self.store)
        self._found = holds_vault(self.store)

    @property
    def url(self) -> str:
        return self.store.url

    def _require(self) -> None:
        # Checked again until found: another process may have made it since.
        if not self._found:
            require_vault(self.store)
            self._found = True

    # -- saving ------------------------------------------------------------------------

    def save(
        self,
        model: Any,
        name: str | None = None,
        *,
        metadata: Mapping[str, str] | None = None,
        progress: Progress | bool | None = None,
        optimizer: Any = None,
        scheduler: Any = None,
        rng: bool = False,
        background: bool = False,
    ) -> Any:
        """Commit a checkpoint of ``model``, writing only tensors the vault lacks.

        Every tensor is hashed (blake3, once, on all cores) on every save: no shortcut
        that could miss an in-place change is taken. Only objects not already present are
        written; the checksums of present ones are reused. The first save creates the vault.

        Args:
            model: Anything an installed adapter owns (see :mod:`.adapters`): a PyTorch
                module or tensor dict, a Keras model, an NNX or Equinox module or pytree,
                or a dict of numpy arrays.
            name: The checkpoint's name; by default the next number (``000001``, ...).
            metadata: Your ``str -> str`` metadata.
            progress: Called with a byte count as tensors are hashed. ``True`` draws a
                bar on stderr when it is a terminal (nothing on a pipe or a log): the
                bytes hashed, then (``saving: writing``) the bytes compressed and
                written. A callable of yours that also has a ``phase(label, total)``
                method is told the same way when the writing starts.
            optimizer: Also store the optimizer's state by parameter name (PyTorch) or
                variable path (Keras).
            scheduler: Also store the LR scheduler's state (PyTorch).
            rng: Also store the RNG states (a resumed run draws the same numbers).
            background: Save in a thread; returns a :class:`~weightvault.SaveHandle`
                whose ``wait()`` gives the record. The checkpoint holds the values of
                the call: PyTorch's trainable parameters and optimizer state are copied
                first thing in the thread, and every optimizer step waits for that copy
                (``handle.copied()`` waits for it too); everything else training can
                change is copied before the call returns. A later save or load of this
                ``Vault`` waits for it first.

        Returns:
            The committed checkpoint's record, or with ``background`` a handle to it.

        Raises:
            CheckpointExistsError: ``name`` is already taken.
            CheckpointNameError: ``name`` is not a valid name (see :func:`check_name`).

        Example:
            >>> handle = vault.save(model, optimizer=opt, rng=True, background=True)
            >>> opt.step()      # the checkpoint keeps the values at the call
        """
        self._settle()  # a second save waits for the first
        check_free(self.store, name)
        adapter = adapter_for(model)
        snapshot = self._snapshots if background else None
        sources, training = _sources(adapter, model, optimizer, scheduler, rng, snapshot)
        try:
            check_save_names(sources, training, metadata, self.url)
            bar = save_bar(progress, sources, name)
        except BaseException:
            self._snapshots.cancel()  # no save will stage what the adapter queued
            raise

        def work() -> CheckpointRecord:
            try:
                with self._compactor.busy():
                    record = self._trimmed(save_sources(
                        self.store, sources, training, name=name, framework=adapter.FRAMEWORK,
                        metadata=metadata, progress=bar, sums=self._sums, gc_wait=self.gc_wait,
                        to_compact=self.storage.codec is not None,
                    ))  # fmt: skip
            finally:
                if progress is True and isinstance(bar, Bar):  # ours, not the caller's
                    bar.close()
            if self.compaction == "background":
                self._compactor.kick()
            elif self.compaction == "after-save":
                self.compact()
            return record

        return self._saves.start(work, name) if background else work()

    def _trimmed(self, record: CheckpointRecord) -> CheckpointRecord:
        """``record``, once older checkpoints lost their training state (if asked) and
        the objects only that state held are freed."""
        if self.training_state_last is not None:
            self._drop_training(self.training_state_last, kick=False)  # the save kicks next
        return record

    def _settle(self) -> None:
        self._saves.settle()

    def __enter__(self) -> Vault:
        return self

    def __exit__(self, *exc: object) -> None:
        # With an error on its way out, nothing waits: the compactor goes on meanwhile,
        # and what it has not done at exit is done by a later compaction.
        if exc[0] is None:
            self.wait()

    # -- reading -----------------------------------------------------------------------

    def open(self, name: str = "latest") -> VaultCheckpoint | DcpCheckpoint:
        """Open a checkpoint for reading, as a :class:`Checkpoint` any adapter can load."""
        resolved = self.resolve(name)
        ckpt = open_record(self.store, resolved, read_doc(self.store, resolved))
        if not self.store.local:
            ckpt.fetch()
        return ckpt

    def load(self, model: Any, name: str = "latest", *, verify: bool = True, **options: Any) -> Any:
        """Fill ``model`` from checkpoint ``name``, through the adapter's ``load``.

        Every option of the adapter's ``load`` works (``rules``, ``strict``,
        ``restore_frozen``, ``optimizer``, ``scheduler``, ``rng``, ...). ``verify`` (on by
        default) checks every object's hash before anything is copied, so a damaged vault
        never loads wrong values.

        Returns:
            What the adapter's ``load`` returns: a :class:`LoadReport` for PyTorch and
            Keras, ``(model, report)`` for JAX (pytrees come back as new objects).
        """
        adapter = adapter_for(model)
        self._settle()  # "latest" includes a background save still being written
        with self._compactor.busy(), self.open(name) as ckpt:
            return adapter.load(model, ckpt, verify=verify, **options)

    def walk(
        self,
        model: Any,
        names: Sequence[str] | None = None,
        *,
        verify: bool = True,
        **options: Any,
    ) -> Iterator[tuple[str, Any]]:
        """Load each checkpoint into ``model`` in turn; yield ``(name, report)`` after each.

        Every checkpoint loads as :meth:`load` loads it (the same options, checks and
        report), except that a tensor whose object the previous checkpoint of the walk
        stored under the same name is neither read nor copied again: the model holds it
        already. Walking a frozen-backbone run therefore costs the trained tensors per
        checkpoint. Change nothing in the model between steps (evaluate under
        ``torch.no_grad()``), or the next step leaves your change in the tensors it skips.

        Args:
            model: The model to fill, as for :meth:`load`.
            names: Checkpoints in the order to load them (``"latest"`` and ``"best"``
                allowed); by default every checkpoint, oldest first. All are resolved
                before the first load.
            verify: Check every object read against its checksum before copying.
            **options: Any option of the adapter's ``load`` (``rules``, ``strict``, ...).

        Raises:
            Exception: What a checkpoint's load raised (``ChecksumError`` for a damaged
                object), with a note naming it: the model still holds the checkpoint
                before it, and the walk ends.

        Example:
            >>> for name, report in vault.walk(model):
            ...     print(name, evaluate(model))
        """
        adapter = adapter_for(model)
        self._settle()
        self._require()
        return walk(
            walk_order(self.store, names),
            self._reading,
            lambda ckpt: adapter.load(model, ckpt, verify=verify, **options),
        )

    @contextlib.contextmanager
    def _reading(self, name: str) -> Iterator[Checkpoint]:
        """Checkpoint ``name``, open, with the compactor yielding meanwhile (as in load)."""
        with self._compactor.busy(), self.open(name) as ckpt:
            yield ckpt

    def export(
        self, name: str, path: str | os.PathLike[str], *, dedupe_copies: bool = False
    ) -> int:
        """Write checkpoint ``name`` as a standalone file any safetensors reader opens.

        Copies, stored once in the vault, are written under every name by default, so
        plain readers (``safetensors.torch.load_model``, ``from_pretrained``) see the whole
        model; with ``dedupe_copies`` they are stored once, as in the vault. Returns the
        file's size in bytes.
        """
        with self.open(name) as ckpt:
            ckpt.verify()
            metadata = dict(ckpt.manifest.metadata)
            report = rewrite(ckpt, path, metadata=metadata, dedupe_copies=dedupe_copies)
            return report.file_bytes

    def disk_bytes(self) -> int:
        """Bytes the vault occupies: every object and record."""
        self._require()
        return sum(b.size for b in self.store.list(""))

    # -- moving ------------------------------------------------------------------------

    def push(
        self,
        dest: VaultLike,
        names: Sequence[str] | None = None,
        *,
        progress: Progress | bool | None = None,
        **storage_options: Any,
    ) -> TransferReport:
        """Send checkpoints ``names`` (every one by default) to the vault ``dest``, with
        only the objects it lacks, as they are stored here.

        ``dest`` commits each checkpoint as a save would: every object it needs durable
        first (each checked against its name), the record last; a push killed at any
        moment leaves no checkpoint there that fails to load, and a rerun sends only what
        is still missing. See docs/vault.md, "Moving vaults".

        Args:
            dest: A :class:`Vault`, a path or an fsspec URL; an empty one becomes a vault.
            names: Checkpoint names (``"latest"`` allowed), or ``None`` for all.
            progress: ``True`` draws a bar on stderr when it is a terminal; a callable is
                called with the bytes of each object sent.
            **storage_options: For ``dest`` given as a URL (endpoint, credentials).

        Returns:
            A :class:`~weightvault.TransferReport` (``checkpoints``, ``objects_sent``,
            ``bytes_sent``, ``bytes_skipped``, ...).

        Raises:
            CheckpointExistsError: ``dest`` holds a different checkpoint of one of the
                names; nothing was sent.
            SourceDamagedError: Objects here are damaged: the checkpoints needing them
                were not sent, the others were.
            FormatError: ``dest`` holds other data, or a vault format this code does not
                know.

        Example:
            >>> vault.push("s3://bucket/run1").bytes_sent      # everything, the first time
            1048576
            >>> vault.push("s3://bucket/run1").bytes_sent      # nothing, the second
            0
        """
        self._require()
        self._settle()  # a background save still being written is part of "every"
        receiver = as_vault(dest, **storage_options)
        return moved(self, receiver, names, progress, "pushing")

    def pull(
        self,
        source: VaultLike,
        names: Sequence[str] | None = None,
        *,
        progress: Progress | bool | None = None,
        **storage_options: Any,
    ) -> TransferReport:
        """Fetch checkpoints ``names`` (every one by default) from the vault ``source``
        into this one, with only the objects this one lacks: :meth:`push` the other way.

        A checkpoint pulled alone brings what it needs to load: its objects and the delta
        bases they rely on, or a tensor whole where its delta chain would cost more.

        Example:
            >>> local = Vault("runs/eval")
            >>> local.pull("s3://bucket/run1", ["000010"]).checkpoints
            ['000010']
        """
        self._settle()
        sender = as_vault(source, **storage_options)
        report = moved(sender, self, names, progress, "pulling")
        self._found = True
        if report.marked and self.compaction == "background":
            self._compactor.kick()  # what arrived raw is compacted as a save's would be
        return report

    def __reduce__(self) -> tuple[Any, ...]:
        # Another process (DCP's process-based async_save pickles the storage writer)
        # opens the same vault again from its URL and options; what lives only in this
        # process (a background save, snapshot buffers, cached checksums) stays here.
        settings = {
            "compression": self.storage.codec.name if self.storage.codec else None,
            "delta_chain": self.storage.max_chain,
            "training_state_last": self.training_state_last,
            "compaction": self.compaction,
        }
        return (_reopen, (self.url, self.gc_wait, {**settings, **self._options}))

    def __repr__(self) -> str:
        return f"Vault({self.url!r})"


def _reopen(url: str, gc_wait: float, options: dict[str, Any]) -> Vault:
    """The :class:`Vault` a pickled one stands for (see ``Vault.__reduce__``)."""
    return Vault(url, gc_wait=gc_wait, **options)


def _sources(
    adapter: Adapter,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    rng: bool,
    snapshot: SnapshotPool | None,
) -> tuple[builtins.list[Source], dict[str, Any] | None]:
    """The model's sources, with the training section when any training state is asked."""
    if optimizer is None and scheduler is None and not rng and snapshot is None:
        return adapter.sources(model)[0], None
    sources, _, training = adapter.checkpoint_sources(
        model, optimizer=optimizer, scheduler=scheduler, rng=rng, snapshot=snapshot
    )
    return sources, training


#: What every vault-taking API accepts: a :class:`Vault`, a path, or an fsspec URL.
VaultLike = Vault | str | os.PathLike[str]


def as_vault(vault: VaultLike, **options: Any) -> Vault:
    """``vault`` itself, or the :class:`Vault` at that path or URL.

    Every API that takes a vault (``VaultCallback``, ``checkout``, ``VaultCheckpointIO``,
    ``weightvault.dcp``, Keras' ``VaultCheckpoint``) goes through this, so a path works
    wherever a ``Vault`` does, as ``output_dir`` and ``dirpath`` do.

    Example:
        >>> import tempfile
        >>> as_vault(tempfile.mkdtemp(), create=True).list()
        []
    """
    return vault if isinstance(vault, Vault) else Vault(vault, **options)
