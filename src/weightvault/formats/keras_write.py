"""Writing Keras' own ``.weights.h5`` layout with every shared value stored once.

HDF5 lets one dataset have several names: a *hard link* is a second path to the same
object, and Keras' ``load_weights`` reads it like any other dataset (it refuses only
soft and external links). So a variable that several layers hold is written once and
its other paths are hard links to it: Keras loads the file as it loads its own, and
weightvault reads the links back as aliases of one tensor.

This module is framework-free: :func:`weightvault.keras.save_weights` hands it Keras'
layout (from Keras' own save walk), and :func:`rewrite_plan` builds one from a Keras
file that wrote a shared variable once per layer, for ``weightvault convert``.

Keras' files do not say which equal datasets are one variable. A rewrite links equal
datasets whose values are not all the same (random initialisation and training never
make two separate variables bit-identical, so such datasets are one variable written
several times); equal *constant* datasets (fresh zero biases, ones) only happen to be
equal and stay separate unless ``dedupe_copies`` is given. A file weightvault wrote says
which datasets are separate variables (its manifest attribute); they are never merged
without ``dedupe_copies``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from .._base.atomic import atomic_file
from .._base.dtypes import ITEMSIZE, numpy_dtype
from .._base.errors import FormatError
from .._base.reports import SaveReport
from .._base.types import PathLike
from ._common import need
from .keras_h5 import MANIFEST_ATTR, Declared, H5Checkpoint

#: ``(group path, attributes)``: a group Keras creates (``layers/dense/vars``, ``name``).
Group = tuple[str, Mapping[str, Any]]


@dataclass
class H5Dataset:
    """One dataset path of the file to write.

    Attributes:
        path: Its HDF5 path, such as ``layers/dense/vars/0``.
        value: Returns the array to write (read only if it is written, not linked).
        link_to: An earlier path to hard-link instead of writing the value again.
        copy: The link stands for a separate, equal variable (recorded in the manifest,
            so weightvault gives it its own tensor on load).
        equal_to: Written again, though equal to this earlier path (a duplicate).
    """

    path: str
    value: Callable[[], Any] | None = None
    link_to: str | None = None
    copy: bool = False
    equal_to: str | None = None


def write_h5(
    target: IO[bytes] | str,
    groups: Sequence[Group],
    datasets: Sequence[H5Dataset],
    declared: Declared,
    report: SaveReport,
) -> None:
    """Write the groups, then every dataset once and every link as a hard link.

    ``report`` receives what was stored, linked and found equal, and the tensor bytes.
    """
    h5py = need("h5py", "writing Keras .weights.h5 files")
    sizes: dict[str, int] = {}
    copies: dict[str, str] = {}
    with h5py.File(target, "w") as f:
        for path, attrs in groups:
            g = f.require_group(path)
            for k, v in attrs.items():
                g.attrs[k] = v
        for d in datasets:
            if d.link_to is not None:
                f[d.path] = f[d.link_to]  # a hard link: the same object under a second path
                sizes[d.path] = sizes[d.link_to]
                (copies if d.copy else report.aliases)[d.path] = d.link_to
                continue
            assert d.value is not None, "a dataset is linked or has a value"
            sizes[d.path] = _write_value(f, d.path, d.value())
            report.stored.append(d.path)
            report.stored_bytes += sizes[d.path]
            if d.equal_to is not None:
                report.duplicates[d.path] = d.equal_to
                report.dedupe_savings += sizes[d.path]
        declared.copies = copies
        f.attrs[MANIFEST_ATTR] = declared.encode()
    report.copies = copies
    report.frozen = list(declared.frozen)
    report.logical_bytes = sum(sizes.values())


def _write_value(f: Any, path: str, value: Any) -> int:
    """Write one array as Keras' ``H5IOStore`` does; return its size in bytes."""
    if getattr(value.dtype, "name", "") == "bfloat16":
        ds = f.create_dataset(path, data=value)
        ds.attrs["dtype"] = "bfloat16"
    else:
        f[path] = value
    return int(value.nbytes)


