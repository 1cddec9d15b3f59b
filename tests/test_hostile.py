"""Hostile input for the reader: every malformed file is a FormatError, raised quickly.

Files are crafted by hand, byte by byte, so each case exercises exactly one check. The
readers under test are ``open_checkpoint``, ``weightvault.inspect``, ``weightvault.verify``
(which reports instead of raising) and, when PyTorch is installed, ``load_file``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import struct
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import weightvault
from weightvault.formats._registry import open_checkpoint

try:
    import torch

    import weightvault.torch as wvt
except ImportError:  # pragma: no cover - the framework-free cases still run
    torch = None  # type: ignore[assignment]
    wvt = None  # type: ignore[assignment]

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")

# ---------------------------------------------------------------------------------------
# Building files by hand
# ---------------------------------------------------------------------------------------


def blob(header: dict[str, Any] | bytes, data: bytes = b"", *, length: int | None = None) -> bytes:
    """An 8-byte little-endian length, the header bytes, then ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode("utf-8")
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + data


def entry(dtype: str, shape: list[Any], start: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def with_manifest(manifest: dict[str, Any] | str, tensors: dict[str, Any], **extra: str):
    text = manifest if isinstance(manifest, str) else json.dumps(manifest)
    return {"__metadata__": {"weightvault": text, **extra}, **tensors}


#: One stored F32[2] tensor "a" and one U8[4] tensor "b": 12 data bytes.
TWO = {"a": entry("F32", [2], 0, 8), "b": entry("U8", [4], 8, 12)}
TWO_DATA = bytes(range(12))


def _open(path: Path) -> Any:
    with open_checkpoint(path) as ckpt:
        return ckpt.names


def _load_file(path: Path) -> Any:
    assert wvt is not None
    return wvt.load_file(path)


def _load_file_mmap(path: Path) -> Any:
    assert wvt is not None
    return wvt.load_file(path, mmap=True)


def _numpy_load_file(path: Path) -> Any:
    import weightvault.numpy as wvn

    return wvn.load_file(path, verify=True)


READERS: list[Any] = [
    pytest.param(_open, id="open_checkpoint"),
    pytest.param(weightvault.inspect, id="inspect"),
    pytest.param(_numpy_load_file, id="numpy_load_file"),
    pytest.param(_load_file, id="load_file", marks=needs_torch),
    pytest.param(_load_file_mmap, id="load_file_mmap", marks=needs_torch),
]

# ---------------------------------------------------------------------------------------
# The cases: (file bytes, regex the message must match)
# ---------------------------------------------------------------------------------------

DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJ = b'{"a":' * 100_000 + b"1" + b"}" * 100_000

CASES: dict[str, tuple[bytes, str]] = {
    # The container itself.
    "empty_file": (b"", r"0 bytes is too short"),
    "seven_bytes": (b"\x01" * 7, r"7 bytes is too short"),
    "length_past_end": (blob(b"{}", length=1000), r"header length 1000 runs past the end"),
    "length_past_end_by_one": (blob(b"{}", length=3), r"header length 3 runs past the end"),
    "length_above_cap": (blob(b"{}", length=100_000_001), r"exceeds the 100000000-byte cap"),
    "length_u64_max": (blob(b"{}", length=2**64 - 1), r"exceeds the 100000000-byte cap"),
    "length_zero": (blob(b""), r"not valid UTF-8 JSON"),
    # The header text.
    "invalid_utf8": (blob(b'{"a\xff\xfe":1}'), r"not valid UTF-8 JSON \(UnicodeDecodeError\)"),
    "lone_surrogate_bytes": (blob(b'{"\xed\xa0\x80":1}'), r"not valid UTF-8 JSON"),
    "invalid_json": (blob(b'{"a": {'), r"not valid UTF-8 JSON"),
    "trailing_garbage": (blob(b"{} x"), r"not valid UTF-8 JSON"),
    "nul_padding": (blob(b"{}\x00\x00"), r"not valid UTF-8 JSON"),
    "json_list": (blob(b"[]"), r"must be a JSON object, got list"),
    "json_string": (blob(b'"x"'), r"must be a JSON object, got str"),
    "json_null": (blob(b"null"), r"must be a JSON object, got NoneType"),
    "deeply_nested_list": (blob(DEEP), r"not valid UTF-8 JSON"),
    "deeply_nested_object": (blob(DEEP_OBJ), r"not valid UTF-8 JSON"),
    "huge_integer_literal": (
        blob(b'{"a":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,1]}}', b"x"),
        r"not valid UTF-8 JSON",
    ),
    "duplicate_tensor": (
        blob(
            b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
            b'"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
            b"x",
        ),
        r"duplicate key 'a'",
    ),
    "duplicate_field": (
        blob(b'{"a":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}}', b"x"),
        r"duplicate key 'dtype'",
    ),
    "duplicate_metadata_key": (
        blob(b'{"__metadata__":{"k":"1","k":"2"}}'),
        r"duplicate key 'k'",
    ),
    # Metadata.
    "metadata_int_value": (blob({"__metadata__": {"k": 1}}), r"__metadata__ must map strings"),
    "metadata_null_value": (blob({"__metadata__": {"k": None}}), r"__metadata__ must map strings"),
    "metadata_nested": (blob({"__metadata__": {"k": {"x": "y"}}}), r"must map strings"),
    "metadata_list": (blob({"__metadata__": ["k"]}), r"__metadata__ must map strings"),
    "metadata_string": (blob({"__metadata__": "k"}), r"__metadata__ must map strings"),
    # Tensor entries.
    "entry_not_object": (blob({"a": [1, 2]}), r"tensor 'a': entry must be an object"),
    "entry_missing_offsets": (
        blob({"a": {"dtype": "U8", "shape": [1]}}, b"x"),
        r"tensor 'a': entry needs exactly dtype, shape and data_offsets",
    ),
    "entry_extra_field": (
        blob({"a": {**entry("U8", [1], 0, 1), "x": 1}}, b"x"),
        r"tensor 'a': entry needs exactly",
    ),
    "unknown_dtype": (blob({"a": entry("F128", [1], 0, 16)}, bytes(16)), r"unknown or unsupported"),
    "dtype_lowercase": (blob({"a": entry("f32", [1], 0, 4)}, bytes(4)), r"unknown or unsupported"),
    "dtype_not_string": (blob({"a": entry(4, [1], 0, 4)}, bytes(4)), r"unknown or unsupported"),  # type: ignore[arg-type]
    "dtype_sub_byte": (blob({"a": entry("F4", [2], 0, 1)}, b"x"), r"unknown or unsupported"),
    "shape_not_list": (blob({"a": entry("U8", 1, 0, 1)}, b"x"), r"shape must be a list"),  # type: ignore[arg-type]
    "shape_too_many_dims": (
        blob({"a": entry("U8", [1] * 65, 0, 1)}, b"x"),
        r"shape must be a list of at most 64",
    ),
    "shape_negative": (blob({"a": entry("U8", [-1], 0, 0)}), r"negative or bad size"),
    "shape_negative_pair": (blob({"a": entry("U8", [-2, -3], 0, 6)}, bytes(6)), r"bad size"),
    "shape_bool": (blob({"a": entry("U8", [True], 0, 1)}, b"x"), r"negative or bad size"),
    "shape_float": (blob({"a": entry("U8", [1.0], 0, 1)}, b"x"), r"negative or bad size"),
    "shape_string": (blob({"a": entry("U8", ["1"], 0, 1)}, b"x"), r"negative or bad size"),
    "shape_null": (blob({"a": entry("U8", [None], 0, 1)}, b"x"), r"negative or bad size"),
    "shape_2_63": (blob({"a": entry("U8", [2**63], 0, 1)}, b"x"), r"negative or bad size"),
    "shape_overflowing_product": (
        blob({"a": entry("F32", [2**62, 2**62, 4], 0, 16)}, bytes(16)),
        r"shape \[4611686018427387904, 4611686018427387904, 4\] overflows 64-bit sizes",
    ),
    "shape_product_wraps_to_small": (
        # 2**32 * 2**32 = 2**64 wraps to 0 in 64-bit arithmetic; it must not here.
        blob({"a": entry("U8", [2**32, 2**32], 0, 0)}),
        r"shape \[4294967296, 4294967296\] overflows 64-bit sizes",
    ),
    "shape_mismatches_span": (
        blob({"a": entry("F32", [3], 0, 8)}, bytes(8)),
        r"tensor 'a': F32\[3\] needs 12 bytes but its data_offsets span 8",
    ),
    "offsets_not_list": (
        blob({"a": {"dtype": "U8", "shape": [1], "data_offsets": 0}}, b"x"),
        r"data_offsets must be two integers",
    ),
    "offsets_three": (
        blob({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, b"x"),
        r"data_offsets must be two integers",
    ),
    "offsets_float": (
        blob({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0.0, 1.0]}}, b"x"),
        r"data_offsets must be two integers",
    ),
    "offsets_bool": (
        blob({"a": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, b"x"),
        r"data_offsets must be two integers",
    ),
    "offsets_negative": (
        blob({"a": entry("U8", [1], -1, 0)}, b"x"),
        r"data_offsets \[-1, 0\] lie outside",
    ),
    "offsets_reversed": (
        blob({"a": entry("U8", [0], 1, 0)}, b"x"),
        r"data_offsets \[1, 0\] lie outside",
    ),
    "offsets_past_file": (
        blob({"a": entry("U8", [8], 0, 8)}, b"xxxx"),
        r"tensor 'a': data_offsets \[0, 8\] lie outside the 4-byte data section",
    ),
    "offsets_huge": (
        blob({"a": entry("U8", [2**62], 2**70, 2**71)}, b"x"),
        r"lie outside the 1-byte data section",
    ),
    "overlapping": (
        blob({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}, bytes(6)),
        r"tensor 'b': data_offsets start at 2, which overlaps the previous tensor",
    ),
    "same_bytes_twice": (
        blob({"a": entry("U8", [4], 0, 4), "b": entry("I8", [4], 0, 4)}, bytes(4)),
        r"tensor '[ab]': data_offsets start at 0, which overlaps",
    ),
    "gap": (
        blob({"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 6, 10)}, bytes(10)),
        r"tensor 'b': data_offsets start at 6, which leaves a gap \(expected 4\)",
    ),
    "gap_at_start": (
        blob({"a": entry("U8", [4], 4, 8)}, bytes(8)),
        r"tensor 'a': data_offsets start at 4, which leaves a gap",
    ),
    "trailing_bytes": (
        blob(TWO, TWO_DATA + b"hidden payload"),
        r"tensors cover 12 of the 26 data bytes",
    ),
    "data_without_tensors": (blob({}, b"xyz"), r"tensors cover 0 of the 3 data bytes"),
    "truncated_data": (
        blob(TWO, TWO_DATA[:10]),
        r"tensor 'b': data_offsets \[8, 12\] lie outside the 10-byte data section",
    ),
    "truncated_to_header": (blob(TWO), r"lie outside the 0-byte data section"),
    # The weightvault manifest.
    "manifest_bad_json": (
        blob(with_manifest("{not json", TWO), TWO_DATA),
        r"weightvault manifest is not valid JSON",
    ),
    "manifest_deeply_nested": (
        blob(with_manifest("[" * 100_000, TWO), TWO_DATA),
        r"weightvault manifest is not valid JSON",
    ),
    "manifest_list": (
        blob(with_manifest("[1]", TWO), TWO_DATA),
        r"weightvault manifest must be a JSON object",
    ),
    "manifest_no_version": (
        blob(with_manifest({}, TWO), TWO_DATA),
        r"manifest version 'None' is not supported",
    ),
    "manifest_future_version": (
        blob(with_manifest({"version": 2}, TWO), TWO_DATA),
        r"manifest version '2' is not supported.*upgrade weightvault",
    ),
    "manifest_version_string": (
        blob(with_manifest({"version": "1"}, TWO), TWO_DATA),
        r"manifest version '1' is not supported",
    ),
    "aliases_not_object": (
        blob(with_manifest({"version": 1, "aliases": ["x"]}, TWO), TWO_DATA),
        r"manifest field 'aliases' must be an object",
    ),
    "aliases_non_string": (
        blob(with_manifest({"version": 1, "aliases": {"x": 1}}, TWO), TWO_DATA),
        r"manifest field 'aliases' must map names to names",
    ),
    "alias_to_missing": (
        blob(with_manifest({"version": 1, "aliases": {"x": "nope"}}, TWO), TWO_DATA),
        r"alias 'x' points at 'nope', which is neither stored nor a copy or view",
    ),
    "alias_to_alias": (
        blob(with_manifest({"version": 1, "aliases": {"x": "a", "y": "x"}}, TWO), TWO_DATA),
        r"alias 'y' points at 'x', which is neither stored nor a copy or view",
    ),
    "alias_to_itself": (
        blob(with_manifest({"version": 1, "aliases": {"x": "x"}}, TWO), TWO_DATA),
        r"alias 'x' points at 'x', which is neither stored nor a copy or view",
    ),
    "copy_to_missing": (
        blob(with_manifest({"version": 1, "copies": {"c": "nope"}}, TWO), TWO_DATA),
        r"copy 'c' points at 'nope', which is neither stored nor a view",
    ),
    "copies_non_string": (
        blob(with_manifest({"version": 1, "copies": {"c": ["a"]}}, TWO), TWO_DATA),
        r"manifest field 'copies' must map names to names",
    ),
    "alias_shadows_stored": (
        blob(with_manifest({"version": 1, "aliases": {"b": "a"}}, TWO), TWO_DATA),
        r"manifest gives names \['b'\] more than one meaning",
    ),
    "copy_shadows_stored": (
        blob(with_manifest({"version": 1, "copies": {"a": "b"}}, TWO), TWO_DATA),
        r"manifest gives names \['a'\] more than one meaning",
    ),
    "alias_and_copy_collide": (
        blob(
            with_manifest({"version": 1, "aliases": {"x": "a"}, "copies": {"x": "b"}}, TWO),
            TWO_DATA,
        ),
        r"manifest gives names \['x'\] more than one meaning",
    ),
    "alias_and_view_collide": (
        blob(
            with_manifest(
                {"version": 1, "aliases": {"x": "a"}, "views": {"x": ["b", "U8", [1], [1], 0]}},
                TWO,
            ),
            TWO_DATA,
        ),
        r"manifest gives names \['x'\] more than one meaning",
    ),
    "view_shadows_stored": (
        blob(
            with_manifest({"version": 1, "views": {"a": ["b", "U8", [1], [1], 0]}}, TWO),
            TWO_DATA,
        ),
        r"manifest gives names \['a'\] more than one meaning",
    ),
    "views_not_object": (
        blob(with_manifest({"version": 1, "views": []}, TWO), TWO_DATA),
        r"manifest field 'views' must be an object",
    ),
    "view_malformed_record": (
        blob(with_manifest({"version": 1, "views": {"v": ["a", "F32", [1]]}}, TWO), TWO_DATA),
        r"view 'v': malformed view record",
    ),
    "view_unknown_dtype": (
        blob(with_manifest({"version": 1, "views": {"v": ["a", "X", [1], [1], 0]}}, TWO), TWO_DATA),
        r"view 'v': malformed view record",
    ),
    "view_negative_stride": (
        blob(
            with_manifest({"version": 1, "views": {"v": ["a", "F32", [2], [-1], 4]}}, TWO),
            TWO_DATA,
        ),
        r"view 'v': malformed view record",
    ),
    "view_shape_stride_lengths_differ": (
        blob(
            with_manifest({"version": 1, "views": {"v": ["a", "F32", [2], [1, 1], 0]}}, TWO),
            TWO_DATA,
        ),
        r"view 'v': malformed view record",
    ),
    "view_bool_offset": (
        blob(
            with_manifest({"version": 1, "views": {"v": ["a", "U8", [1], [1], True]}}, TWO),
            TWO_DATA,
        ),
        r"view 'v': malformed view record",
    ),
    "view_of_missing": (
        blob(
            with_manifest({"version": 1, "views": {"v": ["nope", "U8", [1], [1], 0]}}, TWO),
            TWO_DATA,
        ),
        r"view 'v' reads 'nope', which is not stored",
    ),
    "view_out_of_bounds": (
        blob(
            with_manifest({"version": 1, "views": {"v": ["a", "F32", [3], [1], 0]}}, TWO),
            TWO_DATA,
        ),
        r"view 'v' reads bytes \[0, 12\) outside 'a' \(8 bytes\)",
    ),
    "view_offset_out_of_bounds": (
        blob(
            with_manifest({"version": 1, "views": {"v": ["a", "F32", [1], [1], 8]}}, TWO),
            TWO_DATA,
        ),
        r"view 'v' reads bytes \[8, 12\) outside 'a'",
    ),
    "view_stride_out_of_bounds": (
        blob(
            with_manifest({"version": 1, "views": {"v": ["b", "U8", [2], [2**62], 0]}}, TWO),
            TWO_DATA,
        ),
        r"view 'v' reads bytes \[0, \d+\) outside 'b' \(4 bytes\)",
    ),
    "view_misaligned_offset": (
        blob(
            with_manifest({"version": 1, "views": {"v": ["a", "F32", [1], [1], 2]}}, TWO),
            TWO_DATA,
        ),
        r"view 'v' starts at byte 2, which is not a multiple of its F32 item size",
    ),
    "frozen_unknown": (
        blob(with_manifest({"version": 1, "frozen": ["a", "ghost"]}, TWO), TWO_DATA),
        r"manifest lists unknown names \['ghost'\]",
    ),
    "frozen_not_list": (
        blob(with_manifest({"version": 1, "frozen": "a"}, TWO), TWO_DATA),
        r"manifest field 'frozen' must be a list of names",
    ),
    "names_unknown": (
        blob(with_manifest({"version": 1, "names": ["a", "b", "ghost"]}, TWO), TWO_DATA),
        r"manifest lists unknown names \['ghost'\]",
    ),
    "names_non_string": (
        blob(with_manifest({"version": 1, "names": ["a", 1]}, TWO), TWO_DATA),
        r"manifest field 'names' must be a list of names",
    ),
    "metadata_field_non_string": (
        blob(with_manifest({"version": 1, "metadata": {"k": 1}}, TWO), TWO_DATA),
        r"manifest field 'metadata' must map names to names",
    ),
    "unknown_checksum_algorithm": (
        blob(
            with_manifest(
                {"version": 1, "checksum": "md5", "sums": {"a": "0" * 16, "b": "0" * 16}}, TWO
            ),
            TWO_DATA,
        ),
        r"unknown checksum algorithm 'md5'",
    ),
    "checksum_bad_hex": (
        blob(
            with_manifest(
                {"version": 1, "checksum": "xxh3_64", "sums": {"a": "g" * 16, "b": "0" * 16}}, TWO
            ),
            TWO_DATA,
        ),
        r"manifest checksums do not match the stored tensors",
    ),
    "checksum_uppercase_hex": (
        blob(
            with_manifest(
                {"version": 1, "checksum": "xxh3_64", "sums": {"a": "A" * 16, "b": "0" * 16}}, TWO
            ),
            TWO_DATA,
        ),
        r"manifest checksums do not match the stored tensors",
    ),
    "checksum_short": (
        blob(
            with_manifest(
                {"version": 1, "checksum": "xxh3_64", "sums": {"a": "0" * 15, "b": "0" * 16}}, TWO
            ),
            TWO_DATA,
        ),
        r"manifest checksums do not match the stored tensors",
    ),
    "checksum_missing_tensor": (
        blob(
            with_manifest({"version": 1, "checksum": "xxh3_64", "sums": {"a": "0" * 16}}, TWO),
            TWO_DATA,
        ),
        r"manifest checksums do not match the stored tensors",
    ),
    "checksum_extra_tensor": (
        blob(
            with_manifest(
                {
                    "version": 1,
                    "checksum": "xxh3_64",
                    "sums": {"a": "0" * 16, "b": "0" * 16, "c": "0" * 16},
                },
                TWO,
            ),
            TWO_DATA,
        ),
        r"manifest checksums do not match the stored tensors",
    ),
    "sums_not_object": (
        blob(with_manifest({"version": 1, "checksum": "xxh3_64", "sums": "00"}, TWO), TWO_DATA),
        r"manifest field 'sums' must be an object",
    ),
    # Lone UTF-16 surrogates: valid JSON escapes, but no Unicode; nothing can print or
    # encode such a name (the CLI died of UnicodeEncodeError).
    "lone_surrogate_tensor_name": (
        blob(b'{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
        r"header holds a lone UTF-16 surrogate \(\\ud800\)",
    ),
    "lone_surrogate_metadata_key": (
        blob({"__metadata__": {"\udfff": "x"}, **TWO}, TWO_DATA),
        r"header holds a lone UTF-16 surrogate \(\\udfff\)",
    ),
    "lone_surrogate_in_manifest": (
        blob(with_manifest({"version": 1, "aliases": {"\ud800x": "a"}}, TWO), TWO_DATA),
        r"weightvault manifest holds a lone UTF-16 surrogate",
    ),
}

#: Upper bound on the wall time of any one rejection; all of them are microseconds to
#: milliseconds, so this is generous and catches only a hang or a quadratic blow-up.
FAST_S = 2.0


def _write(tmp_path: Path, data: bytes, name: str = "hostile.safetensors") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_file_is_a_format_error(
    tmp_path: Path, case: str, reader: Callable[[Path], Any]
) -> None:
    data, pattern = CASES[case]
    path = _write(tmp_path, data)
    started = time.process_time()
    with pytest.raises(weightvault.FormatError, match=pattern) as info:
        reader(path)
    assert time.process_time() - started < FAST_S
    assert isinstance(info.value, ValueError)
    # Every message names the file, so a user knows which of many checkpoints is broken.
    assert str(path) in str(info.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_verify_reports_hostile_file(tmp_path: Path, case: str) -> None:
    data, pattern = CASES[case]
    path = _write(tmp_path, data)
    started = time.process_time()
    report = weightvault.verify(path)
    assert time.process_time() - started < FAST_S
    assert report.ok is False
    assert len(report.problems) == 1
    assert re.search(pattern, report.problems[0]), report.problems


def test_valid_baselines_read(tmp_path: Path) -> None:
    """The hand-built baselines the cases mutate are themselves valid, so each case
    fails for the reason it names and no other."""
    files = {
        "two": blob(TWO, TWO_DATA),
        "empty_header": blob({}),
        "padded": blob(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}   ', b"x"),
        "zero_size": blob({"a": entry("F32", [0, 3], 0, 0)}),
        "zero_d": blob({"a": entry("F64", [], 0, 8)}, bytes(8)),
        "max_dims": blob({"a": entry("U8", [1] * 64, 0, 1)}, b"x"),
        "foreign_alias": blob({"__metadata__": {"x": "a", "format": "pt"}, **TWO}, TWO_DATA),
        "foreign_chain": blob({"__metadata__": {"x": "y", "y": "a"}, **TWO}, TWO_DATA),
        "manifest": blob(
            with_manifest(
                {
                    "version": 1,
                    "aliases": {"x": "a"},
                    "copies": {"c": "b"},
                    "views": {"v": ["a", "F32", [1], [1], 4]},
                    "frozen": ["a", "x"],
                },
                TWO,
            ),
            TWO_DATA,
        ),
    }
    for name, data in files.items():
        path = _write(tmp_path, data, f"{name}.safetensors")
        info = weightvault.inspect(path)
        assert weightvault.verify(path).ok, name
        with open_checkpoint(path) as ckpt:
            assert ckpt.names == info.names
    assert weightvault.inspect(tmp_path / "foreign_alias.safetensors").aliases == {"x": "a"}
    assert weightvault.inspect(tmp_path / "foreign_chain.safetensors").aliases == {
        "x": "a",
        "y": "a",
    }
    m = weightvault.inspect(tmp_path / "manifest.safetensors")
    assert (m.aliases, m.copies, m.views) == ({"x": "a"}, {"c": "b"}, ["v"])


def test_header_cap_fails_before_allocating(tmp_path: Path) -> None:
    """A length just above the cap, backed by a real file that large, is refused from
    the 8-byte prefix alone: nothing close to the claimed size is ever allocated."""
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 100_000_001) + b"{")
        f.truncate(8 + 100_000_001 + 16)  # sparse: the claimed header really is there
    for reader in (_open, weightvault.inspect):
        tracemalloc.start()
        try:
            started = time.process_time()
            with pytest.raises(weightvault.FormatError, match=r"exceeds the .*-byte cap"):
                reader(path)
            elapsed = time.process_time() - started
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert elapsed < 0.5
        assert peak < 1_000_000, peak


def test_header_length_past_end_fails_before_allocating(tmp_path: Path) -> None:
    path = _write(tmp_path, struct.pack("<Q", 99_999_999) + b"{}")
    tracemalloc.start()
    try:
        with pytest.raises(weightvault.FormatError, match=r"runs past the end of the 10-byte"):
            weightvault.inspect(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak


#: Foreign ``{alias: kept}`` chains that never reach a tensor. They name no tensor, so a
#: reader keeps them as plain metadata; following them must terminate, and quickly.
FOREIGN_CYCLES = {
    "two": {"x": "y", "y": "x"},
    "self": {"x": "x"},
    "three": {"x": "y", "y": "z", "z": "x"},
    "chain_into_cycle": {"w": "x", "x": "y", "y": "x"},
    "long_cycle": {f"k{i}": f"k{(i + 1) % 300}" for i in range(300)},
}


@pytest.mark.parametrize("case", sorted(FOREIGN_CYCLES))
def test_foreign_alias_cycles_are_plain_metadata(tmp_path: Path, case: str) -> None:
    meta = {**FOREIGN_CYCLES[case], "real": "a"}
    path = _write(tmp_path, blob({"__metadata__": meta, **TWO}, TWO_DATA))
    started = time.process_time()
    info = weightvault.inspect(path)
    assert time.process_time() - started < FAST_S
    assert info.aliases == {"real": "a"}
    assert info.names == ["a", "b", "real"]
    for key, value in FOREIGN_CYCLES[case].items():
        assert info.metadata[key] == value
    assert weightvault.verify(path).ok
    if wvt is not None:
        out = wvt.load_file(path)
        assert list(out) == ["a", "b", "real"]
        assert out["real"] is out["a"]


@contextlib.contextmanager
def time_limit(seconds: float):  # type: ignore[no-untyped-def]
    """Interrupt the block with TimeoutError after ``seconds`` of CPU time, or ten times
    that of wall time (a hang fails, not blocks). CPU time, because a loaded CI machine
    stretches wall time several-fold while the work itself stays the same."""

    def alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s of CPU time (or {10 * seconds} s)")

    old_real = signal.signal(signal.SIGALRM, alarm)
    old_prof = signal.signal(signal.SIGPROF, alarm)
    signal.setitimer(signal.ITIMER_REAL, 10 * seconds)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGALRM, old_real)
        signal.signal(signal.SIGPROF, old_prof)


needs_alarm = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
#: A linear reader handles these headers (under 1 MB) in milliseconds.
SLOW_S = 2.0


@needs_alarm
@pytest.mark.parametrize("shape", ["chain", "cycle"])
def test_long_foreign_alias_chain_is_linear(tmp_path: Path, shape: str) -> None:
    n = 30_000
    meta = {f"k{i}": f"k{i + 1}" for i in range(n)}
    meta[f"k{n - 1}"] = "a" if shape == "chain" else "k0"
    path = _write(tmp_path, blob({"__metadata__": meta, **TWO}, TWO_DATA))
    with time_limit(SLOW_S):
        info = weightvault.inspect(path)
    assert len(info.aliases) == (n if shape == "chain" else 0)


@needs_alarm
def test_name_clash_in_a_large_manifest_is_reported_quickly(tmp_path: Path) -> None:
    aliases = {f"x{i}": "a" for i in range(40_000)}
    aliases["b"] = "a"  # "b" is stored: one name, two meanings
    path = _write(tmp_path, blob(with_manifest({"version": 1, "aliases": aliases}, TWO), TWO_DATA))
    with time_limit(SLOW_S), pytest.raises(weightvault.FormatError, match=r"\['b'\] more than one"):
        weightvault.inspect(path)


def test_directory_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(weightvault.FormatError, match=r"is a directory"):
        weightvault.inspect(tmp_path)
    assert weightvault.verify(tmp_path).ok is False


# ---------------------------------------------------------------------------------------
# Cases that only a framework can hit: the header is valid, but materializing is not
# ---------------------------------------------------------------------------------------


@needs_torch
def test_zero_size_tensor_with_overflowing_dims(tmp_path: Path) -> None:
    path = _write(tmp_path, blob({"a": entry("F32", [2**62, 2**62, 0], 0, 0)}))
    # Zero bytes match a zero span, but no framework can hold the shape: refused up front.
    with pytest.raises(weightvault.FormatError, match="overflows 64-bit sizes"):
        weightvault.inspect(path)
    with pytest.raises(weightvault.FormatError, match="overflows 64-bit sizes"):
        _load_file(path)


@needs_torch
def test_zero_size_view_with_overflowing_dims(tmp_path: Path) -> None:
    manifest = {"version": 1, "views": {"v": ["b", "U8", [2**62, 2**62, 0], [1, 1, 1], 0]}}
    path = _write(tmp_path, blob(with_manifest(manifest, TWO), TWO_DATA))
    with pytest.raises(weightvault.FormatError, match="overflows 64-bit sizes"):
        weightvault.inspect(path)
    with pytest.raises(weightvault.FormatError, match="overflows 64-bit sizes"):
        _load_file(path)


# ---------------------------------------------------------------------------------------
# Checksums: damage after saving is found, named, and never reaches a model
# ---------------------------------------------------------------------------------------


def _flip_byte_of(path: Path, stored: str, index: int = 0) -> None:
    with open_checkpoint(path) as ckpt:
        info = ckpt.stored[stored]
        assert info.nbytes > index
        at = ckpt.header.data_start + info.start + index
    with open(path, "r+b") as f:
        f.seek(at)
        (byte,) = f.read(1)
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


@needs_torch
def test_flipped_byte_is_caught_and_named(tmp_path: Path) -> None:
    assert torch is not None and wvt is not None
    torch.manual_seed(0)

    def build() -> torch.nn.Module:
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        m[2].weight = torch.nn.Parameter(m[0].weight.detach().t().clone())
        m.register_buffer("steps", torch.tensor(7))
        return m

    saved = build()
    path = tmp_path / "model.safetensors"
    wvt.save(saved, path)
    assert weightvault.verify(path).ok

    _flip_byte_of(path, "2.weight", index=37)

    report = weightvault.verify(path)
    assert report.ok is False
    assert len(report.problems) == 1
    assert "'2.weight'" in report.problems[0]
    assert "checksum mismatch" in report.problems[0]

    target = build()  # different random values from the file
    with torch.no_grad():
        for p in target.parameters():
            p.add_(1.0)
    before = {k: v.detach().clone() for k, v in target.state_dict().items()}
    with pytest.raises(weightvault.ChecksumError, match=r"2\.weight") as info:
        wvt.load(target, path, verify=True)
    assert info.value.names == ["2.weight"]
    assert isinstance(info.value, weightvault.FormatError)
    after = target.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k

    with pytest.raises(weightvault.ChecksumError, match=r"2\.weight"):
        wvt.load_file(path, verify=True)
    # Without verify the damage is not looked for, and the undamaged tensors are intact.
    loaded = wvt.load_file(path)
    assert torch.equal(loaded["0.weight"], saved[0].weight.detach())
    assert not torch.equal(loaded["2.weight"], saved[2].weight.detach())


@needs_torch
def test_flipped_byte_in_tied_tensor_names_the_stored_tensor(tmp_path: Path) -> None:
    assert torch is not None and wvt is not None
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    path = tmp_path / "tied.safetensors"
    wvt.save(model, path)
    assert weightvault.inspect(path).aliases == {"head.weight": "emb.weight"}
    _flip_byte_of(path, "emb.weight", index=5)
    report = weightvault.verify(path)
    assert not report.ok
    assert "'emb.weight'" in report.problems[0]
    fresh = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)}
    )
    fresh.head.weight = fresh.emb.weight
    before = fresh.emb.weight.detach().clone()
    with pytest.raises(weightvault.ChecksumError, match=r"emb\.weight"):
        wvt.load(fresh, path, verify=True)
    assert torch.equal(fresh.emb.weight.detach(), before)


