"""The one opener: any checkpoint file, whatever its format, as a :class:`Checkpoint`.

It sits above :mod:`._reader` (safetensors) and :mod:`.formats` (foreign readers), so
neither needs the other: the format is sniffed once, by :func:`._detect.detect`, and the
matching reader is imported only when a file of its kind is opened.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .._base.errors import FormatError
from .._file.checkpoint import Checkpoint, SafetensorsFile
from ._detect import FOREIGN, detect

__all__ = ["open_any", "open_checkpoint", "open_kind", "opened"]


@contextlib.contextmanager
def opened(path: str | os.PathLike[str] | Checkpoint) -> Iterator[Checkpoint]:
    """Open ``path`` for the ``with`` block; a :class:`Checkpoint` passed in stays open."""
    ckpt = open_checkpoint(path)
    try:
        yield ckpt
    finally:
        if ckpt is not path:
            ckpt.close()


def open_checkpoint(path: str | os.PathLike[str] | Checkpoint) -> Checkpoint:
    """Open ``path`` (or pass a :class:`Checkpoint` through).

    Raises:
        FormatError: The file is not a valid checkpoint.
    """
    if isinstance(path, Checkpoint):
        return path
    try:
        # Foreign formats are recognised by their first bytes; anything else, malformed
        # safetensors included, goes to the safetensors reader for its precise errors.
        return open_kind(path, detect(path))
    except IsADirectoryError as e:
        raise FormatError(f"{os.fspath(path)}: is a directory, not a checkpoint file") from e


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
    if kind == "unknown":
        raise FormatError(
            f"{os.fspath(path)}: not a checkpoint format weightvault reads (safetensors, MXNet "
            ".params, torch .pt/.bin, Keras .weights.h5, numpy .npz); check the file is "
            "complete, or convert it with the framework that wrote it"
        )
    return open_kind(path, kind, max_decoded_bytes)


def open_kind(
    path: str | os.PathLike[str], kind: str, max_decoded_bytes: int | None = None
) -> Checkpoint:
    """Open ``path`` with the reader of ``kind`` (what :func:`detect` said; anything not
    foreign goes to the safetensors reader, for its precise errors)."""
    if kind not in FOREIGN:
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
    raise AssertionError(kind)  # pragma: no cover - FOREIGN lists every reader
