"""numpy ``.npz``/``.npy`` (and MXNet 2's): numpy is the oracle; hostile archives refused."""

from __future__ import annotations

import os
import re
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


# ---------------------------------------------------------------------------------------
# Read when asked for, never mapped
# ---------------------------------------------------------------------------------------


def _no_file_maps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Fail any mapping of a file (anonymous memory is fine); the descriptors tried."""
    import mmap

    real, tried = mmap.mmap, []

    def mapping(fileno: int, *args: object, **kwargs: object) -> mmap.mmap:
        if fileno >= 0:
            tried.append(fileno)
            raise AssertionError("a foreign file was mapped")
        return real(fileno, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(mmap, "mmap", mapping)
    return tried


@pytest.mark.parametrize("compressed", [False, True], ids=["savez", "savez_compressed"])
def test_npz_is_read_without_a_mapping_and_a_cut_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compressed: bool
) -> None:
    rng = np.random.default_rng(3)
    arrays = {
        "w": rng.standard_normal((512, 1024)).astype(np.float32),  # 2 MiB: huge-page buffers
        "v": rng.standard_normal((512, 1024)).astype(np.float32),  # a lookalike: compared
        "t": np.arange(6, dtype=">i4").reshape(2, 3),
        "b": np.arange(4096, dtype=np.float32),
    }
    path = tmp_path / "w.npz"
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    tried = _no_file_maps(monkeypatch)
    with np.load(path) as oracle, open_checkpoint(path) as ckpt:
        got = {n: np.zeros_like(a, dtype=a.dtype.newbyteorder("=")) for n, a in arrays.items()}
        wvn.load(got, ckpt)
        for name in arrays:
            np.testing.assert_array_equal(got[name], oracle[name], err_msg=name)
        # Cut short after it was opened (safe in this process: nothing is mapped).
        cut = tmp_path / "cut.npz"
        cut.write_bytes(path.read_bytes())
        with open_checkpoint(cut) as short:
            os.truncate(cut, cut.stat().st_size // 2)
            fresh = {n: np.zeros_like(a) for n, a in got.items()}
            with pytest.raises(FormatError, match=rf"{re.escape(str(cut))}: tensor '[wvtb]'"):
                wvn.load(fresh, short)
            assert not any(a.any() for a in fresh.values()), "the load changed the arrays"
            # Past the load's own check, each read still names its array.
            with pytest.raises(FormatError, match=rf"{re.escape(str(cut))}: .*'[wvtb]'"):
                for name in short.stored:
                    short.raw(name)
    assert not tried


def test_a_corrupt_deflated_member_no_lookalike_reads_is_refused_at_open(tmp_path: Path) -> None:
    """Members the plan never compares are inflated at open too: the load never starts."""
    payload = npy("<f4", (64,), np.arange(64, dtype=np.float32).tobytes())
    path = tmp_path / "m.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("ok.npy", npy("<f4", (3,), np.ones(3, np.float32).tobytes()))
        z.writestr("w.npy", payload)
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("w.npy")
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    raw[start + info.compress_size - 6] ^= 0xFF  # the data after the header: a bad CRC
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=rf"{re.escape(str(path))}: array 'w'"):
        open_checkpoint(path)


def _peak_extra(load: object) -> int:
    """The peak RSS ``load()`` adds (the kernel's high-water mark, reset just before)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pytest.skip("needs glibc's malloc_trim")
    with open("/proc/self/status") as f:
        before = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    load()  # type: ignore[operator]
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) * 1024 - before


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
@pytest.mark.parametrize("compressed", [False, True], ids=["savez", "savez_compressed"])
def test_npz_load_holds_one_array_beside_the_arrays(tmp_path: Path, compressed: bool) -> None:
    # 24 MiB in 1 MiB arrays of one shape, so the plan compares every one with the others.
    rng = np.random.default_rng(5)
    arrays = {f"k{i}": rng.standard_normal(1 << 18).astype(np.float32) for i in range(24)}
    path = tmp_path / "m.npz"
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    # The oracle: numpy's own NpzFile, which reads one member at a time.
    expected = {n: np.zeros_like(a) for n, a in arrays.items()}

    def numpy_load() -> None:
        with np.load(path) as z:
            for n in expected:
                expected[n][...] = z[n]

    got = {n: np.zeros_like(a) for n, a in arrays.items()}
    numpy_extra = _peak_extra(numpy_load)
    extra = _peak_extra(lambda: wvn.load(got, path))
    # Reading the file whole (or every member inflated at open) held 24 MiB more.
    assert extra < numpy_extra + 2 * (1 << 20) + (3 << 20), (extra, numpy_extra)
    for n, a in arrays.items():
        np.testing.assert_array_equal(got[n], a, err_msg=n)
        np.testing.assert_array_equal(expected[n], a, err_msg=n)


def test_large_copies_are_found_byte_by_byte_without_reading_arrays_whole(
    tmp_path: Path,
) -> None:
    """Large arrays are fingerprinted from three samples read from the file; equal ones
    are copies, one equal in the samples but not elsewhere is not, stored or deflated."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal(1 << 19).astype(np.float32)  # 2 MiB: sampled
    c = a.copy()
    c[100_000] += 1  # the samples (first, middle, last 64 KiB) still equal a's
    arrays = {"a": a, "b": a.copy(), "c": c, "d": a.copy(), "e": c.copy()}
    path = tmp_path / "m.npz"
    with zipfile.ZipFile(path, "w") as z:
        for name, value in arrays.items():
            data = npy("<f4", value.shape, value.tobytes())
            method = zipfile.ZIP_DEFLATED if name in "de" else zipfile.ZIP_STORED
            z.writestr(f"{name}.npy", data, compress_type=method)
    with open_checkpoint(path) as ckpt:
        kinds = {n: (ckpt.entry(n).kind, ckpt.entry(n).stored) for n in arrays}
        assert kinds == {
            "a": ("stored", "a"),
            "b": ("copy", "a"),
            "c": ("stored", "c"),
            "d": ("copy", "a"),
            "e": ("copy", "c"),
        }, kinds
    got = wvn.load_file(path)
    with np.load(path) as oracle:
        for name in arrays:
            np.testing.assert_array_equal(got[name], oracle[name], err_msg=name)
