"""The safetensors container: an 8-byte length, a JSON header, then raw tensor bytes.

Reading treats every file as hostile. Each check below is one way a crafted file could
make a reader crash, hang, allocate without bound or read out of bounds; every failure
raises :class:`FormatError` naming the file and the tensor.

A header weightvault writes is sealed: its first ``__metadata__`` entry,
``"weightvault.header_sum"``, holds the xxh3-128 of every byte before the data section
(the 8-byte length, the JSON and its padding) with that entry's 32 digits read as
zeros. The sum sits at a fixed place, so sealing is one hash of bytes the writer has
anyway and checking is one hash of bytes the reader has read: nothing is re-encoded.

Example:
    >>> sealed = encode_header([TensorInfo("w", "F32", (2,), 0, 8)], {"format": "pt"}, seal=True)
    >>> parse_header(sealed[8:], len(sealed) + 8, "w.safetensors").sealed
    True
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import xxhash

from .._base.dtypes import ITEMSIZE, MAX_DIMS, fits_int64, numel
from .._base.errors import ChecksumError, FormatError
from .._base.types import PathLike

#: Largest header we parse. safetensors uses the same bound; a real header of a
#: 100k-tensor model is a few MB.
MAX_HEADER_BYTES = 100_000_000
#: The safetensors header's own key for string metadata: no tensor may take it.
METADATA_KEY = "__metadata__"
#: The ``__metadata__`` key of the header's own checksum; always its first entry.
HEADER_SUM_KEY = "weightvault.header_sum"
#: What a sealed header starts with; the sum's 32 hex digits and a ``"`` follow.
SEAL_PREFIX = b'{"' + METADATA_KEY.encode() + b'":{"' + HEADER_SUM_KEY.encode() + b'":"'
SUM_DIGITS = 32
_ZEROS = b"0" * SUM_DIGITS
#: Where the digits lie, counted from the start of the file (after the 8-byte length).
_DIGITS_AT = 8 + len(SEAL_PREFIX)
_HEX = frozenset(b"0123456789abcdef")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it; offsets are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A validated header: tensors in header order, string metadata, and where data begins."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    file_size: int
    #: Whether the header carried its sum (:data:`HEADER_SUM_KEY`), checked before parsing.
    sealed: bool = False


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise FormatError(f"duplicate key {key!r} in the JSON header")
        out[key] = value
    return out


def _int(value: Any) -> bool:
    # bool is an int subclass, and JSON true must not pass as a size.
    return isinstance(value, int) and not isinstance(value, bool)


def read_header(f: BinaryIO, path: PathLike) -> Header:
    """Read and validate the header of the open file ``f``.

    Args:
        f: A binary file positioned anywhere; it is read from offset 0.
        path: Used only in error messages.

    Returns:
        The validated header.

    Raises:
        FormatError: The file is not a valid safetensors file.
    """
    where = os.fspath(path)
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(0)
    if size < 8:
        raise FormatError(f"{where}: {size} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if 8 + n > size:
        raise FormatError(
            f"{where}: header length {n} runs past the end of the {size}-byte file "
            "(the file is truncated or not safetensors)"
        )
    raw = f.read(n)
    return parse_header(raw, size, where)


def parse_header(raw: bytes, file_size: int, where: str) -> Header:
    """Validate header bytes ``raw`` for a file of ``file_size`` bytes.

    A sealed header's sum is checked first, on the bytes as read, so damage anywhere in
    it is a :class:`ChecksumError` that says so, whatever the damage did to the JSON.

    Raises:
        ChecksumError: The header carries a sum and its bytes do not match it.
        FormatError: The header is malformed, or holds a sum anywhere but at its start.
    """
    sealed = raw.startswith(SEAL_PREFIX)
    if sealed:
        check_header_sum(raw, where)
    try:
        text = raw.decode("utf-8")
        # A trailing run of spaces is the padding writers use to align the data section.
        doc = json.loads(text.rstrip(" "), object_pairs_hook=_no_duplicate_keys)
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{where}: header is not valid UTF-8 JSON ({type(e).__name__})") from e
    check_unicode(text, doc, where, "header")
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: header must be a JSON object, got {type(doc).__name__}")

    metadata_doc = doc.pop(METADATA_KEY, None)
    metadata: dict[str, str] = {}
    if metadata_doc is not None:
        if not isinstance(metadata_doc, dict) or not all(
            isinstance(v, str) for v in metadata_doc.values()
        ):
            raise FormatError(f"{where}: __metadata__ must map strings to strings")
        metadata = metadata_doc
    if not sealed and HEADER_SUM_KEY in metadata:
        # Only a writer that re-encoded the header (another tool) moves the sum: it no
        # longer covers these bytes, and a file must not pass as checked when it is not.
        raise FormatError(
            f"{where}: __metadata__ holds {HEADER_SUM_KEY!r} but not as the header's first "
            "entry, where weightvault writes it: the header was rewritten by another tool "
            "and the sum no longer covers it; save the file again with weightvault"
        )

    data_start = 8 + len(raw)
    data_size = file_size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in doc.items():
        tensors[name] = _tensor_info(name, entry, data_size, where)

    _check_layout(tensors, data_size, where)
    return Header(tensors, metadata, data_start, file_size, sealed)


def header_sum(raw: bytes | memoryview) -> str:
    """The sum of sealed header bytes ``raw`` (the JSON and its padding, without the
    8-byte length): xxh3-128 of the length and ``raw``, the sum's own digits as zeros."""
    view = memoryview(raw)
    at = _DIGITS_AT - 8
    h = xxhash.xxh3_128(struct.pack("<Q", view.nbytes))
    h.update(view[:at])
    h.update(_ZEROS)
    h.update(view[at + SUM_DIGITS :])
    return h.hexdigest()