# ---------------------------------------------------------------------------------------
# Fuzz: a damaged valid file loads or is a FormatError, never anything else
# ---------------------------------------------------------------------------------------


def _valid_file() -> bytes:
    """A small weightvault file with an alias, a copy, views, frozen names and metadata."""
    assert torch is not None and wvt is not None
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 4, generator=g)
    tensors = {
        "w": base,
        "w_tied": base,
        "w_t": base.t(),
        "w_copy": base.clone(),
        "b": torch.arange(5, dtype=torch.int16),
        "flag": torch.tensor(True),
        "half": torch.randn(2, 2, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 2),
    }
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "v.safetensors")
        wvt.save(tensors, p, metadata={"step": "3"})
        with open(p, "rb") as f:
            return f.read()


_VALID: bytes | None = None


def _valid() -> bytes:
    global _VALID
    if _VALID is None:
        _VALID = _valid_file()
    return _VALID


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    data = bytearray(_valid())
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    for _ in range(draw(st.integers(0, 4))):
        # Mostly hit the header, where every byte means something.
        hi = draw(st.sampled_from([header_end, len(data)])) - 1
        at = draw(st.integers(0, hi))
        kind = draw(st.sampled_from(["set", "flip", "delete", "insert"]))
        if kind == "set":
            data[at] = draw(st.sampled_from(b'0123456789-[]{}",:.eE ') | st.integers(0, 255))
        elif kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "delete":
            del data[at]
        else:
            data.insert(at, draw(st.integers(0, 255)))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@needs_torch
