"""Readers of foreign checkpoint formats, each returning a :class:`~weightvault._reader.Checkpoint`.

The format is recognised from the file's first bytes, never from its name alone:

==============  ====================================================  ======================
format          first bytes                                           reader
==============  ====================================================  ======================
safetensors     u64 header length, then ``{``                         :class:`SafetensorsFile`
mxnet           u64 ``0x112``, u64 ``0`` (NDArray list)               :mod:`.mxnet`
torch           zip holding ``<name>/data.pkl`` (``torch.save``)      :mod:`.torch_pickle`
pickle          ``\\x80`` + protocol (legacy ``torch.save``, pickle)    :mod:`.torch_pickle`
npz / npy       zip of ``*.npy`` members / ``\\x93NUMPY``               :mod:`.npz`
hdf5            ``\\x89HDF\\r\\n\\x1a\\n`` (Keras ``.weights.h5``)          :mod:`.keras_h5`
==============  ====================================================  ======================

Example:
    >>> from weightvault.formats import detect, open_any
    >>> detect("model-0000.params")
    'mxnet'
    >>> with open_any("model-0000.params") as ckpt:
    ...     ckpt.names[:2]
    ['arg:conv0_weight', 'arg:conv0_bias']
"""

from __future__ import annotations

import os
import re
import struct
import zipfile

from .._errors import FormatError
from .._reader import Checkpoint

__all__ = ["FOREIGN", "detect", "open_any"]

#: Formats read by a reader in this package (everything but safetensors).
FOREIGN = frozenset({"mxnet", "torch", "pickle", "npz", "npy", "hdf5"})
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
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
    from .mxnet import is_mxnet

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


def open_any(path: str | os.PathLike[str], *, max_decoded_bytes: int | None = None) -> Checkpoint:
    """Open a checkpoint in any supported format.

    Args:
        path: The file.
        max_decoded_bytes: The most bytes a foreign reader may decode from the file
            (inflate, densify, copy); ``None`` means ``WEIGHTVAULT_MAX_DECODED_BYTES`` if
            set, else 16 bytes per file byte plus 64 MiB, at most 32 GiB (see
            docs/format.md). safetensors files decode nothing and ignore it.

    Raises:
        FormatError: The format is not recognised, the file is malformed, or decoding it
            would pass the limit (the message says how to raise it).
        BackendNotInstalled: The format needs a package that is not installed.

    Example:
        >>> with open_any("model.weights.h5") as ckpt:
        ...     ckpt.names[0]
        'layers/dense/vars/0'
    """
    kind = detect(path)
    if kind == "safetensors":
        from .._reader import SafetensorsFile

        return SafetensorsFile(path)
    if kind == "mxnet":
        from .mxnet import open_mxnet

        return open_mxnet(path, max_decoded_bytes=max_decoded_bytes)
    if kind in ("torch", "pickle"):
        from .torch_pickle import open_torch

        return open_torch(path, max_decoded_bytes=max_decoded_bytes)
    if kind in ("npz", "npy"):
        from .npz import open_npz

        return open_npz(path, max_decoded_bytes=max_decoded_bytes)
    if kind == "hdf5":
        from .keras_h5 import open_keras_h5

        return open_keras_h5(path, max_decoded_bytes=max_decoded_bytes)
    raise FormatError(
        f"{os.fspath(path)}: not a checkpoint format weightvault reads (safetensors, MXNet "
        ".params, torch .pt/.bin, Keras .weights.h5, numpy .npz); check the file is "
        "complete, or convert it with the framework that wrote it"
    )
