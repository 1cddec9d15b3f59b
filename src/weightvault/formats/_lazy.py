"""Reading a foreign file without mapping it: positional reads, and arrays read on demand.

A file cut short while a mapping of it is read kills the process with ``SIGBUS``; a
short positional read is a :class:`~weightvault.FormatError` naming the file and the
array. So the npz, MXNet and Keras h5 readers parse their headers through a
:class:`FileReader` and hand each array out as a :class:`Lazy`, read (or inflated) when
the checkpoint's tensor is asked for, into the model's memory or a buffer of its own:
a load holds at most one array beside the model. :func:`plan_lazily` runs the save
plan's copy finding over such arrays one at a time.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import IO, cast

from .._base.errors import FormatError
from .._file.checkpoint import new_buffer, read_fully
from .._file.sharing import FINGERPRINT_WHOLE, Plan, Source, plan

__all__ = ["FileReader", "FileSlices", "Held", "Lazy", "held", "plan_lazily"]


class FileReader:
    """One foreign file, open for positional reads: never mapped.

    Headers and indexes are parsed from short reads of it, and each array's bytes are
    read with ``preadv`` when they are asked for, so a file cut short meanwhile is a
    :class:`FormatError` naming the file and the array. ``stream`` is the same
    descriptor as a buffered file, for :mod:`zipfile`; positional reads do not move it.

    Attributes:
        path: The file.
        where: How messages name it (the file, or an archive's member).
        size: Its size when it was opened.
    """

    def __init__(self, path: str, where: str | None = None) -> None:
        self.path, self.where = path, where or path
        self.stream: IO[bytes] = open(path, "rb")  # noqa: SIM115 - closed by close()
        self.size = os.fstat(self.stream.fileno()).st_size

    def exact(self, offset: int, n: int, what: str) -> bytes:
        """Bytes ``[offset, offset + n)`` of a header or index (``what``, for messages).

        Raises:
            FormatError: The file ends before them.
        """
        if self.stream.closed:
            raise FormatError(f"{self.where}: {what}: the file is closed")
        parts, done = [], 0
        while done < n:
            part = os.pread(self.stream.fileno(), n - done, offset + done)
            if not part:
                raise FormatError(
                    f"{self.where}: {what} needs {n} bytes at offset {offset}, but the file "
                    f"ends {done} bytes in (it was cut short); save or copy it again"
                )
            parts.append(part)
            done += len(part)
        return b"".join(parts)

    def fill(self, offset: int, buffer: memoryview, name: str) -> None:
        """Read array ``name``'s bytes at ``offset`` into ``buffer``, exactly filling it.

        Raises:
            FormatError: The file ended before the array did, or it is closed.
        """
        if self.stream.closed:
            raise FormatError(f"{self.where}: tensor {name!r}: the file is closed")
        read_fully(self.stream.fileno(), buffer, offset, self.where, name)

    def span(self, offset: int, nbytes: int, name: str) -> Lazy:
        """Array ``name``: ``nbytes`` stored as they are at ``offset``, read on demand."""
        slices = FileSlices(self, offset, nbytes, name)
        return Lazy(nbytes, lambda b: self.fill(offset, b, name), offset + nbytes, slices)

    def close(self) -> None:
        self.stream.close()


class Lazy:
    """An array's bytes, made only when asked for.

    :meth:`read` returns them in new memory of this process' own; :attr:`fill` writes
    them into a buffer of exactly :attr:`nbytes` (the model's memory), raising
    :class:`FormatError` if the file cannot give them. Calling it is what the save plan
    does with a :class:`~weightvault._file.sharing.Source`'s ``data`` (see
    :meth:`__call__`).

    Attributes:
        nbytes: How many bytes the array holds.
        fill: Writes them into a buffer of ``nbytes``.
        end: The file offset the bytes it reads end at; a load checks the file still
            reaches that far before it changes anything.
        slices: For bytes stored as they are in the file, its :class:`FileSlices`.
    """

    def __init__(
        self,
        nbytes: int,
        fill: Callable[[memoryview], None],
        end: int,
        slices: FileSlices | None = None,
    ) -> None:
        self.nbytes, self.fill, self.end, self.slices = nbytes, fill, end, slices
        #: Set while the save plan reads the arrays (see :func:`plan_lazily`).
        self.recent: _Recent | None = None

    def read(self) -> memoryview:
        """The bytes, in new memory."""
        if self.nbytes == 0:
            return memoryview(b"")
        buffer = new_buffer(self.nbytes)
        self.fill(buffer)
        return buffer

    def __call__(self) -> memoryview:
        """The bytes as the save plan compares them with lookalikes' (one array at a
        time, never kept): read whole, or, for a large array stored as it is, as
        :class:`FileSlices` whose fingerprint reads three 64 KiB samples."""
        if self.nbytes > FINGERPRINT_WHOLE:
            return cast(memoryview, self.slices) if self.slices is not None else self.read()
        return self.recent.read(self) if self.recent is not None else self.read()


class FileSlices:
    """An array's bytes in a file as the save plan's copy finding reads them: its
    length, and any slice of it, read when the slice is taken (new memory).

    It offers what :func:`~weightvault._file.sharing.fingerprint` and
    :func:`~weightvault._file.sharing.same_bytes` use of a memoryview (``nbytes``,
    ``cast("B")``, slicing) and nothing more; ``tests/test_formats_npz.py`` checks that
    copies are still told apart byte by byte through it. Reading each large array whole
    only to sample 192 kB of it made opening GPT-2 small's ``.npz`` 5.8x slower.
    """

    def __init__(self, file: FileReader, offset: int, nbytes: int, name: str) -> None:
        self.file, self.offset, self.nbytes, self.name = file, offset, nbytes, name

    def cast(self, fmt: str) -> FileSlices:
        assert fmt == "B", fmt
        return self

    def __getitem__(self, key: slice) -> memoryview:
        lo, hi, step = key.indices(self.nbytes)
        assert step == 1, key
        out = memoryview(bytearray(max(hi - lo, 0)))
        if out.nbytes:
            self.file.fill(self.offset + lo, out, self.name)
        return out


#: A foreign checkpoint's stored tensor: bytes in memory (decoded), or read on demand.
Held = memoryview | bytes | Lazy


class _Recent:
    """What the save plan read last, for its next reads of small arrays.

    The plan reads each small array to fingerprint it, again to compare it with a
    lookalike, and the lookalike once per copy of it (Gluon's default files write every
    shared parameter once per layer). A small array stored as it is is served from a
    read-ahead window of the file (:data:`WINDOW`, one ``pread`` for many arrays, in
    file order); one that must be decoded (inflated) is kept among the last ``KEEP``.
    Arrays over :data:`~weightvault._file.sharing.FINGERPRINT_WHOLE` are never kept, so
    this holds at most a few MiB.
    """

    KEEP = 2
    #: A larger window re-read a MiB for each small array between GPT-2's large ones.
    WINDOW = 64 << 10

    def __init__(self) -> None:
        self._items: OrderedDict[int, memoryview] = OrderedDict()
        self._window, self._at = memoryview(b""), 0
        self._file: FileReader | None = None

    def read(self, lazy: Lazy) -> memoryview:
        """``lazy``'s bytes as :meth:`Lazy.read` gives them (read-only)."""
        s = lazy.slices
        if s is not None:
            lo = s.offset - self._at
            if self._file is not s.file or lo < 0 or lo + s.nbytes > self._window.nbytes:
                n = min(max(self.WINDOW, s.nbytes), s.file.size - s.offset)
                self._window = memoryview(b"")  # the old one goes before the new is read
                self._window = memoryview(s.file.exact(s.offset, n, f"tensor {s.name!r}"))
                self._file, self._at, lo = s.file, s.offset, 0
            return self._window[lo : lo + s.nbytes]
        hit = self._items.get(id(lazy))
        if hit is None:
            hit = self._items[id(lazy)] = lazy.read()
            while len(self._items) > self.KEEP:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(id(lazy))
        return hit


def plan_lazily(sources: Sequence[Source], *, dedupe_copies: bool = True) -> Plan:
    """:func:`~weightvault._file.sharing.plan` over sources whose ``data`` may be
    :class:`Lazy`: read one array at a time (the last few small ones kept for the
    comparisons, see :class:`_Recent`), each stored tensor's ``data`` left the
    :class:`Lazy` it is, for the checkpoint to read when asked for."""
    lazy = [s.data for s in sources if isinstance(s.data, Lazy)]
    recent = _Recent()
    for one in lazy:
        one.recent = recent
    try:
        return plan(sources, dedupe_copies=dedupe_copies)
    finally:
        for one in lazy:
            one.recent = None


def held(data: Callable[[], memoryview]) -> Held:
    """What a checkpoint keeps of a source's ``data``: a :class:`Lazy` as it is (read
    when asked for), anything else's bytes."""
    return data if isinstance(data, Lazy) else data()
