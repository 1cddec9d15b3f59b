"""Hostile input for the reader: every malformed file is a FormatError, raised quickly.

Files are crafted by hand, byte by byte (``_hostile_files.py``), so each case exercises
exactly one check. The readers under test are ``open_checkpoint``, ``weightvault.inspect``,
``weightvault.verify`` (which reports instead of raising) and, when PyTorch is installed,
``load_file``. Damaged files, sizes and the command line have their own modules:
``test_hostile_damage.py``, ``test_hostile_limits.py`` and ``test_hostile_cli.py``.
"""

from __future__ import annotations

import re
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import weightvault
from _hostile_files import (
    TWO,
    TWO_DATA,
    _write,
    blob,
    entry,
    needs_alarm,
    needs_torch,
    time_limit,
    with_manifest,
    wvt,
)
from weightvault.formats._registry import open_checkpoint


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
        blob(with_manifest({"version": 3}, TWO), TWO_DATA),
        r"manifest version '3' is not supported.*upgrade weightvault",
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


def test_surrogate_pairs_are_valid_names(tmp_path: Path) -> None:
    """Only lone surrogates are refused; an escaped pair is one character (U+1F600)."""
    import weightvault.numpy as wvn

    path = _write(
        tmp_path, blob(b'{"\\ud83d\\ude00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x")
    )
    assert list(wvn.load_file(path)) == ["\U0001f600"]


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
