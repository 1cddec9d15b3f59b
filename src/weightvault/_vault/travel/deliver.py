"""How a transfer writes objects on the receiver: durably, never replacing one it holds.

On a local disk a batch is staged, made durable by one sync, then linked into place (a
link never replaces a file); an object store takes one conditional PUT each
(``If-None-Match: *``). The receiver's own encoding of a name, and the chains its
compactor built on it, stay as they are.

Example:
    >>> write_new(dest, {digest: [data]}, {digest: len(data)})
    {'abab...': 1024}
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..._base.atomic import batch_sync_ok, sync_paths
from ..._base.pools import each, workers
from ..objects.address import object_key
from ..objects.encoding import Parts, size_of, stored_depth
from ..store.backend import Store

__all__ = ["write_new"]


def write_new(dest: Store, files: Mapping[str, Parts], raw: Mapping[str, int]) -> dict[str, int]:
    """Write ``files`` (``{digest: parts}``, standing for ``raw[digest]`` bytes) durably,
    never replacing an object the receiver holds; return ``{digest: bytes}`` of those
    this call created."""
    if not files:
        return {}
    if not dest.local:
        # Each conditional PUT is durable and whole on its own (If-None-Match: *).
        def put(item: tuple[str, Parts]) -> int:
            digest, parts = item
            created = dest.put(object_key(digest), b"".join(parts), exclusive=True)
            return size_of(parts) if created else -1

        sizes = each(workers(), put, list(files.items()))
        return {d: n for d, n in zip(files, sizes, strict=True) if n >= 0}
    staged = {object_key(d): dest.stage(object_key(d), parts) for d, parts in files.items()}
    created: dict[str, int] = {}
    root = dest.local_path("")
    assert root is not None
    try:
        nbytes = sum(size_of(p) for p in files.values())
        batch = batch_sync_ok(nbytes)
        sync_paths(root, staged.values(), batch=batch)  # durable before any name shows it
        for digest, parts in files.items():
            key = object_key(digest)
            final = dest.local_path(key)
            assert final is not None
            try:
                os.link(staged[key], final)  # never replaces what is there
                created[digest] = size_of(parts)
            except FileExistsError:
                if stored_depth(dest, digest, raw[digest]) is None:
                    os.replace(staged[key], final)  # what is there is no such object
                    created[digest] = size_of(parts)
        folders = {os.path.dirname(dest.local_path(object_key(d)) or "") for d in created}
        sync_paths(root, folders, batch=batch and len(folders) > 1)
    finally:
        dest.discard(staged)
    return created