@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=damaged())
def test_fuzzed_file_loads_or_is_a_format_error(tmp_path: Path, data: bytes) -> None:
    assert wvt is not None
    path = _write(tmp_path, data, "fuzz.safetensors")
    for read in (
        weightvault.inspect,
        wvt.load_file,
        lambda p: wvt.load_file(p, mmap=True, verify=True),
    ):
        with contextlib.suppress(weightvault.FormatError):
            read(path)
    report = weightvault.verify(path)  # never raises: damage is reported
    assert isinstance(report.ok, bool)


# ---------------------------------------------------------------------------------------
# Tiny files that describe gigabytes: refused before anything is allocated
# ---------------------------------------------------------------------------------------


def _stride0_view(n: int) -> bytes:
    """One stored F32 and a view that repeats it ``n`` times (stride 0): 4 data bytes."""
    manifest = {"version": 1, "views": {"v": ["a", "F32", [n], [0], 0]}}
    return blob(with_manifest(manifest, {"a": entry("F32", [1], 0, 4)}), b"\0\0\x80?")


def test_stride0_view_of_2_28_elements_is_refused_by_eager_reads(tmp_path: Path) -> None:
    import weightvault.numpy as wvn

    path = _write(tmp_path, _stride0_view(2**28))
    assert path.stat().st_size < 320
    tracemalloc.start()
    try:
        with pytest.raises(weightvault.FormatError, match=r"would allocate 1073741832 bytes") as e:
            wvn.load_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20, peak
    assert str(path) in str(e.value) and "max_bytes" in str(e.value)
    # The header alone is fine: inspect and verify describe it without reading values.
    assert weightvault.inspect(path).tensors["v"].nbytes == 2**30
    assert weightvault.verify(path).ok