def save_h5(
    path: PathLike, groups: Sequence[Group], datasets: Sequence[H5Dataset], declared: Declared
) -> SaveReport:
    """Write a ``.weights.h5`` atomically (the old file stays until the new one is whole).

    Example:
        >>> save_h5("m.weights.h5", [("vars", {"name": "m"})],
        ...         [H5Dataset("vars/0", lambda: np.ones(3))], Declared()).stored
        ['vars/0']
    """
    where = os.fspath(path)
    report = SaveReport(where)
    with atomic_file(where) as out, os.fdopen(os.dup(out.fd), "w+b") as f:
        write_h5(f, groups, datasets, declared, report)
    report.file_bytes = os.path.getsize(where)
    return report


def rewrite_plan(
    ckpt: H5Checkpoint, dedupe_copies: bool
) -> tuple[list[Group], list[H5Dataset], Declared]:
    """The layout of ``ckpt``'s file with equal datasets linked (see the module).

    Groups and their attributes are copied as they are (weightvault's own attribute is
    written anew); datasets keep their paths, and a path that was a hard link stays one.
    """
    m = ckpt.manifest
    declared = Declared(list(m.frozen), {}, dict(m.metadata))
    # A tensor that has aliases is written, never linked as a copy: the aliases' link
    # would then make them one object with the tensor it copies.
    aliased = {ckpt.entry(n).stored for n in m.aliases}
    out: list[H5Dataset] = []
    for name in ckpt.names:
        e = ckpt.entry(name)
        if e.kind == "alias":
            out.append(H5Dataset(name, link_to=e.stored))
            continue
        equal = m.duplicates.get(name) if e.kind == "stored" else None
        kept = e.stored if e.kind == "copy" else equal
        if kept is not None and name not in aliased:
            # Equal datasets in a file Keras wrote: one variable, unless constant.
            one = equal is not None and ckpt.declared is None and not _constant(ckpt, name)
            if dedupe_copies or one:
                out.append(H5Dataset(name, link_to=kept, copy=not one))
                continue
        out.append(H5Dataset(name, _array(ckpt, e.stored), equal_to=kept))
    return read_groups(ckpt), out, declared


def _array(ckpt: H5Checkpoint, stored: str) -> Callable[[], Any]:
    def value() -> Any:
        np = need("numpy", "writing Keras .weights.h5 files")
        info = ckpt.stored[stored]
        flat = np.frombuffer(ckpt.read(stored), dtype=numpy_dtype(info.dtype))
        return flat.reshape(info.shape)

    return value


def _constant(ckpt: H5Checkpoint, stored: str) -> bool:
    """Whether every element of ``stored`` has the same bits (as initialisers make them)."""
    np = need("numpy", "writing Keras .weights.h5 files")
    width = ITEMSIZE[ckpt.stored[stored].dtype]
    items = np.frombuffer(ckpt.raw(stored), dtype=np.uint8).reshape(-1, width)
    return len(items) <= 1 or bool((items == items[0]).all())


#: The largest attribute copied from a group; Keras writes a layer's name.
MAX_ATTRIBUTE = 1 << 20


def read_groups(ckpt: H5Checkpoint) -> list[Group]:
    """Every group of the file ``ckpt`` read, with its attributes, in walk order.

    The file was validated when ``ckpt`` was opened (no external or soft links, no
    group linked twice), so this second walk meets only hard-linked groups.

    Raises:
        FormatError: An attribute is larger than :data:`MAX_ATTRIBUTE`.
    """
    h5py = need("h5py", "rewriting Keras .weights.h5 files")
    out: list[Group] = []
    region = ckpt.region

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Group):
            out.append((name, _attributes(obj, name, region.label)))

    with region.open() as source, h5py.File(source, "r") as f:
        f.visititems(visit)
    return out


def _attributes(group: Any, name: str, where: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for key in group.attrs:
        size = group.attrs.get_id(key).get_storage_size()
        if size > MAX_ATTRIBUTE:
            raise FormatError(
                f"{where}: attribute {key!r} of group {name!r} takes {size} bytes, more "
                f"than the {MAX_ATTRIBUTE} a rewrite copies; the file was not written by Keras"
            )
        attrs[key] = group.attrs[key]
    return attrs
