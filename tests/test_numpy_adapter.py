"""The numpy adapter: save, load_file and load, with ties, copies, views and ml_dtypes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import weightvault
import weightvault.numpy as wvn
from weightvault import KeyMismatchError, ShapeMismatchError


def test_verbs_are_pinned() -> None:
    assert wvn.__all__ == ["load", "load_file", "save"]


def test_save_stores_each_distinct_array_once(tmp_path: Path) -> None:
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    arrays = {"w": w, "tied": w, "copy": np.ones(5), "copy2": np.ones(5), "row": w[1], "t": w.T}
    report = wvn.save(arrays, tmp_path / "a.safetensors", dedupe_copies=True)
    assert report.aliases == {"tied": "w"} and report.copies == {"copy2": "copy"}
    assert sorted(report.views) == ["row", "t"]
    assert report.stored_bytes == w.nbytes + 40
    got = wvn.load_file(tmp_path / "a.safetensors")
    assert list(got) == list(arrays)
    for name, value in arrays.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    # Aliases and copies come back as separate arrays.
    assert got["tied"] is not got["w"] and not np.shares_memory(got["tied"], got["w"])


def test_every_dtype_round_trips(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    arrays = {
        dt: (np.arange(6) % 3).astype(dt)
        for dt in [
            "bool",
            "uint8",
            "int8",
            "int16",
            "uint16",
            "float16",
            "int32",
            "uint32",
            "float32",
            "int64",
            "uint64",
            "float64",
            "complex64",
        ]
    }
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        arrays[name] = np.array([0.5, 1.0, 2.0], dtype=getattr(ml_dtypes, name))
    arrays["big_endian"] = np.arange(3, dtype=">i4")
    arrays["scalar"] = np.array(3.0)
    arrays["empty"] = np.zeros((0, 2), np.float32)
    wvn.save(arrays, tmp_path / "d.safetensors")
    got = wvn.load_file(tmp_path / "d.safetensors")
    for name, value in arrays.items():
        assert got[name].dtype == value.dtype.newbyteorder("<") or got[name].dtype == value.dtype
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_plain_safetensors_files_read_too(tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    safetensors_numpy.save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "p.safetensors"))
    assert wvn.load_file(tmp_path / "p.safetensors")["a"].tolist() == [1, 1, 1]


def test_unsupported_dtypes_are_refused() -> None:
    with pytest.raises(TypeError, match="safetensors cannot store"):
        wvn.save({"s": np.array(["a"])}, "never-written.safetensors")


def test_load_fills_a_dict_in_place(tmp_path: Path) -> None:
    w = np.arange(4, dtype=np.float32)
    wvn.save({"enc.w": w, "enc.b": np.ones(2, np.float32)}, tmp_path / "a.safetensors")
    target = {"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}
    before = target["w"]
    report = wvn.load(target, tmp_path / "a.safetensors", rules=[("enc.*", "*")])
    assert report.ok and target["w"] is before
    np.testing.assert_array_equal(target["w"], w)
    with pytest.raises(KeyMismatchError):
        wvn.load({"x": np.zeros(4, np.float32)}, tmp_path / "a.safetensors")
    with pytest.raises(ShapeMismatchError):
        wvn.load(
            {"enc.w": np.zeros(3, np.float32), "enc.b": np.zeros(2, np.float32)},
            tmp_path / "a.safetensors",
        )
    cast = {"enc.w": np.zeros(4, np.float64), "enc.b": np.zeros(2, np.float64)}
    assert wvn.load(cast, tmp_path / "a.safetensors", cast=True).ok
    assert cast["enc.w"].tolist() == [0, 1, 2, 3]


def test_verify_checks_checksums(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    wvn.save({"w": np.ones(8, np.float32)}, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert wvn.load_file(path)["w"][-1] != 1
    with pytest.raises(weightvault.ChecksumError):
        wvn.load_file(path, verify=True)


def test_a_tie_filled_from_equal_views_loads_and_unequal_views_conflict(tmp_path: Path) -> None:
    """The plan compares views by their bits, so every adapter (numpy too) can tell equal
    views from different ones; before, numpy called any two views different."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    base = np.array([1, 2, 1, 2, 3, 4], dtype=ml_dtypes.bfloat16)
    path = tmp_path / "views.safetensors"
    report = wvn.save({"base": base, "a": base[0:2], "b": base[2:4], "c": base[4:6]}, path)
    assert sorted(report.views) == ["a", "b", "c"]
    tied = np.zeros(2, ml_dtypes.bfloat16)
    arrays = {"base": np.zeros(6, ml_dtypes.bfloat16), "a": tied, "b": tied}
    loaded = wvn.load(arrays, path, strict=False)
    assert sorted(loaded.loaded) == ["a", "b", "base"]
    np.testing.assert_array_equal(tied, base[0:2])
    before = arrays["base"].copy()
    with pytest.raises(weightvault.TieConflictError, match="a / c"):
        wvn.load({"base": arrays["base"], "a": tied, "c": tied}, path, strict=False)
    np.testing.assert_array_equal(arrays["base"], before)  # nothing was copied
