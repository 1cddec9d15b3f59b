"""What a transfer sends of one object, checked before it leaves the source.

:func:`fetch` reads a batch of object files from the source as they are stored;
:func:`check` decodes each one as a reader of the receiver would and hashes it against its
name; :func:`whole` re-encodes an object as one full object (checked the same way), for a
long chain or for an object the source's compactor re-encoded since it was planned, which
:func:`base_of` detects. :func:`prepare` makes that choice for one object.

Example:
    >>> files = fetch(source, [digest])
    >>> check(source, digest, nbytes, files[digest]) is None
    True
"""

from __future__ import annotations

import contextlib

from ..._base.errors import ChecksumError, FormatError
from ..objects.address import object_key
from ..objects.codec import Codec
from ..objects.encoding import ANCHOR_PAYS, Parts, encode_full
from ..objects.file import object_file
from ..objects.frame import HEADER_SIZE, Frame
from ..objects.probe import parse_head
from ..objects.read import read_verified
from ..store.backend import Store
from .plan import Plan

__all__ = ["base_of", "check", "fetch", "prepare", "whole"]

#: Why a file whose bytes decoded is refused: they are not the object its name says.
_MISMATCH = "its bytes do not match its name (blake3)"


def fetch(store: Store, digests: list[str]) -> dict[str, bytes | memoryview]:
    """The files of ``digests`` on the source, wherever a gc holds them; missing ones are
    left out (the check reports them)."""
    out: dict[str, bytes | memoryview] = {}
    rest = list(digests)
    if not store.local and rest:
        with contextlib.suppress(FileNotFoundError):
            got = store.get_many([object_key(d) for d in rest])
            out = {k.rsplit("/", 1)[-1]: v for k, v in got.items()}
            rest = []
    for digest in rest:
        with contextlib.suppress(FileNotFoundError):
            out[digest] = object_file(store, digest)
    return out


def check(source: Store, digest: str, nbytes: int, data: bytes | memoryview) -> str | None:
    """What is wrong with ``data`` as the file of object ``digest``, or ``None``: it is
    decoded as a reader of the receiver would (a delta on its base's raw bytes, read
    from the source by name) and hashed."""
    try:
        read_verified(source, digest, nbytes, files={digest: data})
    except FileNotFoundError:
        return "its delta base is missing"
    except ChecksumError:
        return _MISMATCH
    except FormatError as e:
        return str(e)
    return None


def whole(source: Store, digest: str, nbytes: int, frame: Frame | None, codec: Codec) -> Parts:
    """Object ``digest`` as one full object, from its raw bytes on the source (checked).

    Raises:
        FormatError: Its chain does not decode, or its bytes do not match its name.
    """
    try:
        raw = read_verified(source, digest, nbytes)
    except FileNotFoundError:
        raise FormatError("it is missing") from None
    except ChecksumError:
        raise FormatError(_MISMATCH) from None
    # Whole, it is what the receiver's loads read, and the anchor of its deltas to come.
    parts = encode_full(raw, frame.itemsize if frame is not None else 4, codec, pays=ANCHOR_PAYS)
    # Checked as every sent file is: a codec fault must not reach the receiver.
    why = check(source, digest, nbytes, b"".join(parts))
    if why is not None:
        raise FormatError(f"encoded whole, {why}")
    return parts


def base_of(data: bytes | memoryview, nbytes: int) -> str | None:
    """The delta base file ``data`` names, or ``None`` for raw bytes or a full frame.

    Asked only of a file :func:`check` passed, whose header therefore parses.
    """
    view = memoryview(data).cast("B")
    frame = None if view.nbytes == nbytes else parse_head(view[:HEADER_SIZE])
    return frame.base if frame is not None else None


def prepare(plan: Plan, digest: str, data: bytes | memoryview | None, codec: Codec) -> Parts:
    """The file to send for object ``digest``, checked: ``data`` (its file on the source)
    as it is stored, or the object re-encoded whole where the plan says so.

    Raises:
        FormatError: The object is missing or damaged on the source (the message says how).
    """
    source, nbytes = plan.source, plan.sizes[digest]
    frame = plan.frames.get(digest)
    if digest in plan.whole:
        return whole(source, digest, nbytes, frame, codec)
    if data is None:
        raise FormatError("it is missing")
    why = check(source, digest, nbytes, data)
    if why is not None:
        raise FormatError(why)
    if base_of(data, nbytes) != (frame.base if frame is not None else None):
        # Its source's compactor re-encoded it since it was planned: its new base is not
        # named by the intent, so it goes whole.
        return whole(source, digest, nbytes, frame, codec)
    return [data]