def test_stride0_view_reads_when_the_caller_raises_the_limit(tmp_path: Path) -> None:
    import numpy as np

    import weightvault.numpy as wvn

    path = _write(tmp_path, _stride0_view(2**20))
    with pytest.raises(weightvault.FormatError, match=r"more than the 1000-byte limit"):
        wvn.load_file(path, max_bytes=1000)
    out = wvn.load_file(path, max_bytes=8 << 20)
    assert out["v"].shape == (2**20,) and np.all(out["v"] == 1.0)


def test_one_environment_variable_sets_every_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WEIGHTVAULT_MAX_DECODED_BYTES limits eager safetensors reads as it limits the
    foreign readers, both ways: lower than the default, and higher."""
    import weightvault.numpy as wvn

    path = _write(tmp_path, _stride0_view(2**20))
    monkeypatch.setenv("WEIGHTVAULT_MAX_DECODED_BYTES", "1000")
    with pytest.raises(weightvault.FormatError, match="WEIGHTVAULT_MAX_DECODED_BYTES"):
        wvn.load_file(path)
    big = _write(tmp_path, _stride0_view(2**26 + 2**24), name="big.safetensors")
    with pytest.raises(weightvault.FormatError):
        monkeypatch.delenv("WEIGHTVAULT_MAX_DECODED_BYTES")
        wvn.load_file(big)  # 320 MiB from a few hundred bytes: over the default
    monkeypatch.setenv("WEIGHTVAULT_MAX_DECODED_BYTES", str(1 << 30))
    assert wvn.load_file(big)["v"].shape == (2**26 + 2**24,)


@needs_torch
def test_torch_reads_a_stride0_view_lazily(tmp_path: Path) -> None:
    """A view of its base allocates nothing, so torch reads what numpy must refuse."""
    assert wvt is not None
    path = _write(tmp_path, _stride0_view(2**28))
    for mmap in (False, True):
        out = wvt.load_file(path, mmap=mmap)
        assert out["v"].shape == (2**28,) and out["v"].stride() == (0,)
        assert out["v"].untyped_storage().nbytes() == 4


def _copies(n: int, nbytes: int) -> bytes:
    """One stored U8 tensor of ``nbytes`` and ``n`` copies of it."""
    manifest = {"version": 1, "copies": {f"c{i}": "a" for i in range(n)}}
    return blob(with_manifest(manifest, {"a": entry("U8", [nbytes], 0, nbytes)}), bytes(nbytes))


@pytest.mark.parametrize("reader", ["numpy", "keras", pytest.param("torch", marks=needs_torch)])
def test_many_copies_of_one_tensor_are_refused(tmp_path: Path, reader: str) -> None:
    import weightvault.numpy as wvn

    # 1 MiB stored, 300 copies: 300 MiB of arrays from a file of just over 1 MiB.
    path = _write(tmp_path, _copies(300, 1 << 20))
    read: Callable[[Path], Any]
    if reader == "keras":
        wvk = pytest.importorskip("weightvault.keras")
        read = wvk.load_file
    else:
        read = wvn.load_file if reader == "numpy" else wvt.load_file  # type: ignore[union-attr]
    tracemalloc.start()
    try:
        with pytest.raises(weightvault.FormatError, match=r"would allocate"):
            read(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    # A few copies of a small tensor are what real files hold, and read as before.
    small = _write(tmp_path, _copies(3, 16), "small.safetensors")
    assert len(read(small)) == 4


@needs_torch
def test_alias_of_shared_storage_reads_in_torch(tmp_path: Path) -> None:
    """An alias may name internal view storage; torch.load_file raised KeyError."""
    assert wvt is not None
    internal = "__weightvault__.storage0"
    manifest = {"version": 1, "aliases": {"al": internal}}
    path = _write(
        tmp_path, blob(with_manifest(manifest, {internal: entry("U8", [4], 0, 4)}), b"abcd")
    )
    out = wvt.load_file(path)
    assert bytes(out["al"].numpy()) == b"abcd"


def test_surrogate_pairs_are_valid_names(tmp_path: Path) -> None:
    """Only lone surrogates are refused; an escaped pair is one character (U+1F600)."""
    import weightvault.numpy as wvn

    path = _write(
        tmp_path, blob(b'{"\\ud83d\\ude00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x")
    )
    assert list(wvn.load_file(path)) == ["\U0001f600"]


# ---------------------------------------------------------------------------------------
# A file truncated underneath a reader: FormatError or a report, never SIGBUS
# ---------------------------------------------------------------------------------------

_TRUNCATE = """
import sys, os
import numpy as np
import weightvault, weightvault.numpy as wvn
from weightvault.formats._registry import open_checkpoint

