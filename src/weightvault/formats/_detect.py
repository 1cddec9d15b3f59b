"""What format a checkpoint file is in, from its first bytes (never from its name).

The one place that sniffs a file: :func:`weightvault._open.open_checkpoint` and
:func:`weightvault.formats.open_any` both dispatch on what :func:`detect` says. The table
of formats and their first bytes is in :mod:`weightvault.formats`.
"""

from __future__ import annotations

import os
import re
import struct
import zipfile

#: Formats read by a reader in this package (everything but safetensors).
FOREIGN = frozenset({"mxnet", "torch", "pickle", "npz", "npy", "hdf5"})
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
#: An MXNet NDArray list opens with this u64, then a reserved u64 ``0``.
MXNET_LIST_MAGIC = 0x112
ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
#: A protocol 0/1 pickle opens with a global (``cmodule\nname\n``), an instance
#: (``(i``) or a dict/list (``(dp0``, ``}q``, ``]q``).
PROTOCOL0 = re.compile(rb"(c[\w.]+\n[\w.]+\n|\((i|c|dp|lp)[\w.]|[}\]](q|\(|h))")


def detect(path: str | os.PathLike[str]) -> str:
    """Name the format of ``path`` from its first bytes.

    Returns:
        One of ``"safetensors"``, ``"mxnet"``, ``"torch"`` (``torch.save`` zip),
        ``"pickle"`` (legacy ``torch.save`` or a plain pickle), ``"npz"``, ``"npy"``,
        ``"hdf5"`` (Keras ``.weights.h5``), or ``"unknown"``.

    Raises:
        OSError: The file cannot be read.

    Example:
        >>> detect("pytorch_model.bin")
        'torch'
    """
    where = os.fspath(path)
    with open(where, "rb") as f:
        head = f.read(64)
        size = os.fstat(f.fileno()).st_size
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if head[8:9] == b"{" and 8 + n <= size:
            return "safetensors"
    if is_mxnet(head):
        return "mxnet"
    if head.startswith(HDF5_MAGIC):
        return "hdf5"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head[:4] in ZIP_MAGICS:
        return _zip_kind(where)
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if PROTOCOL0.match(head):  # text pickles (protocols 0 and 1): scanned, then refused
        return "pickle"
    return "unknown"


def _zip_kind(path: str) -> str:
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
        # NotImplementedError: a damaged entry claims a zip version zipfile cannot read.
        return "unknown"
    if any(n.count("/") == 1 and n.endswith("/data.pkl") for n in names):
        return "torch"
    if names and all(n.endswith(".npy") for n in names if not n.endswith("/")):
        return "npz"
    return "unknown"


def is_mxnet(head: bytes) -> bool:
    """Whether the first 16 bytes are an NDArray list header (magic, then reserved 0)."""
    return len(head) >= 16 and struct.unpack("<QQ", head[:16]) == (MXNET_LIST_MAGIC, 0)
