"""The vault: a checkpoint store that keeps every distinct tensor once across a run.

Layout under the root (a folder, or any fsspec URL such as ``s3://bucket/run1``)::

    vault.json                    format marker (:mod:`.marker`), written by the first save
    objects/<h[:2]>/<h>           one tensor's raw bytes, named by their blake3 hash
                                  (:mod:`.objects`)
    checkpoints/<name>.json       a committed checkpoint (:mod:`.records`): the safetensors
                                  header it would have as a single file, plus the object of
                                  each stored tensor
    intents/<id>.json             objects an in-flight save is about to reference
    gc/<id>.json                  a gc in progress (its heartbeat: pid, host, time)
    trash/<id>/<h>                objects gc <id> took out of objects/ and may still put back

A save follows the one commit protocol of :mod:`.commit` (intent, wait for gc, objects,
one exclusive create of the record); :mod:`.gc` explains why no gc, however it stalls,
deletes an object a checkpoint needs. :class:`Vault` is the public face of those modules.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from .._base.errors import FormatError
from .._base.pools import LazyPool
from .._base.progress import Progress as Bar
from .._base.snapshots import SaveHandle, SnapshotPool
from .._file.checkpoint import Checkpoint
from .._file.layout import is_training
from .._file.sharing import Source
from .._file.writer import check_names
from .._tools.convert import rewrite
from .adapters import Adapter, adapter_for
from .objects.codec import DEFAULT, codec_named
from .objects.encoding import DELTA_CHAIN, Storage
from .records.checkpoint import VaultCheckpoint, open_record
from .records.dcp import DcpCheckpoint
from .records.marks import (
    carry_marks,
    mark as put_mark,
    marks as find_marks,
    protected,
    resolve_label,
    unmark as take_mark,
)
from .records.record import CheckpointRecord, check_free, delete_record, list_records, read_doc
from .records.todo import mark
from .store.backend import open_store
from .store.identity import create_vault, holds_vault, require_vault
from .travel.transfer import TransferReport, transfer
from .upkeep.compact import CompactReport, compact
from .upkeep.compactor import Compactor
from .upkeep.gc import break_gc_lock, collect
from .upkeep.retain import Split, drop_training_except_last
from .upkeep.verify import VaultVerifyReport, verify_vault
from .walk import walk, walk_order
from .writing.save import Checksums, Progress, save_sources

__all__ = ["GC_PACE", "Vault", "VaultLike", "as_vault"]


#: The share of a loop's time that freeing after each save may take (see ``Vault.gc``).
GC_PACE = 0.1
#: A gc this quick (seconds) is never put off by ``pace``.
_QUICK_GC = 1.0
#: When a vault compacts what its saves wrote (see ``Vault(compaction=...)``).
COMPACTIONS = ("background", "after-save", None)


class Vault:
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
        delta_chain: The compactor stores an older checkpoint's changed tensor as the
            difference to its value in the next checkpoint when that is smaller, with
            at most ``delta_chain`` deltas behind one full object: the newest checkpoint
            reads one object per tensor, any other at most ``delta_chain + 1``. 0
            turns deltas off.
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
        self._pending: SaveHandle[CheckpointRecord] | None = None
        self._snapshots = SnapshotPool(deferred=True)
        self._saver = LazyPool(1, "weightvault-background-save")
        self._sums = Checksums()
        #: Checkpoints a mirror has queued and not pushed yet: retention leaves them
        #: whole until it has (see :meth:`_spare`).
        self._spared: collections.Counter[str] = collections.Counter()
        self._deferred: dict[str, Any] | None = None
        self._last_gc: tuple[float, float] | None = None  # (seconds it took, when it ended)
        #: Checkpoints (name, created) whose training state is gone, by the split that
        #: told it apart (None: the vault's own): not read again.
        self._trim_done: dict[Any, set[tuple[str, float]]] = {}
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
            _check_names(sources, training, metadata, self.url)
            bar = _bar(progress, sources, name)
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

        return self._in_background(work, name) if background else work()

    def _trimmed(self, record: CheckpointRecord) -> CheckpointRecord:
        """``record``, once older checkpoints lost their training state (if asked) and
        the objects only that state held are freed."""
        if self.training_state_last is not None:
            self._drop_training(self.training_state_last, kick=False)  # the save kicks next
        return record

    def _drop_training(
        self, last: int, split: Split | None = None, *, free: bool = False, kick: bool = True
    ) -> None:
        """Drop the training state of all but the newest ``last`` checkpoints (see
        :func:`drop_training_except_last`), then free what it alone held.

        A run that keeps one resumable checkpoint expects its disk to stay at one
        optimizer state, as a Trainer's save_total_limit does, not to grow until someone
        thinks of gc: a gc frees what the dropped state alone held, paced so that it never
        takes more than a tenth of the run's time. It reads every record, so with a
        background compactor it runs on that thread, off the loop's time (in the save it
        took 0.75 s of each after 150 saves of the lm run). ``free``: run that gc even if
        nothing was dropped (Lightning's plugin, whose deleted checkpoints it frees too).
        """
        done = self._trim_done.setdefault(split, set())
        dropped = drop_training_except_last(self.store, last, split, spare=self.spared, done=done)
        if dropped or free:
            if self.compaction == "background":
                self._gc_due = True
                if kick:  # a second kick during a save made a second pass read every record
                    self._compactor.kick()
            else:
                self._collect(GC_PACE)

    def _in_background(
        self, work: Callable[[], CheckpointRecord], name: str | None
    ) -> SaveHandle[CheckpointRecord]:
        def run() -> CheckpointRecord:
            try:
                self._snapshots.stage()  # the copies the adapter queued, first
                return work()
            finally:
                self._snapshots.release()  # read in full: the next snapshot may reuse them

        try:
            self._pending = SaveHandle(
                run, f"vault save {name or '(next)'}", self._saver(), self._snapshots.staged
            )
        except BaseException:  # no thread (an interpreter shutting down refuses work)
            self._snapshots.cancel()  # or every optimizer step would wait for ever
            raise
        return self._pending

    def _settle(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.settle()

    # -- compaction --------------------------------------------------------------------

    def _compact_pass(self, pause: Callable[[], None], stop: Any) -> CompactReport:
        # The newest's new objects stay raw for a quick resume (see compact.py).
        report = compact(self.store, self.storage, pause=pause, stop=stop, settle=False)
        if self._gc_due and not stop.is_set():
            self._gc_due = False
            self._collect(GC_PACE)  # what a save's training_state_last dropped
        return report

    def compact(self) -> CompactReport:
        """Compact now, in this thread, what saves left raw; return what was done.

        Waits for this ``Vault``'s background compactor first. Each checkpoint's objects
        become full compressed objects, and the previous checkpoint's turn into deltas
        on them where that is smaller (see docs/vault.md). Safe at any moment: a SIGKILL
        leaves every object in its old encoding or its new one, and another process
        compacting the same vault meanwhile makes this one return ``busy``.

        Example:
            >>> vault.save(model)
            >>> vault.compact().checkpoints
            ['000001']
        """
        self._require()
        self._settle()
        self._compactor.wait(errors=False)  # logged; this pass runs what failed again
        return compact(self.store, self.storage)

    def wait(self, *, raise_errors: bool = True) -> builtins.list[CompactReport]:
        """Wait for a background save and for the background compactor to finish.

        Args:
            raise_errors: Raise what a compaction raised (it was logged as a warning when
                it happened, and what it left is done later); ``False`` only waits.

        Returns:
            The background compactor's reports since the last ``wait``.

        Raises:
            Exception: What the background save raised, or with ``raise_errors`` what a
                compaction raised.

        Example:
            >>> with Vault("runs/ft") as vault:   # the block's end waits the same way
            ...     vault.save(model)
        """
        self._settle()
        return self._compactor.wait(errors=raise_errors)

    def __enter__(self) -> Vault:
        return self

    def __exit__(self, *exc: object) -> None:
        # With an error on its way out, nothing waits: the compactor goes on meanwhile,
        # and what it has not done at exit is done by a later compaction.
        if exc[0] is None:
            self.wait()

    # -- reading -----------------------------------------------------------------------

    def list(self) -> builtins.list[CheckpointRecord]:
        """Every committed checkpoint, oldest first."""
        self._require()
        return list_records(self.store)

    def resolve(self, name: str = "latest") -> str:
        """The name ``name`` stands for: itself, the newest checkpoint's for ``"latest"``,
        or for ``"best"`` the checkpoint :meth:`mark` labelled so.

        Raises:
            VaultNotFoundError: The path holds no vault.
            CheckpointNameError: ``name`` is not a valid name.
            CheckpointNotFoundError: ``"latest"`` in a vault with no checkpoints, or
                ``"best"`` where none is marked.

        Example:
            >>> vault.resolve("latest")
            '000003'
        """
        self._require()
        return resolve_label(self.store, name)

    # -- marks -------------------------------------------------------------------------

    def mark(self, name: str, label: str = "best") -> None:
        """Label checkpoint ``name`` (``"latest"`` allowed) ``label``, and take the label
        off the checkpoint that held it: a label names at most one checkpoint.

        Reads then take the label for the checkpoint (``load(model, "best")``, ``open``,
        ``export``, ``walk``, the CLI), retention by count keeps it, and a push carries
        it. The new record is written first and the old one after, so a crash between
        the two leaves both carrying it and the newer mark naming the checkpoint.

        Raises:
            ValueError: ``label`` is not a label (today there is one: ``"best"``).
            CheckpointNotFoundError: No checkpoint has that name.

        Example:
            >>> vault.mark("000004")
            >>> vault.load(model, "best").missing
            []
        """
        self._require()
        self._settle()  # the background save's retention rewrites records too
        put_mark(self.store, name, label)

    def unmark(self, label: str = "best") -> str | None:
        """Take ``label`` off; returns the checkpoint it named, or ``None``."""
        self._require()
        self._settle()
        return take_mark(self.store, label)

    def marks(self) -> dict[str, str]:
        """``{label: checkpoint}`` of every label a checkpoint carries, from the first 512
        bytes of each record (and the marked ones whole).

        Example:
            >>> vault.marks()
            {'best': '000004'}
        """
        self._require()
        return find_marks(self.store)

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

    def verify(self, *, progress: Progress | None = None) -> VaultVerifyReport:
        """Check every checkpoint's record and every object's size and hash.

        Each object is hashed once however many checkpoints share it. Damage of any kind
        (records, objects) is reported in ``problems``, never raised.
        """
        self._require()
        return verify_vault(self.store, progress)

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
        return _moved(self, receiver, names, progress, "pushing")

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
        report = _moved(sender, self, names, progress, "pulling")
        self._found = True
        if report.marked and self.compaction == "background":
            self._compactor.kick()  # what arrived raw is compacted as a save's would be
        return report

    # -- removing ----------------------------------------------------------------------

    def delete(self, name: str) -> None:
        """Remove checkpoint ``name``; its objects are freed by the next :meth:`gc`.

        If it was the oldest or the newest, the next compaction (a save's,
        :meth:`compact`, :meth:`gc`) makes the new oldest or newest whole: neither is
        kept as deltas.

        Raises:
            CheckpointNameError: ``name`` is not a valid name (``latest`` is refused too).
            CheckpointNotFoundError: No checkpoint has that name.
        """
        self._require()
        self._delete_all([name])

    def _delete_all(
        self, names: Sequence[str], before: Sequence[CheckpointRecord] | None = None
    ) -> None:
        """Delete the records ``names``; if the oldest or the newest goes, its successor
        is marked for the compactor, which makes it whole (it keeps neither as deltas,
        see compact.py). ``before``: the records as the caller just listed them."""
        if not names:
            return
        if before is None:
            try:
                before = self.list()
            except FormatError:
                before = []  # a damaged record (perhaps the one going): nothing is asked
        for name in names:
            delete_record(self.store, name)
        after = [r for r in before if r.name not in names]
        if self.storage.codec is None or not after:
            return
        # Left to the next compaction (a save's, gc's, compact()): a thread started here
        # would race the gc that usually follows a deletion for the lock.
        if before[0].name in names:
            mark(self.store, after[0].name)
        if before[-1].name in names:  # the new newest is a delta on what went: whole again
            mark(self.store, after[-1].name)

    def retain(
        self,
        keep_last: int | None = None,
        keep_every: int | None = None,
        *,
        training_state_last: int | None = None,
    ) -> builtins.list[str]:
        """Delete checkpoints except the last ``keep_last``, every ``keep_every``-th and
        the one a label marks (:meth:`mark`), and drop the training state of all but the
        last ``training_state_last`` (a marked one's too: its weights and label stay).

        A checkpoint whose training state is dropped keeps its weights (it loads as
        before); resuming from it raises :class:`~weightvault.TrainingStateError`. What
        either frees goes at the next :meth:`gc`, except objects a kept checkpoint's
        deltas are built on.

        Returns:
            The names deleted. With no argument, nothing changes.

        Example:
            >>> vault.retain(training_state_last=1)   # weights of every checkpoint, one resumable
            []
        """
        spared = self.spared
        if spared and (keep_last is not None or keep_every is not None or training_state_last):
            # Applied again, as asked, once the mirror has them (Mirror.wait).
            self._deferred = {"keep_last": keep_last, "keep_every": keep_every,
                              "training_state_last": training_state_last}  # fmt: skip
        deleted: builtins.list[str] = []
        if keep_last is not None or keep_every is not None:
            records = self.list()  # every record whole: only what deleting needs
            keep: set[str] = set()
            if keep_last:
                keep |= {r.name for r in records[-keep_last:]}
            if keep_every:
                keep |= {r.name for i, r in enumerate(records) if (i + 1) % keep_every == 0}
            keep |= protected(self.store)  # a marked checkpoint goes only by name
            deleted = [r.name for r in records if r.name not in keep and r.name not in spared]
            self._delete_all(deleted, records)  # not listed a second time
        if training_state_last is not None:
            if training_state_last < 0:
                raise ValueError(f"{self.url}: training_state_last must be >= 0")
            # The checkpoints this Vault saw without training state are not read again:
            # a loop's trim after every save (the integrations) read every older record,
            # 37-68 ms a save after 300 checkpoints (docs/benchmarks.md, section 27).
            done = self._trim_done.setdefault(None, set())
            drop_training_except_last(self.store, training_state_last, spare=spared, done=done)
        return deleted

    @property
    def spared(self) -> frozenset[str]:
        """Checkpoints retention leaves whole for now: a mirror has yet to push them."""
        return frozenset(n for n, c in self._spared.items() if c > 0)

    def _spare(self, name: str) -> None:
        """Keep ``name`` whole (retention skips it) until :meth:`_unspare`; a mirror
        calls this when it queues a checkpoint, so that it pushes what was committed."""
        self._spared[name] += 1

    def _unspare(self, names: Iterable[str]) -> None:
        for name in names:
            if self._spared[name] > 0:
                self._spared[name] -= 1
            if self._spared[name] <= 0:
                del self._spared[name]

    def _retain_deferred(self) -> None:
        """Apply the last retention that spared checkpoints, now that none is spared."""
        if self.spared:
            return
        asked, self._deferred = self._deferred, None
        changed = asked is not None and bool(self.retain(**asked))
        if self.training_state_last is not None:
            changed |= bool(
                drop_training_except_last(
                    self.store,
                    self.training_state_last,
                    done=self._trim_done.setdefault(None, set()),
                )
            )
        if changed or asked:
            self.gc(pace=GC_PACE)

    def gc(self, *, pace: float | None = None) -> int:
        """Compact what is left to compact (:meth:`compact`), then delete objects no
        checkpoint or in-flight save references; return the object bytes freed (stale
        bookkeeping files are removed too, uncounted). A paced gc (what training loops
        call after each save) does not compact: that stays with the background compactor,
        off the loop's time.

        With ``pace`` (a fraction such as 0.1), a gc whose previous run in this ``Vault``
        took over a second runs only if that was at most ``pace`` of the time since it
        ended, and otherwise returns 0 at once: a loop that frees after every save then
        spends at most about that share of its time in gc (which reads every record, so
        it grows with the vault), and frees what it let go of a few saves later at worst.

        gc takes its candidates out of ``objects/`` into its trash, re-reads every intent
        and checkpoint, puts back whatever is now named, and deletes only the rest: a gc
        stalled at any point never deletes an object a newer save relies on (the
        :mod:`.gc` docstring gives the argument). It first puts back the trash of gcs
        that died.

        Raises:
            FormatError: A checkpoint record or intent is unreadable, so gc cannot know
                which objects it needs; every object is left in place. Fix or remove that
                record first.
        """
        self._require()
        if pace is None:
            self.compact()
        return self._collect(pace)

    def _collect(self, pace: float | None) -> int:
        """The gc half of :meth:`gc`: free what nothing names (paced as it says)."""
        now = time.monotonic()
        if pace is not None and self._last_gc is not None:
            took, ended = self._last_gc
            if took > max(_QUICK_GC, pace * (now - ended)):
                return 0
        freed = collect(self.store)
        self._last_gc = (time.monotonic() - now, time.monotonic())
        return freed

    def break_gc_lock(self) -> builtins.list[str]:
        """Remove the markers of gcs that died, after putting their trash back.

        A gc's marker is dead when its heartbeat is older than the staleness window (a
        minute), or at once when it was written on this machine by a process that has
        exited. Objects such a gc had moved to its trash go back to ``objects/`` (the next
        gc frees them if nothing needs them), so breaking a lock never loses data.

        Returns:
            The markers removed.

        Raises:
            VaultBusyError: A marker's gc may still be running; nothing was changed.
        """
        self._require()
        return break_gc_lock(self.store)

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


def _moved(
    sender: Vault,
    receiver: Vault,
    names: Sequence[str] | None,
    progress: Progress | bool | None,
    label: str,
) -> TransferReport:
    """One transfer from ``sender`` to ``receiver``, with a bar for ``progress=True``;
    the labels of what it sent then name the same checkpoints there."""
    bar = Bar(0, f"{label} to {receiver.url}") if progress is True else progress or None
    codec = receiver.storage.codec or sender.storage.codec
    if names is not None:
        sender._require()
        names = [sender.resolve(n) for n in names]  # "best" is the sender's
    try:
        report = transfer(
            sender.store, receiver.store, names, progress=bar, gc_wait=receiver.gc_wait,
            codec=codec,
        )  # fmt: skip
    finally:
        if isinstance(bar, Bar):
            bar.close()
    carry_marks(sender.store, receiver.store, report.checkpoints)
    return report


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


def _bar(
    progress: Progress | bool | None, sources: Sequence[Source], name: str | None
) -> Progress | None:
    """The save's progress hook: the caller's, or for ``True`` a bar sized to the bytes
    the save hashes (each tensor once, however many names share it)."""
    if progress is not True:
        return progress or None
    sizes = {s.identity: s.nbytes for s in sources}
    label = f"saving {name}" if name else "saving"
    # The save reports bytes as it hashes; the pause before the writing phase (bases,
    # intent, existence checks) shows as "compressing and writing" with its seconds.
    return Bar(sum(sizes.values()), label, then="compressing and writing")


def _check_names(
    sources: builtins.list[Source],
    training: dict[str, Any] | None,
    metadata: Mapping[str, str] | None,
    where: str,
) -> None:
    """Refuse names and metadata a single file cannot hold, now: not in a background
    thread, nor only when the checkpoint is exported."""
    names = [s.name for s in sources if training is None or not is_training(s.name)]
    check_names(names, metadata, where)


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
