"""Keras 3 ``.weights.h5`` files (and other HDF5 files of plain numeric datasets).

Every dataset becomes a name: its HDF5 path, such as ``layers/dense/vars/0``. Groups are
walked with numeric keys in numeric order (``vars/2`` before ``vars/10``), the order
Keras wrote them. A dataset reachable through two hard links is one object, so its
second path becomes an alias; Keras's duplicate datasets (one variable shared by two
layers is written once per layer) hold equal bytes and become copies.

Contiguous, unfiltered datasets are slices of a read-only file map; chunked or
compressed ones are read through h5py, after their size is checked against the bytes
they occupy. External links and virtual datasets, which read other files, are refused.
bfloat16 datasets (opaque 2-byte values with the attribute ``dtype="bfloat16"``, as
Keras writes them) read as bfloat16.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Any

from .._dtypes import ITEMSIZE, numel
from .._errors import FormatError
from .._plan import Source
from ._common import MAX_DIMS, ForeignCheckpoint, build, check_shape, map_file, need

#: numpy dtype kind + itemsize -> safetensors dtype name.
KINDS = {
    ("f", 2): "F16",
    ("f", 4): "F32",
    ("f", 8): "F64",
    ("i", 1): "I8",
    ("i", 2): "I16",
    ("i", 4): "I32",
    ("i", 8): "I64",
    ("u", 1): "U8",
    ("u", 2): "U16",
    ("u", 4): "U32",
    ("u", 8): "U64",
    ("b", 1): "BOOL",
    ("c", 8): "C64",
}
#: A chunked dataset may decompress to at most this multiple of the bytes it occupies
#: (deflate tops out near 1032:1), plus a small allowance for never-written fill values.
MAX_RATIO = 1100
FILL_ALLOWANCE = 1 << 22
MAX_DATASETS = 1_000_000
FIX = "the file is damaged or was not written by Keras; save the weights again"


def open_keras_h5(path: str | os.PathLike[str]) -> ForeignCheckpoint:
    """Open a Keras ``.weights.h5`` file as a checkpoint named by dataset paths.

    Raises:
        FormatError: The file is not valid HDF5, links outside itself, or holds a
            dataset that is not numeric (the message names it).
        BackendNotInstalled: h5py is not installed.

    Example:
        >>> ckpt = open_keras_h5("model.weights.h5")
        >>> ckpt.names[:2]
        ['layers/dense/vars/0', 'layers/dense/vars/1']
    """
    h5py = need("h5py", "reading Keras .weights.h5 files")
    where = os.fspath(path)
    try:
        f = h5py.File(where, "r")
    except (OSError, ValueError) as e:
        raise FormatError(f"{where}: not a readable HDF5 file ({str(e)[:120]}); {FIX}") from None
    mm, _ = map_file(where)
    buf = memoryview(mm) if mm is not None else memoryview(b"")
    sources: list[Source] = []
    try:
        _walk(h5py, f, "", [], sources, buf, where)
    except FormatError:
        raise
    except Exception as e:  # h5py raises OSError, KeyError, RuntimeError on bad files
        raise FormatError(
            f"{where}: HDF5 error while reading ({type(e).__name__}: {str(e)[:120]}); {FIX}"
        ) from None
    finally:
        f.close()
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
) -> None:
    if len(ancestors) > MAX_DIMS:
        raise FormatError(f"{where}: groups nested over {MAX_DIMS} deep at {prefix!r}; {FIX}")
    for key in sorted(group.keys(), key=_order):
        name = f"{prefix}{key}"
        link = group.get(key, getlink=True)
        if isinstance(link, h5py.ExternalLink):
            raise FormatError(
                f"{where}: {name!r} is an external link to {link.filename!r}; weightvault "
                "reads no file but the one given. Copy the data into this file"
            )
        obj = group.get(key)
        if obj is None:  # a dangling soft link
            raise FormatError(f"{where}: {name!r} is a link to nothing; {FIX}")
        ident = _object_key(h5py, obj)
        if isinstance(obj, h5py.Group):
            if ident in ancestors:
                raise FormatError(f"{where}: group {name!r} contains itself (a link cycle)")
            _walk(h5py, obj, f"{name}/", [*ancestors, ident], out, buf, where)
        elif isinstance(obj, h5py.Dataset):
            if len(out) >= MAX_DATASETS:
                raise FormatError(f"{where}: more than {MAX_DATASETS} datasets; {FIX}")
            out.append(_dataset(h5py, obj, name, ident, buf, where))


def _dataset(h5py: Any, ds: Any, name: str, ident: Hashable, buf: memoryview, where: str) -> Source:
    np = need("numpy", "reading Keras .weights.h5 files")
    if ds.is_virtual:
        raise FormatError(
            f"{where}: dataset {name!r} is virtual (it reads other files); weightvault reads "
            "no file but the one given"
        )
    dt = ds.dtype
    marked = ds.attrs.get("dtype")
    if isinstance(marked, bytes):
        marked = marked.decode("latin-1")
    if dt.kind == "V" and dt.itemsize == 2 and marked == "bfloat16":
        dtype = "BF16"
    elif (dt.kind, dt.itemsize) in KINDS and dt.names is None and dt.subdtype is None:
        dtype = KINDS[(dt.kind, dt.itemsize)]
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
    arr = ds[()] if n else np.empty(0, dtype=np.uint8)
    arr = np.ascontiguousarray(arr)
    if dtype != "BF16" and arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    data = memoryview(arr.reshape(-1).view(np.uint8)) if n else memoryview(b"")
    if data.nbytes != n:
        raise FormatError(f"{where}: dataset {name!r} read {data.nbytes} bytes, not {n}")
    return Source(name, dtype, shape, ident, lambda: data)
