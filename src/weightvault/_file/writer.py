"""Write a plan to disk: streamed, checksummed, atomic and byte-for-byte deterministic."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from .._base.atomic import atomic_file, write_all as _write_all
from .._base.dtypes import ITEMSIZE
from .._base.errors import ReservedNameError, capped
from .._base.reports import SaveReport
from .._base.types import PathLike
from .header import METADATA_KEY, TensorInfo, encode_header
from .layout import is_training, with_training
from .manifest import (
    CHECKSUM_WIDTH,
    FORMAT_VERSION,
    INTERNAL_PREFIX,
    MANIFEST_KEY,
    RESERVED_KEYS,
    Manifest,
)
from .sharing import Plan, Source, Stored, plan

Progress = Callable[[int], None]

PAGE = 4096
#: From this much data on, the data section is page-aligned (costs < 4 KiB of padding).
BIG = 16 << 20


def layout(stored: list[Stored]) -> list[tuple[Stored, TensorInfo]]:
    """Order stored tensors widest dtype first, then model order, and assign offsets.

    Widest first means every tensor starts at a multiple of its item size, so an mmap-backed
    load can hand out aligned, zero-copy tensors.
    """
    out = []
    position = 0
    for s in sorted(stored, key=lambda s: (-ITEMSIZE[s.dtype], s.order)):
        out.append((s, TensorInfo(s.name, s.dtype, s.shape, position, position + s.nbytes)))
        position += s.nbytes
    return out


def check_names(
    names: Iterable[str], metadata: Mapping[str, str] | None, where: str = "save"
) -> None:
    """Refuse names and metadata keys a file cannot hold unambiguously.

    Raises:
        ReservedNameError: A tensor is named ``__metadata__`` or uses weightvault's internal
            prefix, or a metadata key is reserved or equal to a tensor name (plain
            readers would take it for a tie).
        TypeError: A metadata key or value is not a string.
    """
    names = list(names)
    bad = [n for n in names if n == METADATA_KEY or n.startswith(INTERNAL_PREFIX)]
    if bad:
        raise ReservedNameError(
            f"{where}: tensor name(s) {capped(repr(n) for n in bad)} are reserved by the file "
            f"format ({METADATA_KEY!r} is the safetensors header's metadata key, "
            f"{INTERNAL_PREFIX!r} names weightvault's shared storage); rename the tensor"
        )
    meta = dict(metadata or {})
    wrong = [repr(k) for k, v in meta.items() if not isinstance(k, str) or not isinstance(v, str)]
    if wrong:
        raise TypeError(
            f"{where}: metadata must map str to str, but {capped(wrong)} do not; convert "
            'the values first, for example {"step": str(step)}'
        )
    taken = set(names)
    clash = [k for k in meta if k in RESERVED_KEYS or k == METADATA_KEY or k in taken]
    if clash:
        raise ReservedNameError(
            f"{where}: metadata key(s) {capped(repr(k) for k in clash)} clash with a reserved "
            f"key ({', '.join(sorted([*RESERVED_KEYS, METADATA_KEY]))}) or a tensor "
            "name, which plain safetensors readers would misread; rename the key"
        )


def write(
    path: PathLike,
    plan: Plan,
    *,
    framework: str | None = None,
    metadata: dict[str, str] | None = None,
    checksum: bool = True,
    progress: Progress | None = None,
) -> int:
    """Write ``plan`` to ``path`` atomically and return the file size.

    The data is streamed tensor by tensor, never gathered in memory. Checksums are
    computed while writing, and the header, whose length is fixed in advance (digests
    have a fixed width), is written last at offset 0, so the data is read only once. The
    header is sealed by its own checksum (:func:`~.header.encode_header`), one hash of
    its bytes.

    The file appears at ``path`` only after it is complete and on disk: it is written to
    a temporary name in the same folder, fsynced, then renamed over ``path``. A crash at
    any moment leaves the previous file at ``path`` as it was.
    """
    check_names(plan.names, metadata, os.fspath(path))
    placed = layout(plan.stored)
    placeholders = {s.name: "0" * CHECKSUM_WIDTH for s, _ in placed} if checksum else None
    manifest = plan.manifest(metadata, sums=placeholders)
    manifest.version = FORMAT_VERSION  # a sealed header
    header_meta = _header_metadata(plan, framework, manifest)
    infos = [info for _, info in placed]
    # Large files start their data on a page of its own: the header is written last, and
    # rewriting a page the kernel is already writing back can stall for the whole queue.
    align = PAGE if sum(i.nbytes for i in infos) >= BIG else 8
    header = encode_header(infos, header_meta, align=align, seal=True)

    with atomic_file(os.fspath(path)) as out:
        fd = out.fd
        # The header goes in last, once the checksums are known; data starts after it.
        os.lseek(fd, len(header), os.SEEK_SET)
        # xxhash and os.write both release the GIL, so a helper thread hashes each tensor
        # while this one writes it: the checksum costs almost no wall time.
        with ThreadPoolExecutor(max_workers=1) as hasher:
            for s, _ in placed:
                data = s.data().cast("B")
                digest = hasher.submit(_xxh3, data) if checksum else None
                _write_all(fd, data)
                if digest is not None:
                    manifest.sums[s.name] = digest.result()
                if progress is not None:
                    progress(s.nbytes)
        final = encode_header(
            infos, _header_metadata(plan, framework, manifest), align=align, seal=True
        )
        # Same length by construction: placeholders and digests are fixed-width hex.
        assert len(final) == len(header)
        os.pwrite(fd, final, 0)
    return len(header) + sum(info.nbytes for info in infos)


def _xxh3(data: memoryview) -> str:
    return xxhash.xxh3_64(data).hexdigest()


def _header_metadata(plan: Plan, framework: str | None, manifest: Manifest) -> dict[str, str]:
    meta: dict[str, str] = {}
    if framework:
        meta["format"] = framework
    # safetensors users read their metadata with safe_open(...).metadata(); check_names
    # made sure no key is reserved or a tensor name, so none reads as a tie.
    meta.update(manifest.metadata)
    # The de facto convention, so other readers (and safetensors users) see the ties. It
    # can only name stored tensors: an alias of a copy names the copy's stored twin (equal
    # values), and an alias of a view has no plain-reader equivalent. An alias named like
    # a reserved key (``format``) is left to the manifest: it must not replace that key.
    for alias, target in plan.aliases.items():
        target = plan.copies.get(target, target)
        if target not in plan.views and alias not in RESERVED_KEYS:
            meta[alias] = target
    meta[MANIFEST_KEY] = manifest.encode()
    return meta


def save_sources(
    path: PathLike,
    sources: list[Source],
    *,
    framework: str | None,
    metadata: dict[str, str] | None = None,
    checksum: bool = True,
    dedupe_copies: bool = False,
    skipped: list[str] | None = None,
    dry_run: bool = False,
    training: dict[str, Any] | None = None,
) -> SaveReport:
    """Plan ``sources`` and write them to ``path``: the save every adapter shares.

    With ``dry_run`` nothing is written and ``file_bytes`` is 0.
    """
    names = [s.name for s in sources if training is None or not is_training(s.name)]
    check_names(names, metadata, os.fspath(path))
    p = with_training(plan(sources, dedupe_copies=dedupe_copies), training)
    file_bytes = 0
    if not dry_run:
        file_bytes = write(path, p, framework=framework, metadata=metadata, checksum=checksum)
    return SaveReport(
        path=os.fspath(path),
        stored=[s.name for s, _ in layout(p.stored)],
        aliases=p.aliases,
        copies=p.copies,
        views=list(p.views),
        duplicates=p.duplicates,
        dedupe_savings=sum(s.nbytes for s in p.stored if s.name in p.duplicates),
        frozen=p.frozen,
        skipped=list(skipped or []),
        logical_bytes=p.logical_bytes,
        stored_bytes=p.stored_bytes,
        file_bytes=file_bytes,
    )