def check_header_sum(raw: bytes, where: str) -> None:
    """Check the sum of header bytes ``raw``, which start with :data:`SEAL_PREFIX`.

    Raises:
        ChecksumError: The digits are malformed or do not match the header's bytes.
    """
    at = _DIGITS_AT - 8
    digits = raw[at : at + SUM_DIGITS]
    well_formed = raw[at + SUM_DIGITS : at + SUM_DIGITS + 1] == b'"' and _HEX.issuperset(digits)
    if not (well_formed and len(digits) == SUM_DIGITS and header_sum(raw) == digits.decode()):
        shown = digits[:SUM_DIGITS].decode("ascii", "backslashreplace")
        raise ChecksumError(
            f"{where}: the header (names, shapes, offsets, metadata, manifest and training "
            f"state) does not match its checksum {HEADER_SUM_KEY}={shown!r}: it was changed "
            "after it was saved; restore the file from a good copy"
        )


#: A JSON escape of a UTF-16 surrogate; only these can smuggle a lone one into a string.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def check_unicode(text: str, doc: Any, where: str, what: str) -> None:
    """Refuse JSON whose strings hold a lone surrogate (``"\\ud800"``).

    Valid JSON may escape one, but it is no Unicode character: it cannot be encoded,
    printed or written back, and safetensors' own parser refuses it. Escaped pairs
    decode to one character and pass. Only text that holds such an escape is walked.
    """
    if not _SURROGATE_ESCAPE.search(text):
        return
    try:
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start : e.end].encode("utf-8", "backslashreplace").decode("ascii")
        raise FormatError(
            f"{where}: the {what} holds a lone UTF-16 surrogate ({bad}), which is not "
            "Unicode; rewrite the file with valid names"
        ) from None


def _tensor_info(name: str, entry: Any, data_size: int, where: str) -> TensorInfo:
    if not isinstance(entry, dict):
        raise FormatError(f"{where}: tensor {name!r}: entry must be an object")
    extra = set(entry) - {"dtype", "shape", "data_offsets"}
    if extra or len(entry) != 3:
        raise FormatError(
            f"{where}: tensor {name!r}: entry needs exactly dtype, shape and data_offsets"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise FormatError(
            f"{where}: tensor {name!r}: unknown or unsupported dtype {str(dtype)[:20]!r}"
        )
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise FormatError(f"{where}: tensor {name!r}: shape must be a list of at most 64 sizes")
    if not all(_int(d) and 0 <= d < 2**63 for d in shape):
        raise FormatError(f"{where}: tensor {name!r}: shape {shape[:8]} has a negative or bad size")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_int(o) for o in offsets)):
        raise FormatError(f"{where}: tensor {name!r}: data_offsets must be two integers")
    start, end = offsets
    if not 0 <= start <= end <= data_size:
        raise FormatError(
            f"{where}: tensor {name!r}: data_offsets [{start}, {end}] lie outside the "
            f"{data_size}-byte data section"
        )
    if not fits_int64(shape, ITEMSIZE[dtype]):
        raise FormatError(f"{where}: tensor {name!r}: shape {shape[:8]} overflows 64-bit sizes")
    expected = numel(shape) * ITEMSIZE[dtype]
    if expected != end - start:
        raise FormatError(
            f"{where}: tensor {name!r}: {dtype}{shape} needs {expected} bytes but its "
            f"data_offsets span {end - start}"
        )
    return TensorInfo(name, dtype, tuple(shape), start, end)


def _check_layout(tensors: dict[str, TensorInfo], data_size: int, where: str) -> None:
    # Contiguous, non-overlapping and complete: every byte belongs to exactly one tensor,
    # so no tensor can alias another's bytes and no hidden payload rides along.
    position = 0
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != position:
            problem = "overlaps the previous tensor" if info.start < position else "leaves a gap"
            raise FormatError(
                f"{where}: tensor {info.name!r}: data_offsets start at {info.start}, which "
                f"{problem} (expected {position})"
            )
        position = info.end
    if position != data_size:
        raise FormatError(
            f"{where}: tensors cover {position} of the {data_size} data bytes "
            "(the file is truncated or has trailing bytes)"
        )


def encode_header(
    tensors: list[TensorInfo], metadata: dict[str, str], *, align: int = 8, seal: bool = False
) -> bytes:
    """Encode a header, padded with spaces so the data section starts ``align``-aligned.

    With ``seal``, the header's sum (:data:`HEADER_SUM_KEY`) is its first metadata entry:
    the bytes are encoded once with 32 zeros in its place, hashed, and the digits spliced
    in. The length does not depend on the sum, so a writer may encode placeholders first.
    """
    doc: dict[str, Any] = {}
    if seal:
        metadata = {HEADER_SUM_KEY: _ZEROS.decode(), **metadata}
    if metadata:
        doc[METADATA_KEY] = metadata
    for t in tensors:
        doc[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.start, t.end]}
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(8 + len(body)) % align)
    encoded = struct.pack("<Q", len(body)) + body
    return seal_header(encoded) if seal else encoded


def seal_header(encoded: bytes) -> bytes:
    """Fill in the sum of an encoded header (length included) whose digits are zeros."""
    assert encoded.startswith(_ZEROS, _DIGITS_AT) and encoded[8:].startswith(SEAL_PREFIX)
    digest = xxhash.xxh3_128_hexdigest(encoded).encode()
    return encoded[:_DIGITS_AT] + digest + encoded[_DIGITS_AT + SUM_DIGITS :]
