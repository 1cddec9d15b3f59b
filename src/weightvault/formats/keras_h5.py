"""Keras 3 ``.weights.h5`` files (and other HDF5 files of plain numeric datasets).

Every dataset becomes a name: its HDF5 path, such as ``layers/dense/vars/0``. Groups are
walked with numeric keys in numeric order (``vars/2`` before ``vars/10``), the order
Keras wrote them. A dataset reachable through two hard links is one object, so its
second path becomes an alias (that is how :func:`weightvault.keras.save_weights` stores
a variable several layers hold). Keras's own duplicate datasets (one variable shared by
two layers is written once per layer) hold equal bytes: they stay stored, and are listed
as *duplicates*, so ``inspect`` tells which datasets are equal and what deduplicating
them would save.

A file weightvault wrote carries its manifest in the root attribute ``weightvault``
(JSON, ignored by Keras): the frozen datasets, the hard-linked datasets that are copies
(separate variables stored once by ``convert --dedupe-copies``), and your metadata.

Contiguous, unfiltered datasets are read with ``preadv`` straight from the file when their
tensor is asked for (the file is never mapped: a load's memory stays that of one
variable, and a file cut short meanwhile is a :class:`~weightvault.FormatError` naming
the dataset); chunked or compressed ones are decoded through h5py when the file is
opened, after their size is checked against the bytes they occupy and charged to the
file's :class:`~weightvault._base.limits.DecodeBudget` (so 300 unwritten datasets cannot
add up to gigabytes). A group reachable through two paths is
refused, so groups hard-linked into each other cannot multiply the paths walked (2**21
from a few kB), and a group that contains itself is a link cycle.

Nothing but the given file (or the archive member given) is ever read. Refused, before
any data is read:

* external links, and datasets with EXTERNAL raw storage (their bytes live in other
  files, which HDF5 would open by name);
* virtual datasets (they map other files);
* soft links. They cannot leave the file by themselves, but they resolve by path, so a
  soft link through an external link elsewhere in the file would reach another file
  before the walk met that link; Keras never writes them;
* user-defined link types;
* any filter but deflate, shuffle, Fletcher-32, scale-offset, n-bit and LZF, the ones
  HDF5 and h5py decode themselves (another filter id would make HDF5 search its plugin
  path for a shared library to load).

bfloat16 datasets (opaque 2-byte values with the attribute ``dtype="bfloat16"``, as
Keras writes them) read as bfloat16.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .._base.dtypes import BY_FRAMEWORK_NAME, ITEMSIZE, MAX_DIMS, NUMPY_NATIVE, numel
from .._base.errors import FormatError
from .._base.limits import DecodeBudget
from .._base.types import PathLike
from .._file.manifest import Manifest
from .._file.sharing import Source
from ._common import ForeignCheckpoint, check_shape, check_tensor, decoding, need
from ._lazy import FileReader, Held, held, plan_lazily

#: A chunked dataset may decompress to at most this multiple of the bytes it occupies
#: (deflate tops out near 1032:1), plus a small allowance for never-written fill values.
MAX_RATIO = 1100
FILL_ALLOWANCE = 1 << 22
MAX_DATASETS = 1_000_000
FIX = "the file is damaged or was not written by Keras; save the weights again"
#: HDF5 filter ids decoded by HDF5 itself or by h5py (LZF): deflate, shuffle,
#: Fletcher-32, n-bit, scale-offset, LZF.
FILTERS = {1: "deflate", 2: "shuffle", 3: "fletcher32", 5: "nbit", 6: "scaleoffset", 32000: "lzf"}
ONLY_THIS_FILE = "weightvault reads no file but the one given"
#: The root attribute holding weightvault's manifest; Keras reads no attribute of the root.
MANIFEST_ATTR = "weightvault"
MANIFEST_VERSION = 1
#: The largest manifest attribute read (a Keras model's names fit many times over).
MAX_MANIFEST = 64 << 20


@dataclass
class Declared:
    """What weightvault's manifest attribute says about a file's datasets."""

    frozen: list[str] = field(default_factory=list)
    copies: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    def encode(self) -> str:
        doc = {
            "version": MANIFEST_VERSION,
            "frozen": self.frozen,
            "copies": self.copies,
            "metadata": self.metadata,
        }
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Region:
    """Where the HDF5 bytes are: the whole file, or one member of an archive.

    Attributes:
        path: The file on disk.
        start: Offset of the HDF5 file's first byte in it.
        size: Length of the HDF5 file.
        label: How messages name it (the file, or ``archive (member '...')``).
        inflated: The member's bytes, when it was compressed (then read from memory).
    """

    path: str
    start: int
    size: int
    label: str
    inflated: bytes | None = None

    @contextlib.contextmanager
    def open(self) -> Iterator[Any]:
        """What h5py opens: the path, or a read-only file object over the region."""
        if self.inflated is not None:
            yield io.BytesIO(self.inflated)
        elif self.start == 0 and self.size == os.path.getsize(self.path):
            yield self.path
        else:
            with Window(self.path, self.start, self.size) as w:
                yield w


class Window(io.RawIOBase):
    """Bytes ``[start, start + size)`` of a file as a read-only file of their own.

    h5py reads an archive member through it; nothing outside the window can be read,
    so offsets in a crafted HDF5 member cannot reach the rest of the archive.
    """

    def __init__(self, path: str, start: int, size: int) -> None:
        super().__init__()
        self._file = io.FileIO(path, "rb")
        self._start, self._size, self._pos = start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(view.nbytes, self._size - self._pos))
        got = os.preadv(self._file.fileno(), [view[:n]], self._start + self._pos) if n else 0
        self._pos += got
        return got

    def close(self) -> None:
        self._file.close()
        super().close()


class H5Checkpoint(ForeignCheckpoint):
    """A Keras HDF5 file as a checkpoint; contiguous datasets are read with ``preadv``
    when asked for (:class:`~._common.Lazy`)."""

    def __init__(
        self,
        region: Region,
        arrays: dict[str, tuple[str, tuple[int, ...], Held]],
        manifest: Manifest,
        file: FileReader | None,
        declared: Declared | None = None,
    ) -> None:
        super().__init__(region.path, arrays, manifest, "keras", file=file)
        self.region = region
        #: weightvault's manifest attribute, ``None`` for a file Keras wrote.
        self.declared = declared


def open_keras_h5(path: PathLike, *, max_decoded_bytes: int | None = None) -> H5Checkpoint:
    """Open a Keras ``.weights.h5`` file as a checkpoint named by dataset paths.

    Args:
        path: The HDF5 file.
        max_decoded_bytes: The most bytes chunked datasets and names may take in all;
            ``None`` means the default of :mod:`weightvault._base.limits`.

    Raises:
        FormatError: The file is not valid HDF5, links or stores data outside itself,
            uses a soft link or an unknown filter, holds a dataset that is not numeric
            (the message names it), or decodes to more than the limit.
        BackendNotInstalled: h5py is not installed.

    Example:
        >>> ckpt = open_keras_h5("model.weights.h5")
        >>> ckpt.names[:2]
        ['layers/dense/vars/0', 'layers/dense/vars/1']
    """
    where = os.fspath(path)
    size = os.stat(where).st_size
    budget = DecodeBudget(where, size, max_decoded_bytes)
    return read_region(Region(where, 0, size, where), budget)


def read_region(region: Region, budget: DecodeBudget) -> H5Checkpoint:
    """Read the HDF5 file in ``region`` (see the module).

    Its contiguous datasets are read from the file when asked for (through a
    :class:`~._common.FileReader` the checkpoint closes), never mapped; those of an
    inflated archive member from its bytes in memory.
    """
    h5py = need("h5py", "reading Keras .weights.h5 files")
    file = FileReader(region.path, region.label) if region.inflated is None else None
    try:
        return _read(h5py, region, file, budget)
    except BaseException:
        if file is not None:
            file.close()
        raise


def _read(h5py: Any, region: Region, file: FileReader | None, budget: DecodeBudget) -> H5Checkpoint:
    where = region.label
    reader = _Reader(h5py, region, file, budget)
    with region.open() as source:
        try:
            f = h5py.File(source, "r")
        except (OSError, ValueError) as e:
            raise FormatError(
                f"{where}: not a readable HDF5 file ({str(e)[:120]}); {FIX}"
            ) from None
        try:
            reader.walk(f, "", [])
            declared = read_declared(f, where, budget, {s.name for s in reader.out})
        except FormatError:
            raise
        except Exception as e:  # h5py raises OSError, KeyError, RuntimeError on bad files
            raise FormatError(
                f"{where}: HDF5 error while reading ({type(e).__name__}: {str(e)[:120]}); {FIX}"
            ) from None
        finally:
            f.close()
    with decoding(where, FIX):
        return _build(region, reader, declared, file)


def _build(
    region: Region, reader: _Reader, declared: Declared | None, file: FileReader | None
) -> H5Checkpoint:
    """Plan the datasets as a save without ``dedupe_copies`` would: equal ones stay stored
    and are listed as duplicates, except the copies the manifest declares."""
    mine = declared
    declared = declared or Declared()
    frozen = set(declared.frozen)
    sources = []
    for s in reader.out:
        check_tensor(region.label, s.name, s.dtype, s.shape)
        identity = ("copy", s.name) if s.name in declared.copies else s.identity
        sources.append(Source(s.name, s.dtype, s.shape, identity, s.data, s.name in frozen))
    p = plan_lazily(sources, dedupe_copies=False)
    for name in declared.copies:
        if name in p.duplicates:  # stored once in the file: a copy, not a second tensor
            p.copies[name] = p.duplicates.pop(name)
    p.stored = [s for s in p.stored if s.name not in p.copies]
    arrays = {s.name: (s.dtype, s.shape, held(s.data)) for s in p.stored}
    manifest = p.manifest(declared.metadata, ours=False)
    return H5Checkpoint(region, arrays, manifest, file, mine)


def read_declared(f: Any, where: str, budget: DecodeBudget, names: set[str]) -> Declared | None:
    """weightvault's manifest attribute of an open HDF5 file (``None`` if it has none),
    validated against the dataset ``names``.

    Raises:
        FormatError: The attribute is not the JSON weightvault writes, or names a dataset
            the file does not hold.
    """
    if MANIFEST_ATTR not in f.attrs:
        return None
    raw = f.attrs[MANIFEST_ATTR]
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "replace")
    if not isinstance(raw, str) or len(raw) > MAX_MANIFEST:
        raise FormatError(f"{where}: the attribute {MANIFEST_ATTR!r} is not a JSON string; {FIX}")
    budget.charge(f"the attribute {MANIFEST_ATTR!r}", len(raw))
    bad = FormatError(f"{where}: the attribute {MANIFEST_ATTR!r} is not weightvault's; {FIX}")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad from None
    if not isinstance(doc, dict) or doc.get("version") != MANIFEST_VERSION:
        raise bad
    frozen, copies, metadata = doc.get("frozen", []), doc.get("copies", {}), doc.get("metadata", {})
    if not (
        isinstance(frozen, list)
        and isinstance(copies, dict)
        and isinstance(metadata, dict)
        and all(isinstance(v, str) for v in [*frozen, *copies.values(), *metadata.values()])
    ):
        raise bad
    unknown = [n for n in [*frozen, *copies, *copies.values()] if n not in names]
    if unknown:
        raise FormatError(
            f"{where}: the attribute {MANIFEST_ATTR!r} names {unknown[0][:120]!r}, which is "
            f"no dataset of the file; {FIX}"
        )
    return Declared(frozen, copies, metadata)


def _order(key: str) -> tuple[int, int, str]:
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def object_key(h5py: Any, obj: Any) -> Hashable:
    """What identifies an HDF5 object, whichever path reached it."""
    info = h5py.h5o.get_info(obj.id)
    token = getattr(info, "token", None)
    return ("token", bytes(token)) if token is not None else ("addr", info.addr)


class _Reader:
    """One walk of a file: every dataset as a source, and where each contiguous one lies."""

    def __init__(
        self, h5py: Any, region: Region, file: FileReader | None, budget: DecodeBudget
    ) -> None:
        self.h5py, self.region, self.file, self.budget = h5py, region, file, budget
        self.where = region.label
        self.out: list[Source] = []
        self.groups: dict[Hashable, str] = {}

    def walk(self, group: Any, prefix: str, ancestors: list[Hashable]) -> None:
        where = self.where
        if len(ancestors) > MAX_DIMS:
            raise FormatError(f"{where}: groups nested over {MAX_DIMS} deep at {prefix!r}; {FIX}")
        for key in sorted(checked_keys(group, prefix, where), key=_order):
            name = f"{prefix}{key}"
            self.budget.charge_name(name)
            obj = hard_link(self.h5py, group, key, name, where)
            ident = object_key(self.h5py, obj)
            if isinstance(obj, self.h5py.Group):
                if ident in ancestors:
                    raise FormatError(f"{where}: group {name!r} contains itself (a link cycle)")
                if ident in self.groups:
                    raise FormatError(
                        f"{where}: group {name!r} is also linked as {self.groups[ident]!r}; a "
                        "group linked twice makes every path under it twice, which Keras "
                        f"never does. {FIX}"
                    )
                self.groups[ident] = name
                self.walk(obj, f"{name}/", [*ancestors, ident])
            elif isinstance(obj, self.h5py.Dataset):
                if len(self.out) >= MAX_DATASETS:
                    raise FormatError(f"{where}: more than {MAX_DATASETS} datasets; {FIX}")
                self.out.append(self.dataset(obj, name, ident))

    def dataset(self, ds: Any, name: str, ident: Hashable) -> Source:
        np = need("numpy", "reading Keras .weights.h5 files")
        where = self.where
        check_storage(self.h5py, ds, name, where)
        dtype = dataset_dtype(ds, name, where)
        shape = check_shape(where, name, ds.shape)
        n = numel(shape) * ITEMSIZE[dtype]
        little = ds.dtype.byteorder in ("<", "=", "|") or ds.dtype.itemsize == 1
        offset = ds.id.get_offset() if ds.chunks is None and ds.compression is None else None
        if offset is not None and little and n and offset + n <= self.region.size:
            # The bytes are in the file exactly as safetensors wants them: read when asked
            # for (finding duplicates included), so nothing of the file stays in memory.
            if self.file is not None:
                lazy = self.file.span(self.region.start + offset, n, name)
                return Source(name, dtype, shape, ident, lazy)
            assert self.region.inflated is not None
            view = memoryview(self.region.inflated)[offset : offset + n]
            return Source(name, dtype, shape, ident, lambda: view)
        stored = ds.id.get_storage_size()
        if n > MAX_RATIO * stored + FILL_ALLOWANCE:
            raise FormatError(
                f"{where}: dataset {name!r} is {dtype}{list(shape)} ({n} bytes) but occupies "
                f"only {stored} bytes of the file; {FIX}"
            )
        self.budget.charge(f"dataset {name!r}", n)
        arr = ds[()] if n else np.empty(0, dtype=np.uint8)
        arr = np.ascontiguousarray(arr)
        if dtype != "BF16" and arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        data = memoryview(arr.reshape(-1).view(np.uint8)) if n else memoryview(b"")
        if data.nbytes != n:
            raise FormatError(f"{where}: dataset {name!r} read {data.nbytes} bytes, not {n}")
        return Source(name, dtype, shape, ident, lambda: data)


def checked_keys(group: Any, prefix: str, where: str) -> list[str]:
    """The names in ``group``; one that is not UTF-8 is refused."""
    keys = list(group.keys())
    for key in keys:
        if not isinstance(key, str):  # h5py hands out names that are not UTF-8 as bytes
            raise FormatError(
                f"{where}: the name {bytes(key)[:80]!r} under {prefix!r} is not UTF-8; {FIX}"
            )
    return keys


def dataset_dtype(ds: Any, name: str, where: str) -> str:
    """The safetensors dtype of a dataset (bfloat16 as Keras marks it), or refused."""
    dt = ds.dtype
    marked = ds.attrs.get("dtype")
    if isinstance(marked, bytes):
        marked = marked.decode("latin-1")
    simple = dt.names is None and dt.subdtype is None
    if dt.kind == "V" and dt.itemsize == 2 and marked == "bfloat16":
        return "BF16"
    if simple and BY_FRAMEWORK_NAME.get(dt.name) in NUMPY_NATIVE:
        # numpy names a dtype the same in either byte order; the bytes are swapped later.
        return BY_FRAMEWORK_NAME[dt.name]
    raise FormatError(
        f"{where}: dataset {name!r} has dtype {str(dt)[:60]}, which is not a tensor "
        "dtype safetensors can store; remove it from the file or convert it first"
    )


def hard_link(h5py: Any, group: Any, key: str, name: str, where: str) -> Any:
    """What ``group[key]`` links to; refused unless the link is a hard one."""
    try:
        link = group.get(key, getlink=True)
    except TypeError:  # h5py's answer for a user-defined link type
        link = None
    if isinstance(link, h5py.ExternalLink):
        raise FormatError(
            f"{where}: {name!r} is an external link to {link.filename[:200]!r}; "
            f"{ONLY_THIS_FILE}. Copy the data into this file"
        )
    if isinstance(link, h5py.SoftLink):
        raise FormatError(
            f"{where}: {name!r} is a soft link to {link.path[:200]!r}; soft links "
            "resolve by path (possibly through another file), so only hard links are "
            "read. Copy the data, or link it with a hard link"
        )
    if not isinstance(link, h5py.HardLink):
        raise FormatError(f"{where}: {name!r} is a link of an unknown type; {FIX}")
    obj = group.get(key)
    if obj is None:
        raise FormatError(f"{where}: {name!r} is a link to nothing; {FIX}")
    return obj


def check_storage(h5py: Any, ds: Any, name: str, where: str) -> None:
    """Refuse storage that reads other files or needs a filter HDF5 would load as a plugin.

    Checked on the dataset creation property list, before the dataset's bytes are read.
    """
    dcpl = ds.id.get_create_plist()
    if dcpl.get_layout() == h5py.h5d.VIRTUAL:
        raise FormatError(
            f"{where}: dataset {name!r} is virtual (it maps other files); {ONLY_THIS_FILE}"
        )
    if dcpl.get_external_count() > 0:
        other = dcpl.get_external(0)[0]
        raise FormatError(
            f"{where}: dataset {name!r} keeps its bytes in an external file "
            f"({bytes(other)[:200]!r}); {ONLY_THIS_FILE}. Copy the data into this file"
        )
    for i in range(dcpl.get_nfilters()):
        code = dcpl.get_filter(i)[0]
        if code not in FILTERS:
            raise FormatError(
                f"{where}: dataset {name!r} uses HDF5 filter {code}, which is not one of "
                f"{sorted(FILTERS.values())}; rewrite the file without it (h5repack -f NONE)"
            )
