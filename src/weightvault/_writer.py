"""Write a plan to disk: streamed, checksummed, atomic and byte-for-byte deterministic."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from ._atomic import atomic_file, write_all as _write_all
from ._dtypes import ITEMSIZE
from ._header import TensorInfo, encode_header
from ._manifest import CHECKSUM_WIDTH, MANIFEST_KEY, Manifest
from ._plan import Plan, Source, Stored, plan
from ._reports import SaveReport
from ._training import with_training

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


def write(
    path: str | os.PathLike[str],
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
    have a fixed width), is written last at offset 0, so the data is read only once.

    The file appears at ``path`` only after it is complete and on disk: it is written to
    a temporary name in the same folder, fsynced, then renamed over ``path``. A crash at
    any moment leaves the previous file at ``path`` as it was.
    """
    placed = layout(plan.stored)
    placeholders = {s.name: "0" * CHECKSUM_WIDTH for s, _ in placed} if checksum else None
    manifest = plan.manifest(metadata, sums=placeholders)
    header_meta = _header_metadata(plan, framework, manifest)
    infos = [info for _, info in placed]
    # Large files start their data on a page of its own: the header is written last, and
    # rewriting a page the kernel is already writing back can stall for the whole queue.
    align = PAGE if sum(i.nbytes for i in infos) >= BIG else 8
    header = encode_header(infos, header_meta, align=align)

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
        final = encode_header(infos, _header_metadata(plan, framework, manifest), align=align)
        # Same length by construction: placeholders and digests are both 16 hex digits.
        assert len(final) == len(header)
        os.pwrite(fd, final, 0)
    return len(header) + sum(info.nbytes for info in infos)


def _xxh3(data: memoryview) -> str:
    return xxhash.xxh3_64(data).hexdigest()


def _header_metadata(plan: Plan, framework: str | None, manifest: Manifest) -> dict[str, str]:
    meta: dict[str, str] = {}
    if framework:
        meta["format"] = framework
    # The de facto convention, so other readers (and safetensors users) see the ties. It
    # can only name stored tensors: an alias of a copy names the copy's stored twin (equal
    # values), and an alias of a view has no plain-reader equivalent.
    for alias, target in plan.aliases.items():
        target = plan.copies.get(target, target)
        if target not in plan.views:
            meta[alias] = target
    meta[MANIFEST_KEY] = manifest.encode()
    return meta


def save_sources(
    path: str | os.PathLike[str],
    sources: list[Source],
    *,
    framework: str | None,
    metadata: dict[str, str] | None = None,
    checksum: bool = True,
    dedupe_copies: bool = True,
    skipped: list[str] | None = None,
    dry_run: bool = False,
    training: dict[str, Any] | None = None,
) -> SaveReport:
    """Plan ``sources`` and write them to ``path``: the save every adapter shares.

    With ``dry_run`` nothing is written and ``file_bytes`` is 0.
    """
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
        frozen=p.frozen,
        skipped=list(skipped or []),
        logical_bytes=p.logical_bytes,
        stored_bytes=p.stored_bytes,
        file_bytes=file_bytes,
    )
