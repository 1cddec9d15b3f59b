"""Delta chains: an object and the bases its frames name, down to a full object.

An object stored as a delta names its base in its frame header; the base may be a
delta itself. :func:`walk` follows the bases; :func:`chain` opens and checks every
link before a read decodes (:mod:`.read`); :func:`with_bases` is the set gc keeps:
every object a checkpoint names and, transitively, every base of theirs.

Example:
    >>> from .file import ObjectFile
    >>> [d for d, _, frame in chain("ab", ObjectFile(data=memoryview(b"xy")), 2, None)]
    ['ab']
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..._base.errors import FormatError
from ..store.backend import Store
from .codec import codec_pool
from .file import ObjectFile
from .frame import (
    HEADER_SIZE,
    MAX_DEPTH,
    Frame,
    is_frame,
    parse_frame,
    parse_frame_header,
    table_size,
)
from .probe import object_frame

__all__ = ["Link", "chain", "walk", "with_bases"]

#: One object of a delta chain: ``(digest, its file, its frame or None for raw bytes)``.
Link = tuple[str, ObjectFile, Frame | None]


def walk(
    digest: str, frame_of: Callable[[str], Frame | None]
) -> Iterator[tuple[str, Frame | None]]:
    """``(digest, its frame)`` for object ``digest``, then for each delta base the frame
    before names, down to the first object whose frame names none (``frame_of`` gives
    ``None`` for raw bytes, or a full frame). This is the only walk down a chain.

    ``frame_of`` reads one object's frame, and may raise to end the walk (a missing or
    damaged link). A cycle never ends here: the caller bounds the walk (see
    :func:`chain`).

    Example:
        >>> [d for d, _ in walk("ab", lambda d: None)]
        ['ab']
    """
    while True:
        frame = frame_of(digest)
        yield digest, frame
        if frame is None or frame.base is None:
            return
        digest = frame.base


def chain(
    digest: str, first: ObjectFile, nbytes: int | None, get: Callable[[str], ObjectFile]
) -> list[Link]:
    """Object ``digest`` (file ``first``) and its delta bases down to a full object, every
    link checked.

    A base must be as large as its delta, split into the same byte planes, and one level
    shallower, so a chain ends: a cycle or a chain deeper than :data:`~.frame.MAX_DEPTH`
    is refused. Only each frame's header and block table are read here.

    Raises:
        FormatError: A frame is damaged, or a base is missing or does not fit its delta.
    """
    links: list[Link] = []

    def link(digest: str) -> Frame | None:
        size = nbytes
        if links:
            parent = links[-1][2]
            assert parent is not None
            size = parent.raw_size
            try:
                f = get(digest)
            except FileNotFoundError:
                raise FormatError(f"its delta base {digest[:12]} is missing") from None
        else:
            f = first
        frame = _frame_of(f, size)
        if frame is None and size is not None and f.size != size:
            raise FormatError(f"object {digest[:12]} holds {f.size} bytes, expected {size}")
        if links:
            _check_base(links, digest, frame)
        links.append((digest, f, frame))
        return frame

    for _ in walk(digest, link):
        pass
    return links


def _frame_of(f: ObjectFile, nbytes: int | None) -> Frame | None:
    """The frame of file ``f``, or ``None`` if it holds raw bytes (see :mod:`.frame`)."""
    if nbytes is not None and f.size == nbytes:
        return None
    head = memoryview(f.read(0, HEADER_SIZE))
    if not is_frame(head):
        return None
    header = parse_frame_header(head)
    if nbytes is not None and header.raw_size != nbytes:
        raise FormatError(f"the frame claims {header.raw_size} raw bytes, the record says {nbytes}")
    # The table is read only once the header says it fits in the file.
    table = table_size(head)
    if table > f.size:
        blocks = -(-header.raw_size // header.block_size)
        raise FormatError(
            f"the frame's block table ({blocks} blocks) runs past its end (truncated)"
        )
    return parse_frame(memoryview(f.read(0, table)), nbytes, f.size)


def _check_base(links: list[Link], digest: str, frame: Frame | None) -> None:
    """Check that ``digest`` (``frame``) can be the base of the last link's delta.

    Version 1 frames (forward deltas, the first format) name a base exactly one level shallower.
    Version 2 frames record their depth as written, and the compactor later turns their
    full bases into deltas of newer objects, so there only the chain as a whole is
    bounded: no object twice (a cycle) and at most :data:`~.frame.MAX_DEPTH` links.
    """
    parent = links[-1][2]
    assert parent is not None
    depth = frame.depth if frame else 0
    if parent.version == 1 and (frame is None or frame.version == 1):
        if depth != parent.depth - 1:
            raise FormatError(
                f"delta base {digest[:12]} has depth {depth}, expected {parent.depth - 1} "
                "(a broken or cyclic delta chain)"
            )
    elif any(d == digest for d, _, _ in links) or len(links) >= MAX_DEPTH:
        raise FormatError(
            f"delta base {digest[:12]} makes a chain of {len(links) + 1} objects "
            "(a cyclic or overlong delta chain)"
        )
    if frame is not None and frame.itemsize != parent.itemsize:
        raise FormatError(
            f"delta base {digest[:12]} holds {frame.itemsize}-byte items, its delta "
            f"{parent.itemsize}-byte ones (another dtype)"
        )


def with_bases(
    store: Store, digests: set[str], beat: Callable[[], None] = lambda: None
) -> set[str]:
    """``digests`` and every delta base their frames name, transitively (what gc keeps).

    Read from the objects' own frames, wherever they are (``objects/`` or a gc's trash),
    so no record needs to list bases, and an object reused by a later checkpoint keeps
    its chain. A frame that does not parse names nothing (loads report it).
    """
    live = set(digests)
    frontier = sorted(live)
    while frontier:
        # A few runs of digests per thread, not one task each: reading a frame's header
        # costs about what handing it to a thread does (a gc after 300 saves of the lm
        # run reads 4,200, twice; docs/benchmarks-log.md, section 27).
        runs = [frontier[i::_FRAME_RUNS] for i in range(min(_FRAME_RUNS, len(frontier)))]
        found = {
            f.base
            for frames in codec_pool().map(lambda run: [object_frame(store, d) for d in run], runs)
            for f in frames
            if f is not None and f.base is not None
        }
        frontier = sorted(found - live)
        live |= found
        beat()
    return live


#: How many runs :func:`with_bases` splits each level's digests into.
_FRAME_RUNS = 16
