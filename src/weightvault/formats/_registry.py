"""Every format weightvault reads, in one table: how it is recognised, and its reader.

A file's format is named from its first bytes, never from its name: :func:`detect`
tries the sniffs of :data:`FORMATS` in order and takes the first that matches, and
:func:`open_any` and :func:`open_checkpoint` open the file with that row's reader. A
reader's module is imported only when a file of its kind is opened, so reading a
safetensors file never imports pickle machinery, h5py or numpy.

Adding a format is one row here (and a case in ``tests/test_formats_registry.py``,
which opens a real file of every row through :func:`open_any`).

Example:
    >>> [f.name for f in FORMATS]
    ['safetensors', 'mxnet', 'hdf5', 'keras', 'npy', 'torch', 'npz', 'pickle']
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

from .._base.errors import FormatError
from .._base.types import PathLike
from .._file.checkpoint import Checkpoint, SafetensorsFile
from ._common import HDF5_MAGIC, MXNET_LIST_MAGIC, NPY_MAGIC, ZIP_MAGICS

__all__ = [
    "FOREIGN",
    "FORMATS",
    "Format",
    "detect",
    "open_any",
    "open_checkpoint",
    "open_kind",
    "opened",
]

#: How many bytes a sniff sees; every magic above fits well within it.
HEAD_BYTES = 64
#: A protocol 0/1 pickle opens with a global (``cmodule\nname\n``), an instance
#: (``(i``) or a dict/list (``(dp0``, ``}q``, ``]q``).
PROTOCOL0 = re.compile(rb"(c[\w.]+\n[\w.]+\n|\((i|c|dp|lp)[\w.]|[}\]](q|\(|h))")


class Head:
    """What a sniff looks at: a file's first bytes, its size and, for a zip, its members."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.first = f.read(HEAD_BYTES)
            self.size = os.fstat(f.fileno()).st_size

    @cached_property
    def zip_names(self) -> list[str]:
        """The archive's member names; empty when it is not a zip zipfile can list."""
        if self.first[:4] not in ZIP_MAGICS:
            return []
        try:
            with zipfile.ZipFile(self.path) as z:
                return z.namelist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
            # NotImplementedError: a damaged entry claims a zip version zipfile cannot read.
            return []


#: A reader: the path and the decode limit (``None``: the default) to a checkpoint.
Opener = Callable[[str, int | None], Checkpoint]


@dataclass(frozen=True)
class Format:
    """One row of the table.

    Attributes:
        name: What :func:`detect` returns for it.
        sniff: Whether a file's :class:`Head` is of this format.
        open: Its reader.
    """

    name: str
    sniff: Callable[[Head], bool]
    open: Opener


def _is_safetensors(head: Head) -> bool:
    """A u64 header length that fits the file, then ``{``."""
    if len(head.first) < 9:
        return False
    (n,) = struct.unpack("<Q", head.first[:8])
    return head.first[8:9] == b"{" and 8 + n <= head.size


def _is_mxnet(head: Head) -> bool:
    """An NDArray list: u64 ``0x112``, then a reserved u64 ``0``."""
    first = head.first
    return len(first) >= 16 and struct.unpack("<QQ", first[:16]) == (MXNET_LIST_MAGIC, 0)


def _is_hdf5(head: Head) -> bool:
    """The HDF5 signature (Keras ``.weights.h5``)."""
    return head.first.startswith(HDF5_MAGIC)


def _is_keras(head: Head) -> bool:
    """A zip holding ``config.json`` and the weights, as ``model.save("x.keras")`` writes."""
    names = set(head.zip_names)
    return "config.json" in names and bool(names & {"model.weights.h5", "model.weights.npz"})


def _is_npy(head: Head) -> bool:
    """A single ``.npy`` array."""
    return head.first.startswith(NPY_MAGIC)


def _is_torch_zip(head: Head) -> bool:
    """A zip holding ``<name>/data.pkl``, as ``torch.save`` writes since 1.6."""
    return any(n.count("/") == 1 and n.endswith("/data.pkl") for n in head.zip_names)


def _is_npz(head: Head) -> bool:
    """A zip of ``*.npy`` members only."""
    files = [n for n in head.zip_names if not n.endswith("/")]
    return bool(head.zip_names) and all(n.endswith(".npy") for n in files)


def _is_pickle(head: Head) -> bool:
    """``\\x80`` and a protocol (legacy ``torch.save``, pickle), or a text pickle."""
    first = head.first
    if len(first) >= 2 and first[0] == 0x80 and 2 <= first[1] <= 5:
        return True
    return PROTOCOL0.match(first) is not None  # text pickles: scanned, then refused


