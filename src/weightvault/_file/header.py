"""The safetensors container: an 8-byte length, a JSON header, then raw tensor bytes.

Reading treats every file as hostile. Each check below is one way a crafted file could
make a reader crash, hang, allocate without bound or read out of bounds; every failure
raises :class:`FormatError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

from .._base.dtypes import ITEMSIZE, MAX_DIMS, fits_int64, numel
from .._base.errors import FormatError
from .._base.types import PathLike

#: Largest header we parse. safetensors uses the same bound; a real header of a
#: 100k-tensor model is a few MB.
MAX_HEADER_BYTES = 100_000_000
#: The safetensors header's own key for string metadata: no tensor may take it.
METADATA_KEY = "__metadata__"


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
    """Validate header bytes ``raw`` for a file of ``file_size`` bytes."""
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

    data_start = 8 + len(raw)
    data_size = file_size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in doc.items():
        tensors[name] = _tensor_info(name, entry, data_size, where)

    _check_layout(tensors, data_size, where)
    return Header(tensors, metadata, data_start, file_size)


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


def encode_header(tensors: list[TensorInfo], metadata: dict[str, str], *, align: int = 8) -> bytes:
    """Encode a header, padded with spaces so the data section starts ``align``-aligned."""
    doc: dict[str, Any] = {}
    if metadata:
        doc[METADATA_KEY] = metadata
    for t in tensors:
        doc[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.start, t.end]}
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(8 + len(body)) % align)
    return struct.pack("<Q", len(body)) + body
