"""numpy ``.npz``/``.npy`` (and MXNet 2's): numpy is the oracle; hostile archives refused."""

from __future__ import annotations

import struct
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

import weightvault
import weightvault.numpy as wvn
from weightvault import FormatError
from weightvault.formats import detect
from weightvault.formats._registry import open_checkpoint


def npy(descr: str, shape: tuple[int, ...], data: bytes, fortran: bool = False) -> bytes:
    header = f"{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape!r}, }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode() + data


def archive(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.mark.parametrize("compressed", [False, True], ids=["savez", "savez_compressed"])
def test_npz_reads_as_numpy_does_and_finds_copies(tmp_path: Path, compressed: bool) -> None:
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    arrays = {
        "a": w,
        "b": w.copy(),
        "f": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
        "big": np.arange(5, dtype=">f8"),
        "s": np.array(2.5, np.float32),
        "z": np.zeros((0, 3), np.uint8),
        "bool": np.array([True, False]),
    }
    path = tmp_path / "w.npz"
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    assert detect(path) == "npz"
    got = wvn.load_file(path)
    assert list(got) == list(arrays)
    for name, value in arrays.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
        assert got[name].shape == value.shape
    with open_checkpoint(path) as ckpt:
        assert ckpt.entry("b").kind == "copy"


def test_single_npy_and_mxnet2_bfloat16(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    np.save(tmp_path / "one.npy", np.ones((2, 2), np.int8))
    assert detect(tmp_path / "one.npy") == "npy"
    assert wvn.load_file(tmp_path / "one.npy")["arr_0"].tolist() == [[1, 1], [1, 1]]
    bf = np.array([1.5, -3.0], dtype=ml_dtypes.bfloat16)
    # MXNet 2's npx.savez writes bfloat16 as '<b2', which numpy itself cannot parse.
    path = archive(tmp_path / "mx2.npz", {"0.weight.npy": npy("<b2", (2,), bf.tobytes())})
    got = wvn.load_file(path)["0.weight"]
    assert got.dtype == ml_dtypes.bfloat16 and got.tolist() == bf.tolist()


def test_mxnet2_sparse_folders_are_refused_naming_the_array(tmp_path: Path) -> None:
    members = {
        "emb/data.npy": npy("<f4", (1, 2), bytes(8)),
        "emb/indices.npy": npy("<i8", (1,), bytes(8)),
        "emb/shape.npy": npy("<i8", (2,), struct.pack("<qq", 4, 2)),
        "emb/format.npy": b"\x93NUMPYrow_sparse",
    }
    path = archive(tmp_path / "sparse.npz", members)
    with pytest.raises(FormatError, match=r"'emb' is sparse"):
        wvn.load_file(path)


def test_object_arrays_are_refused_without_unpickling(tmp_path: Path) -> None:
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(FormatError, match=r"'x' has dtype '\|O'"):
        open_checkpoint(path)


HOSTILE = {
    "lying-shape": {"a.npy": npy("<f4", (1 << 40, 1 << 20), bytes(16))},
    "short-data": {"a.npy": npy("<f8", (4,), bytes(8))},
    "bad-descr": {"a.npy": npy("<x9", (1,), bytes(9))},
    "negative-dim": {"a.npy": npy("<f4", (-1,), b"")},
    "huge-header": {"a.npy": b"\x93NUMPY\x02\x00" + struct.pack("<I", 1 << 31)},
    "code-in-header": {"a.npy": b"\x93NUMPY\x01\x00\x1a\x00__import__('os').getcwd()\n"},
    "bad-magic": {"a.npy": b"NOTNUMPY" + bytes(20)},
    "not-npy-member": {"a.npy": npy("<f4", (1,), bytes(4)), "evil.txt": b"x"},
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_npz_raise_format_error_quickly(tmp_path: Path, case: str) -> None:
    path = archive(tmp_path / f"{case}.npz", HOSTILE[case])
    start = time.perf_counter()
    with pytest.raises(FormatError) as info:
        wvn.load_file(path)
    assert time.perf_counter() - start < 2.0
    assert str(path) in str(info.value)


def test_truncated_npz_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "t.npz"
    np.savez(path, a=np.ones(100))
    data = path.read_bytes()
    for cut in (len(data) // 2, len(data) - 10):
        path.write_bytes(data[:cut])
        with pytest.raises(FormatError):
            open_checkpoint(path)


def test_npz_converts_with_copies_stored_once(tmp_path: Path) -> None:
    w = np.ones((64, 64), np.float32)
    np.savez(tmp_path / "w.npz", a=w, b=w.copy(), c=w.copy())
    report = weightvault.convert(tmp_path / "w.npz", tmp_path / "w.safetensors", dedupe_copies=True)
    assert report.stored_bytes == w.nbytes and len(report.copies) == 2
    got = wvn.load_file(tmp_path / "w.safetensors")
    assert list(got) == ["a", "b", "c"] and all((v == 1).all() for v in got.values())