# The readers, each imported when a file of its kind is first opened.


def _open_safetensors(path: str, limit: int | None) -> Checkpoint:
    return SafetensorsFile(path)  # it decodes nothing, so it has no limit to honour


def _open_mxnet(path: str, limit: int | None) -> Checkpoint:
    from .mxnet import open_mxnet

    return open_mxnet(path, max_decoded_bytes=limit)


def _open_torch(path: str, limit: int | None) -> Checkpoint:
    from .torch_pickle import open_torch

    return open_torch(path, max_decoded_bytes=limit)


def _open_npz(path: str, limit: int | None) -> Checkpoint:
    from .npz import open_npz

    return open_npz(path, max_decoded_bytes=limit)


def _open_keras_h5(path: str, limit: int | None) -> Checkpoint:
    from .keras_h5 import open_keras_h5

    return open_keras_h5(path, max_decoded_bytes=limit)


def _open_keras(path: str, limit: int | None) -> Checkpoint:
    from .keras_archive import open_keras_archive

    return open_keras_archive(path, max_decoded_bytes=limit)


#: Every format, in the order :func:`detect` tries them.
FORMATS: tuple[Format, ...] = (
    Format("safetensors", _is_safetensors, _open_safetensors),
    Format("mxnet", _is_mxnet, _open_mxnet),
    Format("hdf5", _is_hdf5, _open_keras_h5),
    Format("keras", _is_keras, _open_keras),
    Format("npy", _is_npy, _open_npz),
    Format("torch", _is_torch_zip, _open_torch),
    Format("npz", _is_npz, _open_npz),
    Format("pickle", _is_pickle, _open_torch),
)
BY_NAME = {f.name: f for f in FORMATS}
#: Formats read by a reader in this package (everything but safetensors).
FOREIGN = frozenset(BY_NAME) - {"safetensors"}


def detect(path: PathLike) -> str:
    """Name the format of ``path`` from its first bytes.

    Returns:
        One of ``"safetensors"``, ``"mxnet"``, ``"torch"`` (``torch.save`` zip),
        ``"pickle"`` (legacy ``torch.save`` or a plain pickle), ``"npz"``, ``"npy"``,
        ``"hdf5"`` (Keras ``.weights.h5``), ``"keras"`` (a ``.keras`` archive), or
        ``"unknown"``.

    Raises:
        OSError: The file cannot be read.

    Example:
        >>> detect("pytorch_model.bin")
        'torch'
    """
    head = Head(os.fspath(path))
    return next((f.name for f in FORMATS if f.sniff(head)), "unknown")


def open_kind(path: PathLike, kind: str, max_decoded_bytes: int | None = None) -> Checkpoint:
    """Open ``path`` with the reader of ``kind`` (what :func:`detect` said).

    A kind with no row (``"unknown"``) goes to the safetensors reader, whose errors say
    precisely what is wrong with a file that was meant to be safetensors.
    """
    return BY_NAME.get(kind, BY_NAME["safetensors"]).open(os.fspath(path), max_decoded_bytes)


def open_checkpoint(path: PathLike | Checkpoint) -> Checkpoint:
    """Open ``path`` (or pass a :class:`Checkpoint` through).

    Raises:
        FormatError: The file is not a valid checkpoint.
    """
    if isinstance(path, Checkpoint):
        return path
    try:
        return open_kind(path, detect(path))
    except IsADirectoryError as e:
        raise FormatError(f"{os.fspath(path)}: is a directory, not a checkpoint file") from e


@contextlib.contextmanager
def opened(path: PathLike | Checkpoint) -> Iterator[Checkpoint]:
    """Open ``path`` for the ``with`` block; a :class:`Checkpoint` passed in stays open."""
    ckpt = open_checkpoint(path)
    try:
        yield ckpt
    finally:
        if ckpt is not path:
            ckpt.close()


def open_any(path: PathLike, *, max_decoded_bytes: int | None = None) -> Checkpoint:
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
    if kind == "unknown":
        raise FormatError(
            f"{os.fspath(path)}: not a checkpoint format weightvault reads (safetensors, MXNet "
            ".params, torch .pt/.bin, Keras .weights.h5 and .keras, numpy .npz); check the file is "
            "complete, or convert it with the framework that wrote it"
        )
    return open_kind(path, kind, max_decoded_bytes)