path, how = sys.argv[1], sys.argv[2]
arrays = {f"t{i}": np.full(1 << 18, i, np.float32) for i in range(4)}
wvn.save(arrays, path)

def shrink():
    os.truncate(path, 4096)

if how == "verify":
    calls = []
    def progress(n):
        calls.append(n)
        if len(calls) == 1:
            shrink()
    report = weightvault.verify(path, progress=progress)
    print("ok" if report.ok else "damaged", report.problems[:1])
    sys.exit(0)
ckpt = open_checkpoint(path)
shrink()
try:
    if how == "numpy":
        wvn.load_file(ckpt, verify=True)
    elif how == "numpy_noverify":
        wvn.load_file(ckpt)
    elif how == "numpy_load":
        wvn.load({k: np.zeros_like(v) for k, v in arrays.items()}, ckpt, verify=True)
    elif how == "torch":
        import weightvault.torch as wvt
        wvt.load_file(ckpt, verify=True)
    elif how == "torch_noverify":
        import weightvault.torch as wvt
        wvt.load_file(ckpt)
    elif how == "torch_load":
        import torch, weightvault.torch as wvt
        m = torch.nn.ParameterDict({k: torch.zeros(1 << 18) for k in arrays})
        wvt.load(m, ckpt, verify=True)
    elif how == "torch_load_views":
        # Views cannot be read straight into a parameter; they are copied from their base.
        import torch, weightvault.torch as wvt
        ckpt.close()
        base = torch.arange(1 << 20, dtype=torch.float32)
        wvt.save({"a": base[: 1 << 19], "b": base[1 << 18 :]}, path)
        ckpt = open_checkpoint(path)
        shrink()
        m = torch.nn.ParameterDict({"a": torch.zeros(1 << 19), "b": torch.zeros(3 << 18)})
        wvt.load(m, ckpt)
