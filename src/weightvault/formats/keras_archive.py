"""Keras ``.keras`` archives: a zip of ``config.json``, ``metadata.json`` and the weights.

The weights are a ``.weights.h5`` file stored as the member ``model.weights.h5``; Keras
writes it uncompressed, so it is read in place (:class:`~.keras_h5.Window`), with the
same checks as a file of its own. Every member is vetted before anything is read:

* a member name that is absolute, climbs out with ``..``, uses backslashes or a drive
  letter, or appears twice is refused (a tool that unpacks the archive would write
  outside its folder, or a reader could pick either copy);
* a compressed member that claims to expand over :data:`MAX_RATIO` times its stored
  size (deflate tops out near 1032:1) is a zip bomb, refused before it is inflated, and
  what inflating may allocate is charged to the file's decode budget;
* a stored member must lie inside the file.

Each refusal is a :class:`~weightvault.FormatError` naming the member.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import zipfile
from collections.abc import Callable, Iterator, Sequence
from typing import IO

from .._base.atomic import atomic_file
from .._base.errors import FormatError
from .._base.limits import DecodeBudget
from .._base.reports import SaveReport
from .._base.types import PathLike
from ._common import map_file, stored_zip_member
from .keras_h5 import Declared, H5Checkpoint, Region, open_keras_h5, read_region
from .keras_write import Group, H5Dataset, rewrite_plan, save_h5, write_h5

CONFIG = "config.json"
METADATA = "metadata.json"
WEIGHTS = "model.weights.h5"
FIX = "the archive is damaged or was not written by Keras; save the model again"
#: A compressed member may expand to at most this multiple of its stored size.
MAX_RATIO = 1100
MAX_MEMBERS = 100_000
#: The largest config.json or metadata.json read.
MAX_JSON = 32 << 20
_DRIVE = re.compile(r"^[A-Za-z]:")


def _check_name(name: str, where: str) -> None:
    parts = name.split("/")
    if name.startswith("/") or "\\" in name or "\0" in name or _DRIVE.match(name) or ".." in parts:
        raise FormatError(
            f"{where}: member {name[:200]!r} has a path that leaves the archive's folder "
            f"(absolute, '..', a backslash or a drive); {FIX}"
        )


def _check_size(info: zipfile.ZipInfo, where: str) -> None:
    name = info.filename
    if info.compress_type == zipfile.ZIP_STORED:
        if info.file_size != info.compress_size:
            raise FormatError(
                f"{where}: member {name[:200]!r} is stored uncompressed but claims "
                f"{info.file_size} bytes in {info.compress_size}; {FIX}"
            )
    elif info.compress_type != zipfile.ZIP_DEFLATED:
        raise FormatError(
            f"{where}: member {name[:200]!r} uses zip compression method "
            f"{info.compress_type}; Keras writes members stored or deflated. {FIX}"
        )
    elif info.file_size > MAX_RATIO * info.compress_size + (1 << 16):
        raise FormatError(
            f"{where}: member {name[:200]!r} claims {info.file_size} bytes from "
            f"{info.compress_size} compressed, more than deflate can expand (a zip bomb); "
            f"{FIX}"
        )


def vet(zf: zipfile.ZipFile, where: str) -> dict[str, zipfile.ZipInfo]:
    """Every member by name, once each refusal above has been ruled out.

    Raises:
        FormatError: Naming the first member refused.
    """
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise FormatError(f"{where}: more than {MAX_MEMBERS} members; {FIX}")
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        _check_name(info.filename, where)
        if info.filename in members:
            raise FormatError(f"{where}: member {info.filename[:200]!r} appears twice; {FIX}")
        _check_size(info, where)
        members[info.filename] = info
    return members


@contextlib.contextmanager
def _archive(where: str) -> Iterator[tuple[zipfile.ZipFile, dict[str, zipfile.ZipInfo]]]:
    try:
        zf = zipfile.ZipFile(where)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
        raise FormatError(f"{where}: not a readable zip archive ({str(e)[:120]}); {FIX}") from None
    with zf:
        yield zf, vet(zf, where)


def _inflate(zf: zipfile.ZipFile, info: zipfile.ZipInfo, where: str, limit: int) -> bytes:
    """A member's bytes, never more than ``limit`` nor than it declares."""
    label = f"{where} (member {info.filename!r})"
    if info.file_size > limit:
        raise FormatError(f"{label}: {info.file_size} bytes, more than the {limit} read; {FIX}")
    try:
        with zf.open(info) as f:
            data = f.read(info.file_size + 1)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:
        raise FormatError(f"{label}: cannot be decompressed ({str(e)[:120]}); {FIX}") from None
    if len(data) != info.file_size:
        raise FormatError(f"{label}: holds {len(data)} bytes, not the {info.file_size} declared")
    return data


def read_json_members(path: PathLike) -> tuple[str, str]:
    """``(config.json, metadata.json)`` of a ``.keras`` archive, as text.

    Raises:
        FormatError: The archive is refused (see the module), or has no ``config.json``.
    """
    where = os.fspath(path)
    with _archive(where) as (zf, members):
        if CONFIG not in members:
            raise FormatError(f"{where}: no member {CONFIG!r}; {FIX}")
        texts = []
        for name in (CONFIG, METADATA):
            data = _inflate(zf, members[name], where, MAX_JSON) if name in members else b"{}"
            try:
                texts.append(data.decode("utf-8"))
            except UnicodeDecodeError:
                raise FormatError(f"{where} (member {name!r}): not UTF-8 text; {FIX}") from None
        return texts[0], texts[1]


