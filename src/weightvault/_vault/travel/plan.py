"""The plan of a transfer: what the receiver holds, each missing object's frame, and which
objects are sent whole instead of as a delta whose bases would also have to travel.

:class:`Plan` is built once the receiver's intent is visible: it lists the receiver's
objects, reads the source frame of each missing one down its chain (naming each base in
the intent before the receiver is asked about it), then chooses what goes whole.
:meth:`Plan.closure` gives each checkpoint's objects to send, every base before the delta
built on it.

Example:
    >>> plan = Plan(source, dest, intent, {"ab" * 32: 1024})
    >>> plan.closure(ckpt, sent=set())
    ['abab...']
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import islice

from ..._base.pools import each, workers
from ..objects.address import is_temp
from ..objects.chain import walk
from ..objects.encoding import stored_depth
from ..objects.frame import Frame
from ..objects.probe import object_frame
from ..records.intents import write_intent
from ..store.backend import Store
from ..store.pack import pack_table
from .select import Checkpoint

__all__ = ["Plan"]


def _listed(store: Store) -> dict[str, int]:
    """``{digest: file size}`` of every object in ``store``'s ``objects/`` and packs
    (one listing of each; a packed object's file is its raw bytes)."""
    out = {}
    table = pack_table(store)
    table.refresh(store)
    for index in table.packs().values():
        out.update({d: p.size for d, p in index.items()})
    for blob in store.list("objects"):
        if not is_temp(blob.key):
            out[blob.key.rsplit("/", 1)[-1]] = blob.size
    return out


class Plan:
    """What to send: the receiver's holdings, each missing object's frame, and which
    objects go whole. Built after the receiver's intent is visible."""

    def __init__(self, source: Store, dest: Store, intent: str, tops: Mapping[str, int]):
        self.source, self.dest, self.intent = source, dest, intent
        self.sizes = dict(tops)  # digest -> raw bytes, for everything named so far
        self.tops = set(tops)
        self.src_files = _listed(source)
        self.have: set[str] = set()
        self.frames: dict[str, Frame | None] = {}
        self.whole: set[str] = set()
        self._present(list(tops))
        self._walk([d for d in tops if d not in self.have])
        self._choose()

    def named(self) -> list[str]:
        """Every object the transfer may reference (what its intent names)."""
        return sorted(self.sizes)

    def refresh(self) -> None:
        """Rewrite the intent with everything named so far (and a fresh time)."""
        write_intent(self.dest, self.intent, self.named())

    def file_size(self, digest: str) -> int:
        size = self.src_files.get(digest)
        if size is None:  # in a gc's trash on the source, or gone
            frame = self.frames.get(digest)
            size = self.sizes.get(digest, 0) if frame is None else frame.raw_size
        return size

    def _present(self, digests: list[str]) -> None:
        """Add to :attr:`have` what the receiver holds in ``objects/`` as an object of
        the right raw size; only ever called once the intent names ``digests``."""
        listed = _listed(self.dest)
        unsure = [d for d in digests if d in listed and listed[d] != self.sizes[d]]
        depths = each(workers(), lambda d: stored_depth(self.dest, d, self.sizes[d]), unsure)
        self.have |= {d for d in digests if listed.get(d) == self.sizes[d]}
        self.have |= {d for d, depth in zip(unsure, depths, strict=True) if depth is not None}

    def _walk(self, level: list[str]) -> None:
        """Read the source frame of each missing object, level by level down its chain,
        until a link the receiver holds, one being sent anyway, or a full object."""
        for _ in range(64 + 1):  # a chain longer than a reader follows is refused later
            if not level:
                return
            frames = each(workers(), lambda d: object_frame(self.source, d), level)
            found = []
            for digest, frame in zip(level, frames, strict=True):
                self.frames[digest] = frame
                if frame is not None and frame.base is not None and frame.base not in self.sizes:
                    self.sizes[frame.base] = frame.raw_size
                    found.append(frame.base)
            if found:
                self.refresh()  # named before the receiver is asked about them
                self._present(found)
            level = [d for d in found if d not in self.have]

    def extra(self, digest: str) -> list[str]:
        """The links of ``digest``'s chain that only it needs: named by no checkpoint
        being sent, and missing on the receiver."""
        out, seen = [], {digest}
        # The walk's first link is ``digest`` itself; the frames read are the plan's.
        for base, _ in islice(walk(digest, self.frames.get), 1, None):
            if base in self.tops or base in self.have or base in seen:
                break
            out.append(base)
            seen.add(base)
        return out

    def _choose(self) -> None:
        """Send whole each missing delta whose own extra links outweigh its raw size."""
        for digest in self.tops - self.have:
            links = self.extra(digest)
            if links and sum(self.file_size(d) for d in [digest, *links]) > self.sizes[digest]:
                self.whole.add(digest)

    def closure(self, ckpt: Checkpoint, sent: set[str]) -> list[str]:
        """What ``ckpt`` still needs sent, every base before the delta built on it."""
        out: list[str] = []
        seen: set[str] = set()

        def visit(digest: str) -> None:
            if digest in self.have or digest in sent or digest in seen:
                return
            seen.add(digest)
            frame = self.frames.get(digest)
            if digest not in self.whole and frame is not None and frame.base is not None:
                visit(frame.base)
            out.append(digest)

        for digest in sorted(set(ckpt.objects.values())):
            visit(digest)
        return out