except weightvault.FormatError as e:
    print("FormatError", e)
"""


@pytest.mark.parametrize(
    "how",
    [
        "verify",
        "numpy",
        "numpy_noverify",
        "numpy_load",
        pytest.param("torch", marks=needs_torch),
        pytest.param("torch_noverify", marks=needs_torch),
        pytest.param("torch_load", marks=needs_torch),
        pytest.param("torch_load_views", marks=needs_torch),
    ],
)
def test_truncated_after_open_is_no_sigbus(tmp_path: Path, how: str) -> None:
    import subprocess
    import sys

    path = tmp_path / "shrinks.safetensors"
    result = subprocess.run(
        [sys.executable, "-c", _TRUNCATE, str(path), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # A SIGBUS shows as returncode -7 with no output.
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    if how == "verify":
        assert result.stdout.startswith("damaged"), result.stdout
        assert "the file ended before its bytes did" in result.stdout
    else:
        assert result.stdout.startswith("FormatError"), result.stdout
        assert str(path) in result.stdout


# ---------------------------------------------------------------------------------------
# The command line: one line and a documented exit code, never a traceback
# ---------------------------------------------------------------------------------------


def _hostile_files(tmp_path: Path) -> list[Path]:
    """Every crafted case above, fuzzed files and bombs, each written to its own file."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_fuzz_smoke import _valid_files, case

    valid = _valid_files()
    payloads = [data for data, _ in CASES.values()]
    payloads += [case(seed, valid) for seed in range(120)]
    payloads += [_stride0_view(2**28), _copies(300, 1 << 16), *valid]
    paths = []
    for i, data in enumerate(payloads):
        paths.append(_write(tmp_path, data, f"h{i}.safetensors"))
    return paths


