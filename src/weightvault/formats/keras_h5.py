"""Keras 3 ``.weights.h5`` files (and other HDF5 files of plain numeric datasets).

Every dataset becomes a name: its HDF5 path, such as ``layers/dense/vars/0``. Groups are
walked with numeric keys in numeric order (``vars/2`` before ``vars/10``), the order
Keras wrote them. A dataset reachable through two hard links is one object, so its
second path becomes an alias; Keras's duplicate datasets (one variable shared by two
layers is written once per layer) hold equal bytes and become copies.

Contiguous, unfiltered datasets are slices of a read-only file map; chunked or
compressed ones are read through h5py, after their size is checked against the bytes
they occupy and charged to the file's :class:`~weightvault._base.limits.DecodeBudget` (so 300
unwritten datasets cannot add up to gigabytes). A group reachable through two paths is
refused, so groups hard-linked into each other cannot multiply the paths walked (2**21
from a few kB); a dataset reachable through two paths is an alias, as above.

Nothing but the given file is ever read. Refused, before any data is read:

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

import os
from collections.abc import Hashable
from typing import Any

from .._base.dtypes import BY_FRAMEWORK_NAME, ITEMSIZE, MAX_DIMS, NUMPY_NATIVE, numel
from .._base.errors import FormatError
from .._base.limits import DecodeBudget
from .._base.types import PathLike
from .._file.sharing import Source
from ._common import ForeignCheckpoint, build, check_shape, decoding, map_file, need

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


def open_keras_h5(path: PathLike, *, max_decoded_bytes: int | None = None) -> ForeignCheckpoint:
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
    h5py = need("h5py", "reading Keras .weights.h5 files")
    where = os.fspath(path)
    mm, size = map_file(where)
    budget = DecodeBudget(where, size, max_decoded_bytes)
    try:
        f = h5py.File(where, "r")
    except (OSError, ValueError) as e:
        raise FormatError(f"{where}: not a readable HDF5 file ({str(e)[:120]}); {FIX}") from None
    buf = memoryview(mm) if mm is not None else memoryview(b"")
    sources: list[Source] = []
    try:
        _walk(h5py, f, "", [], sources, buf, where, budget)
    except FormatError:
        raise
    except Exception as e:  # h5py raises OSError, KeyError, RuntimeError on bad files
        raise FormatError(
            f"{where}: HDF5 error while reading ({type(e).__name__}: {str(e)[:120]}); {FIX}"
        ) from None
    finally:
        f.close()
    with decoding(where, FIX):
        return build(where, sources, "keras", keep=mm)


def _order(key: str) -> tuple[int, int, str]:
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def _object_key(h5py: Any, obj: Any) -> Hashable:
    info = h5py.h5o.get_info(obj.id)
    token = getattr(info, "token", None)
    return ("token", bytes(token)) if token is not None else ("addr", info.addr)


def _walk(
    h5py: Any,
    group: Any,
    prefix: str,
    ancestors: list[Hashable],
    out: list[Source],
    buf: memoryview,
    where: str,
    budget: DecodeBudget,
    groups: dict[Hashable, str] | None = None,
) -> None:
    groups = {} if groups is None else groups
    if len(ancestors) > MAX_DIMS:
        raise FormatError(f"{where}: groups nested over {MAX_DIMS} deep at {prefix!r}; {FIX}")
    keys = list(group.keys())
    for key in keys:
        if not isinstance(key, str):  # h5py hands out names that are not UTF-8 as bytes
            raise FormatError(
                f"{where}: the name {bytes(key)[:80]!r} under {prefix!r} is not UTF-8; {FIX}"
            )
    for key in sorted(keys, key=_order):
        name = f"{prefix}{key}"
        budget.charge_name(name)
        obj = _hard_link(h5py, group, key, name, where)
        ident = _object_key(h5py, obj)
        if isinstance(obj, h5py.Group):
            if ident in ancestors:
                raise FormatError(f"{where}: group {name!r} contains itself (a link cycle)")
            if ident in groups:
                raise FormatError(
                    f"{where}: group {name!r} is also linked as {groups[ident]!r}; a group "
                    f"linked twice makes every path under it twice, which Keras never does. {FIX}"
                )
            groups[ident] = name
            _walk(h5py, obj, f"{name}/", [*ancestors, ident], out, buf, where, budget, groups)
        elif isinstance(obj, h5py.Dataset):
            if len(out) >= MAX_DATASETS:
                raise FormatError(f"{where}: more than {MAX_DATASETS} datasets; {FIX}")
            out.append(_dataset(h5py, obj, name, ident, buf, where, budget))


def _hard_link(h5py: Any, group: Any, key: str, name: str, where: str) -> Any:
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


def _check_storage(h5py: Any, ds: Any, name: str, where: str) -> None:
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


def _dataset(
    h5py: Any,
    ds: Any,
    name: str,
    ident: Hashable,
    buf: memoryview,
    where: str,
    budget: DecodeBudget,
) -> Source:
    np = need("numpy", "reading Keras .weights.h5 files")
    _check_storage(h5py, ds, name, where)
    dt = ds.dtype
    marked = ds.attrs.get("dtype")
    if isinstance(marked, bytes):
        marked = marked.decode("latin-1")
    simple = dt.names is None and dt.subdtype is None
    if dt.kind == "V" and dt.itemsize == 2 and marked == "bfloat16":
        dtype = "BF16"
    elif simple and BY_FRAMEWORK_NAME.get(dt.name) in NUMPY_NATIVE:
        # numpy names a dtype the same in either byte order; the bytes are swapped below.
        dtype = BY_FRAMEWORK_NAME[dt.name]
    else:
        raise FormatError(
            f"{where}: dataset {name!r} has dtype {str(dt)[:60]}, which is not a tensor "
            "dtype safetensors can store; remove it from the file or convert it first"
        )
    shape = check_shape(where, name, ds.shape)
    n = numel(shape) * ITEMSIZE[dtype]
    little = dt.byteorder in ("<", "=", "|") or dt.itemsize == 1
    offset = ds.id.get_offset() if ds.chunks is None and ds.compression is None else None
    if offset is not None and little and n and offset + n <= buf.nbytes:
        # Zero-copy: the bytes are in the file exactly as safetensors wants them.
        view = buf[offset : offset + n]
        return Source(name, dtype, shape, ident, lambda: view)
    stored = ds.id.get_storage_size()
    if n > MAX_RATIO * stored + FILL_ALLOWANCE:
        raise FormatError(
            f"{where}: dataset {name!r} is {dtype}{list(shape)} ({n} bytes) but occupies "
            f"only {stored} bytes of the file; {FIX}"
        )
    budget.charge(f"dataset {name!r}", n)
    arr = ds[()] if n else np.empty(0, dtype=np.uint8)
    arr = np.ascontiguousarray(arr)
    if dtype != "BF16" and arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    data = memoryview(arr.reshape(-1).view(np.uint8)) if n else memoryview(b"")
    if data.nbytes != n:
        raise FormatError(f"{where}: dataset {name!r} read {data.nbytes} bytes, not {n}")
    return Source(name, dtype, shape, ident, lambda: data)