def open_keras_archive(path: PathLike, *, max_decoded_bytes: int | None = None) -> H5Checkpoint:
    """Open the weights of a ``.keras`` archive as a checkpoint named by dataset paths.

    Raises:
        FormatError: The archive or its weights member is refused (see the module and
            :mod:`.keras_h5`), or it keeps no ``model.weights.h5``.

    Example:
        >>> with open_keras_archive("model.keras") as ckpt:
        ...     ckpt.names[0]
        'layers/dense/vars/0'
    """
    where = os.fspath(path)
    mm, size = map_file(where)
    budget = DecodeBudget(where, size, max_decoded_bytes)
    with _archive(where) as (zf, members):
        info = members.get(WEIGHTS)
        if info is None:
            other = "model.weights.npz, which weightvault does not read" if members else "none"
            raise FormatError(f"{where}: no member {WEIGHTS!r} (weights: {other}); {FIX}")
        label = f"{where} (member {WEIGHTS!r})"
        if info.compress_type == zipfile.ZIP_STORED:
            region = Region(where, _data_start(info, mm, where), info.file_size, label)
        else:
            budget.charge(f"member {WEIGHTS!r}", info.file_size)
            inflated = _inflate(zf, info, where, budget.limit)
            region = Region(where, 0, len(inflated), label, inflated)
    return read_region(region, budget)


def _data_start(info: zipfile.ZipInfo, mm: object, where: str) -> int:
    """Where a stored member's bytes begin in the file (checked to lie inside it)."""
    buf = memoryview(mm) if mm is not None else memoryview(b"")  # type: ignore[arg-type]
    stored_zip_member(info, buf, where, f"member {info.filename!r}", FIX)
    at = info.header_offset
    name_len, extra_len = struct.unpack("<HH", bytes(buf[at + 26 : at + 30]))
    start: int = at + 30 + name_len + extra_len
    return start


def save_archive(
    path: PathLike,
    config: str,
    metadata: str,
    weights: Callable[[IO[bytes], SaveReport], None],
) -> SaveReport:
    """Write a ``.keras`` archive atomically, as Keras lays it out.

    ``weights(file, report)`` writes the HDF5 weights into ``file`` (a temporary file
    beside ``path``), which is then stored uncompressed as ``model.weights.h5``.
    """
    where = os.fspath(path)
    report = SaveReport(where)
    folder = os.path.dirname(os.path.abspath(where))
    with _scratch(folder) as tmp:
        with open(tmp, "w+b") as h5:
            weights(h5, report)
        with (
            atomic_file(where) as out,
            os.fdopen(os.dup(out.fd), "w+b") as f,
            zipfile.ZipFile(f, "w") as zf,
        ):
            zf.writestr(METADATA, metadata)
            zf.writestr(CONFIG, config)
            zf.write(tmp, WEIGHTS)
    report.file_bytes = os.path.getsize(where)
    return report


@contextlib.contextmanager
def _scratch(folder: str) -> Iterator[str]:
    """A temporary file name in ``folder``, removed afterwards."""
    import tempfile

    fd, name = tempfile.mkstemp(prefix=".weights.", suffix=".h5.tmp", dir=folder)
    os.close(fd)
    try:
        yield name
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def save_model_archive(
    path: PathLike,
    config: str,
    metadata: str,
    layout: tuple[Sequence[Group], Sequence[H5Dataset], Declared],
) -> SaveReport:
    """A ``.keras`` archive of ``config``, ``metadata`` and the weights ``layout``."""
    groups, datasets, declared = layout

    def weights(f: IO[bytes], report: SaveReport) -> None:
        write_h5(f, groups, datasets, declared, report)

    return save_archive(path, config, metadata, weights)


def rewrite_keras(
    src: PathLike, dst: PathLike, kind: str, *, dedupe_copies: bool, dry_run: bool
) -> SaveReport:
    """Rewrite a Keras ``.weights.h5`` or ``.keras`` file (``kind`` ``"hdf5"`` or
    ``"keras"``) with every shared variable stored once (:func:`.keras_write.rewrite_plan`).

    ``dst`` ending in ``.keras`` gets an archive (the source's config and metadata), any
    other name the weights alone.

    Raises:
        FormatError: The source is refused, or ``dst`` is an archive but the source, a
            weights file, holds no model config.
    """
    where = os.fspath(src)
    archive = os.fspath(dst).lower().endswith(".keras")
    if archive and kind != "keras":
        raise FormatError(
            f"{where}: a .weights.h5 file holds no model config, so it cannot become a "
            ".keras archive; convert it to a .weights.h5, or save the model with "
            "weightvault.keras.save_model"
        )
    opener = open_keras_archive if kind == "keras" else open_keras_h5
    with opener(where) as ckpt:
        groups, datasets, declared = rewrite_plan(ckpt, dedupe_copies)
        declared.metadata.setdefault("converted_from", os.path.basename(where))
        if dry_run:
            return _planned(ckpt, datasets, os.fspath(dst))
        if not archive:
            return save_h5(dst, groups, datasets, declared)
        config, meta = read_json_members(where)
        return save_model_archive(dst, config, meta, (groups, datasets, declared))


def _planned(ckpt: H5Checkpoint, datasets: Sequence[H5Dataset], dst: str) -> SaveReport:
    """The report a rewrite would give, nothing written (``file_bytes`` is 0)."""
    report = SaveReport(dst)
    for d in datasets:
        nbytes = ckpt.entry(d.path).nbytes
        report.logical_bytes += nbytes
        if d.link_to is not None:
            (report.copies if d.copy else report.aliases)[d.path] = d.link_to
            continue
        report.stored.append(d.path)
        report.stored_bytes += nbytes
        if d.equal_to is not None:
            report.duplicates[d.path] = d.equal_to
            report.dedupe_savings += nbytes
    report.frozen = list(ckpt.manifest.frozen)
    return report