def test_cli_never_raises_on_hostile_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from weightvault._cli.app import main

    files = _hostile_files(tmp_path)
    good = files[-1]
    out = tmp_path / "out.safetensors"
    codes: set[int] = set()
    for path in files:
        for argv in (
            ["inspect", str(path)],
            ["inspect", "--json", str(path)],
            ["verify", str(path)],
            ["diff", str(good), str(path)],
            ["convert", str(path), str(out)],
        ):
            code = main(argv)  # an exception escaping main would end the CLI in a traceback
            codes.add(code)
            err = capsys.readouterr().err
            # 5: read fine, but refused (a name reserved for weightvault cannot be converted).
            assert code in (0, 1, 3, 5), (argv, code, err)
            assert "Traceback" not in err and err.count("\n") <= 1, (argv, err)
            if code in (3, 5):
                assert err.startswith(f"weightvault {argv[0]}: "), err
    assert codes == {0, 1, 3, 5}


@pytest.mark.parametrize(
    "case", ["lone_surrogate_tensor_name", "stride0_diff", "truncated", "directory"]
)
def test_cli_subprocess_prints_no_traceback(tmp_path: Path, case: str) -> None:
    import subprocess
    import sys

    good = _write(tmp_path, blob(TWO, TWO_DATA), "good.safetensors")
    if case == "stride0_diff":
        a = _write(tmp_path, _stride0_view(2**28), "a.safetensors")
        b = _write(tmp_path, _stride0_view(2**28).replace(b"\x80?", b"\x00@"), "b.safetensors")
        argv, expected = ["diff", str(a), str(b)], 3
    elif case == "truncated":
        argv, expected = ["inspect", str(_write(tmp_path, blob(TWO, TWO_DATA)[:-3]))], 3
    elif case == "directory":
        argv, expected = ["diff", str(good), str(tmp_path)], 3
    else:
        argv, expected = ["inspect", str(_write(tmp_path, CASES[case][0]))], 3
    cli = [sys.executable, "-m", "weightvault"]
    result = subprocess.run([*cli, *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == expected, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"weightvault {argv[0]}:")


def test_cli_unexpected_error_is_one_line_exit_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug reached by some input still ends in one line; WEIGHTVAULT_DEBUG shows where."""
    from weightvault._cli import app as _cli

    def broken(path: object) -> None:
        raise KeyError("deep\ninside")

    monkeypatch.setattr(_cli, "inspect", broken)
    path = _write(tmp_path, blob(TWO, TWO_DATA))
    assert _cli.main(["inspect", str(path)]) == _cli.EXIT_UNEXPECTED == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("weightvault inspect: unexpected KeyError: 'deep\\ninside'")
    assert "WEIGHTVAULT_DEBUG=1" in err
    monkeypatch.setenv("WEIGHTVAULT_DEBUG", "1")
    assert _cli.main(["inspect", str(path)]) == 4
    assert "Traceback" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# Copy detection stays near-linear: many distinct tensors of one shape
# ---------------------------------------------------------------------------------------


def _counting_same_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from weightvault._file import sharing as _plan

    calls = [0]
    real = _plan.same_bytes

    def counted(a: Any, b: Any, chunk: int = 1 << 20) -> bool:
        calls[0] += 1
        return real(a, b, chunk)

    monkeypatch.setattr(_plan, "same_bytes", counted)
    return calls


@pytest.mark.parametrize("dedupe", [True, False])
def test_copy_detection_compares_only_lookalikes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dedupe: bool
) -> None:
    import numpy as np

    import weightvault.numpy as wvn

    calls = _counting_same_bytes(monkeypatch)
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.standard_normal((4, 4)).astype(np.float32) for i in range(2000)}
    # Real copies, and a large pair equal in every sampled slice but one byte elsewhere.
    arrays["copy_a"] = arrays["t7"].copy()
    arrays["copy_b"] = arrays["t1999"].copy()
    big = np.zeros(3 << 20, np.uint8)
    arrays["big"], arrays["big_twin"] = big, big.copy()
    arrays["big_twin"][1 << 20] = 1
    report = wvn.save(arrays, tmp_path / "many.safetensors", dedupe_copies=dedupe)
    # Kept copies (the default) are still found, as duplicates, for inspect's savings.
    found = report.copies if dedupe else report.duplicates
    assert found == {"copy_a": "t7", "copy_b": "t1999"}
    # One exact comparison per true copy and one for the sampled lookalike; all pairs of
    # 2,000 same-shape arrays would be about 2 million.
    assert calls[0] == 3, calls[0]


@needs_torch
def test_inspecting_a_pt_of_distinct_tensors_compares_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert torch is not None
    calls = _counting_same_bytes(monkeypatch)
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "distinct.pt"
    torch.save({f"t{i}": torch.randn(4, 4, generator=g) for i in range(500)}, path)
    info = weightvault.inspect(path)
    assert len(info.names) == 500 and not info.copies
    assert calls[0] == 0


@needs_alarm
def test_saving_4000_same_shape_arrays_is_fast(tmp_path: Path) -> None:
    import numpy as np

    import weightvault.numpy as wvn

    rng = np.random.default_rng(1)
    arrays = {f"t{i}": rng.standard_normal(16).astype(np.float32) for i in range(4000)}
    # Pairwise comparison took about a minute; near-linear work takes well under a second.
    with time_limit(20.0):
        wvn.save(arrays, tmp_path / "many.safetensors")


def test_convert_refuses_to_gather_a_copy_of_a_huge_stride0_view(tmp_path: Path) -> None:
    manifest = {"version": 1, "views": {"v": ["a", "F32", [2**26], [0], 0]}, "copies": {"c": "v"}}
    src = _write(tmp_path, blob(with_manifest(manifest, {"a": entry("F32", [1], 0, 4)}), bytes(4)))
    dst = tmp_path / "out.safetensors"
    tracemalloc.start()
    try:
        with pytest.raises(weightvault.FormatError, match=r"gathering 1 views would allocate"):
            weightvault.convert(src, dst)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20 and not dst.exists()
    report = weightvault.convert(src, dst, max_bytes=1 << 30, dedupe_copies=True)
    assert report.copies == {"c": "v"}


def test_verify_reports_what_a_reader_should_not_have_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify() reports, never raises, even if a reader leaks an error it should wrap."""
    import zlib

    from weightvault._file.checkpoint import SafetensorsFile
    from weightvault._tools import inspect as _inspect

    path = _write(tmp_path, blob(TWO, TWO_DATA))

    def leaky_open(p: object) -> None:
        raise zlib.error("invalid stored block lengths")

    with monkeypatch.context() as m:
        m.setattr(_inspect, "open_checkpoint", leaky_open)
        report = weightvault.verify(path)
    assert not report.ok
    assert report.problems == [f"{path}: unreadable (error: invalid stored block lengths)"]

    def leaky_check(self: object, stored: str) -> bool:
        raise MemoryError

    monkeypatch.setattr(SafetensorsFile, "check", leaky_check)
    report = weightvault.verify(path)
    assert not report.ok and "tensor 'a': unreadable (MemoryError" in report.problems[0]


def test_jax_load_file_refuses_a_tiny_file_that_describes_a_gigabyte(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    import numpy as np

    import weightvault.jax as wvj

    path = _write(tmp_path, _stride0_view(2**28))
    with pytest.raises(weightvault.FormatError, match=r"would allocate 1073741832 bytes") as e:
        wvj.load_file(path)
    assert str(path) in str(e.value) and "max_bytes" in str(e.value)
    small = _write(tmp_path, _stride0_view(2**20), "small.safetensors")
    with pytest.raises(weightvault.FormatError, match=r"more than the 1000-byte limit"):
        wvj.load_file(small, max_bytes=1000)
    out = wvj.load_file(small, max_bytes=8 << 20)
    assert out["v"].shape == (2**20,) and bool(np.all(np.asarray(out["v"]) == 1.0))
