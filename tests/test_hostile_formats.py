"""Hostile foreign files: nothing but the given file is read, nothing huge is allocated
from a tiny file, and every damaged file is a FormatError.

Each file is generated here: HDF5 with h5py (external storage, soft links, unknown
filters, unwritten datasets), npz and torch zips byte by byte (deflate bombs, unknown
compression methods, corrupt streams), MXNet with struct, pickles opcode by opcode. Peak
memory is measured in a fresh subprocess with ``resource.getrusage``, so what the
reader allocates (numpy, h5py, the C unpickler) is counted, not only Python objects.

The last part is a seeded mutation fuzz over every foreign reader.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import struct
import subprocess
import sys
import time
import tracemalloc
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import weightvault
import weightvault.numpy as wvn
from weightvault import FormatError
from weightvault._base.errors import InvalidLimitError
from weightvault._base.limits import ENV_VAR, DecodeBudget, default_limit
from weightvault.formats import open_any

h5py = pytest.importorskip("h5py")

try:
    import torch
except ImportError:  # pragma: no cover - the torch-free reader is still tested
    torch = None  # type: ignore[assignment]

needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")
MB = 1 << 20

# ---------------------------------------------------------------------------------------
# Writing files by hand
# ---------------------------------------------------------------------------------------


def npy(a: np.ndarray) -> bytes:
    """A version 1 ``.npy`` member, written the way numpy does."""
    head = repr({"descr": a.dtype.str, "fortran_order": False, "shape": a.shape})
    head += " " * ((64 - (10 + len(head) + 1) % 64) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(head)) + head.encode() + a.tobytes()


def raw_zip(members: list[tuple[str, int, bytes, int, int]]) -> bytes:
    """A zip of ``(name, method, stored bytes, crc, uncompressed size)`` members, as given.

    Nothing is compressed or checked here, so a member can claim any method, CRC or size.
    """
    local, central = b"", b""
    for name, method, data, crc, size in members:
        raw = name.encode()
        head = struct.pack("<IHHHHHIII", 0x04034B50, 20, 0, method, 0, 0, crc, len(data), size)
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            20,
            20,
            0,
            method,
            0,
            0,
            crc,
            len(data),
            size,
            len(raw),
            0,
            0,
            0,
            0,
            0,
            len(local),
        )
        central += raw
        local += head + struct.pack("<HH", len(raw), 0) + raw + data
    end = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(local), 0
    )
    return local + central + end


def deflated(name: str, payload: bytes) -> tuple[str, int, bytes, int, int]:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return (name, 8, c.compress(payload) + c.flush(), zlib.crc32(payload), len(payload))


V2 = 0xF993FAC9


def tshape(shape: tuple[int, ...]) -> bytes:
    return struct.pack(f"<i{len(shape)}q", len(shape), *shape)


def mx_dense(a: np.ndarray) -> bytes:
    return struct.pack("<Ii", V2, 0) + tshape(a.shape) + struct.pack("<iii", 1, 0, 0) + a.tobytes()


def mx_row_sparse(shape: tuple[int, ...], rows: list[int], values: np.ndarray) -> bytes:
    storage = (len(rows), *shape[1:])
    head = struct.pack("<Ii", V2, 1) + tshape(storage) + tshape(shape)
    head += struct.pack("<iii", 1, 0, 0) + struct.pack("<i", 6) + tshape((len(rows),))
    return head + values.astype(np.float32).tobytes() + np.array(rows, np.int64).tobytes()


def mx_csr(
    shape: tuple[int, int], indptr: list[int], cols: list[int], values: list[float]
) -> bytes:
    head = struct.pack("<Ii", V2, 2) + tshape((len(values),)) + tshape(shape)
    head += struct.pack("<iii", 1, 0, 0)
    head += (
        struct.pack("<i", 6) + tshape((len(indptr),)) + struct.pack("<i", 6) + tshape((len(cols),))
    )
    body = np.array(values, np.float32).tobytes()
    return head + body + np.array(indptr, np.int64).tobytes() + np.array(cols, np.int64).tobytes()


def mx_file(records: list[bytes], names: list[str]) -> bytes:
    out = struct.pack("<QQQ", 0x112, 0, len(records)) + b"".join(records)
    out += struct.pack("<Q", len(names))
    for n in names:
        out += struct.pack("<Q", len(n.encode())) + n.encode()
    return out


def _p(obj: object) -> bytes:
    """The opcodes of one small value, without PROTO and STOP."""
    return pickle.dumps(obj, protocol=2)[2:-1]


def tensor_ops(
    shape: tuple[int, ...], stride: tuple[int, ...], numel: int, key: str = "0"
) -> bytes:
    """The opcodes that push one ``_rebuild_tensor_v2`` float tensor, as torch.save writes."""
    storage = b"(" + _p("storage") + b"ctorch\nFloatStorage\n" + _p(key) + _p("cpu") + _p(numel)
    storage += b"tQ"  # TUPLE, BINPERSID
    args = b"(" + storage + _p(0) + _p(shape) + _p(stride) + b"\x89ccollections\nOrderedDict\n)R"
    return b"ctorch._utils\n_rebuild_tensor_v2\n" + args + b"tR"


def torch_zip(path: Path, pkl: bytes, storages: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", "3\n")
    return path


# ---------------------------------------------------------------------------------------
# Measuring a read in a fresh process
# ---------------------------------------------------------------------------------------

PROBE = r"""
import json, os, resource, sys
if sys.argv[2] == "no-torch":
    sys.modules["torch"] = None
import numpy, h5py, weightvault, weightvault.numpy as wvn
from weightvault.formats import open_any
import weightvault.formats.torch_pickle, weightvault.formats.keras_h5
import weightvault.formats.npz, weightvault.formats.mxnet
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {"error": None, "message": "", "format_error": False}
try:
    with open_any(sys.argv[1]) as ckpt:
        wvn.load_file(ckpt)
except Exception as e:
    out.update(error=type(e).__name__, message=str(e)[:2000],
               format_error=isinstance(e, weightvault.FormatError))
out["grew_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
print(json.dumps(out))
"""


def probe(path: Path, mode: str = "plain", env: dict[str, str] | None = None) -> dict[str, Any]:
    """Open and read ``path`` in a new interpreter; how it ended and how far RSS grew.

    ``mode`` is ``"no-torch"`` (the torch import blocked) or ``"plain"``. The growth is
    measured from after the imports, so it is the reader's.
    """
    src = str(Path(weightvault.__file__).parents[1])
    full_env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    full_env.update(PYTHONPATH=src, **(env or {}))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(path), mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def assert_refused_small(path: Path, mode: str = "plain", grew_mb: float = 120) -> str:
    """Assert reading ``path`` is a FormatError naming it, and RSS grew under ``grew_mb``.

    With PyTorch (``mode="torch"``) the read runs in this process, since importing torch
    in a fresh one takes longer than the whole check; the refusal still has to come
    before the allocation, because the budget is charged first.
    """
    if mode == "torch":
        with pytest.raises(FormatError) as info:
            _read_all(path)
        assert str(path) in str(info.value)
        return str(info.value)
    got = probe(path, mode)
    assert got["format_error"], got
    assert str(path) in got["message"]
    assert got["grew_mb"] < grew_mb, got
    return str(got["message"])


# ---------------------------------------------------------------------------------------
# HDF5: nothing but the given file is read
# ---------------------------------------------------------------------------------------


def test_h5_external_raw_storage_is_refused_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"PASSWORD" * 4)
    path = tmp_path / "m.weights.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset(
            "layers/x/vars/0", shape=(32,), dtype="u1", external=[(str(secret), 0, 32)]
        )
    with pytest.raises(FormatError, match="external file") as info:
        open_any(path)
    assert str(path) in str(info.value) and "layers/x/vars/0" in str(info.value)
    out = tmp_path / "out.safetensors"
    with pytest.raises(FormatError):
        weightvault.convert(path, out)
    assert not out.exists()


def test_h5_soft_link_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.weights.h5"
    with h5py.File(path, "w") as f:
        f["layers/x/vars/0"] = np.ones(3, np.float32)
        f["layers/y/vars/0"] = h5py.SoftLink("/layers/x/vars/0")
    with pytest.raises(FormatError, match="soft link") as info:
        open_any(path)
    assert "layers/y/vars/0" in str(info.value)


def test_h5_soft_link_through_an_external_link_never_opens_the_other_file(tmp_path: Path) -> None:
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["secret"] = np.arange(4, dtype=np.float32)
    path = tmp_path / "m.weights.h5"
    with h5py.File(path, "w") as f:
        f["a/w"] = h5py.SoftLink("/z/ext/secret")  # walked before "z" holds the external link
        f["z/ext"] = h5py.ExternalLink(str(other), "/")
    os.chmod(other, 0)  # were it opened, HDF5 would fail differently
    try:
        with pytest.raises(FormatError, match="soft link"):
            open_any(path)
    finally:
        os.chmod(other, 0o644)


def test_h5_unknown_filter_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "m.weights.h5"
    with h5py.File(path, "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((4,))
        # Optional, so HDF5 writes the chunks unfiltered; a reader would still look for
        # filter 307 as a plugin before reading them.
        dcpl.set_filter(307, h5py.h5z.FLAG_OPTIONAL, ())
        space = h5py.h5s.create_simple((8,))
        ds = h5py.h5d.create(f.id, b"w", h5py.h5t.NATIVE_FLOAT, space, dcpl=dcpl)
        h5py.Dataset(ds)[...] = np.arange(8, dtype=np.float32)
    with pytest.raises(FormatError, match="filter 307"):
        open_any(path)


def test_h5_known_filters_still_read(tmp_path: Path) -> None:
    path = tmp_path / "m.weights.h5"
    w = np.arange(64, dtype=np.float32).reshape(8, 8)
    with h5py.File(path, "w") as f:
        f.create_dataset("a", data=w, compression="gzip", shuffle=True, fletcher32=True)
        f.create_dataset("b", data=w, compression="lzf")
    got = wvn.load_file(path)
    assert np.array_equal(got["a"], w) and np.array_equal(got["b"], w)


def test_h5_virtual_dataset_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "src.h5"
    with h5py.File(other, "w") as f:
        f["d"] = np.arange(4, dtype=np.float32)
    path = tmp_path / "m.weights.h5"
    layout = h5py.VirtualLayout(shape=(4,), dtype="f4")
    layout[:] = h5py.VirtualSource(str(other), "d", shape=(4,))
    with h5py.File(path, "w") as f:
        f.create_virtual_dataset("w", layout)
    with pytest.raises(FormatError, match="virtual"):
        open_any(path)


def test_h5_names_that_are_not_utf8_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.weights.h5"
    with h5py.File(path, "w") as f:
        f[b"\xff"] = np.ones(2, np.float32)
    with pytest.raises(FormatError, match="not UTF-8"):
        open_any(path)


def test_h5_many_unwritten_datasets_stay_small(tmp_path: Path) -> None:
    path = tmp_path / "m.weights.h5"
    with h5py.File(path, "w") as f:
        for i in range(60):  # each reads as 4 MiB of fill value, 240 MiB in all
            f.create_dataset(f"d{i}", shape=(1 << 20,), dtype="f4", chunks=(1 << 14,))
    assert path.stat().st_size < 64 << 10
    message = assert_refused_small(path)
    assert ENV_VAR in message and "max_decoded_bytes" in message


def test_h5_hard_links_multiplying_names_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "m.weights.h5"
    with h5py.File(path, "w") as f:
        f["g0/w"] = np.ones(1, np.float32)
        for level in range(1, 22):  # 2**21 paths to one dataset through a DAG of groups
            g = f.create_group(f"g{level}")
            g["a"] = f[f"g{level - 1}"]
            g["b"] = f[f"g{level - 1}"]
    start = time.perf_counter()
    with pytest.raises(FormatError, match="also linked as"):
        open_any(path)
    assert time.perf_counter() - start < 5


# ---------------------------------------------------------------------------------------
# Tiny files that would allocate gigabytes
# ---------------------------------------------------------------------------------------


def test_npz_deflate_bomb_spread_over_members_stays_small(tmp_path: Path) -> None:
    member = deflated("w0.npy", npy(np.zeros(16 * MB, np.uint8)))  # 16 MiB from ~16 KiB
    members = [(f"w{i}.npy", *member[1:]) for i in range(24)]  # 384 MiB in all
    path = tmp_path / "bomb.npz"
    path.write_bytes(raw_zip(members))
    assert path.stat().st_size < 1 * MB
    message = assert_refused_small(path)
    assert "inflated" in message


def test_mxnet_many_row_sparse_arrays_stay_small(tmp_path: Path) -> None:
    one = mx_row_sparse((1 << 22, 1), [0], np.ones((1, 1)))  # 16 MiB dense each
    path = tmp_path / "sparse.params"
    path.write_bytes(mx_file([one] * 24, [f"w{i}" for i in range(24)]))
    assert path.stat().st_size < 8 << 10
    message = assert_refused_small(path)
    assert "row_sparse" in message and "w" in message


def test_raising_the_limit_reads_the_trusted_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = mx_row_sparse((1 << 20, 1), [3], np.full((1, 1), 7.0))  # 4 MiB dense each
    path = tmp_path / "sparse.params"
    path.write_bytes(mx_file([one] * 3, ["a", "b", "c"]))
    with pytest.raises(FormatError, match="max_decoded_bytes"):
        open_any(path, max_decoded_bytes=8 * MB)
    with open_any(path, max_decoded_bytes=16 * MB) as ckpt:
        assert wvn.load_file(ckpt)["b"][3, 0] == 7.0
    monkeypatch.setenv(ENV_VAR, str(8 * MB))
    with pytest.raises(FormatError, match=ENV_VAR):
        open_any(path)
    monkeypatch.setenv(ENV_VAR, "lots")
    with pytest.raises(InvalidLimitError, match=ENV_VAR):
        open_any(path)
    with pytest.raises(InvalidLimitError):
        open_any(path, max_decoded_bytes=-1)


def test_default_limit_is_ratio_plus_slack_capped() -> None:
    assert default_limit(1000) == 16 * 1000 + (64 << 20)
    assert default_limit(1 << 40) == 32 << 30
    budget = DecodeBudget("f", 0, 10)
    budget.charge("array 'a'", 10)
    with pytest.raises(FormatError, match=r"f: array 'b' would decode 1 bytes, 11 in all"):
        budget.charge("array 'b'", 1)


@pytest.mark.parametrize("mode", ["torch", "no-torch"])
def test_stride_zero_pt_is_not_expanded(tmp_path: Path, mode: str) -> None:
    if mode == "torch" and torch is None:
        pytest.skip("PyTorch is not installed")
    pkl = b"\x80\x02}" + _p("w") + tensor_ops((1 << 26,), (0,), 1) + b"s."  # 256 MiB
    path = torch_zip(tmp_path / "s.pt", pkl, {"0": bytes(4)})
    assert path.stat().st_size < 2048
    message = assert_refused_small(path, mode)
    assert "'w'" in message and "not contiguous" in message


@pytest.mark.parametrize("mode", ["torch", "no-torch"])
def test_shared_dicts_cannot_multiply_names(tmp_path: Path, mode: str) -> None:
    if mode == "torch" and torch is None:
        pytest.skip("PyTorch is not installed")
    # D0 = {"w": tensor}; D(k) = {"a": D(k-1), "b": D(k-1)}: 2**24 names from ~700 bytes.
    pkl = b"\x80\x02}" + _p("w") + tensor_ops((1,), (1,), 1) + b"s"
    memo = 0
    pkl += b"q" + bytes([memo])
    for _ in range(24):
        pkl += b"}(" + _p("a") + b"h" + bytes([memo]) + _p("b") + b"h" + bytes([memo]) + b"u"
        memo += 1
        pkl += b"q" + bytes([memo])
    path = torch_zip(tmp_path / "fan.pt", pkl + b".", {"0": bytes(4)})
    start = time.perf_counter()
    assert_refused_small(path, mode, grew_mb=200)
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize("mode", ["torch", "no-torch"])
def test_huge_memo_index_is_refused_before_unpickling(tmp_path: Path, mode: str) -> None:
    if mode == "torch" and torch is None:
        pytest.skip("PyTorch is not installed")
    pkl = b"\x80\x02}r" + struct.pack("<I", 1 << 26) + b"."  # would size the memo at 1 GiB
    path = torch_zip(tmp_path / "memo.pt", pkl, {})
    message = assert_refused_small(path, mode)
    assert "memo slot" in message


# ---------------------------------------------------------------------------------------
# Library errors leaking from damaged files
# ---------------------------------------------------------------------------------------


def test_npz_unknown_compression_method_is_a_format_error(tmp_path: Path) -> None:
    data = npy(np.ones(4, np.float32))
    path = tmp_path / "m.npz"
    path.write_bytes(raw_zip([("w.npy", 99, data, zlib.crc32(data), len(data))]))
    with pytest.raises(FormatError, match="compression method 99"):
        open_any(path)


def test_npz_corrupt_deflate_stream_is_a_format_error(tmp_path: Path) -> None:
    name, method, stream, crc, size = deflated("w.npy", npy(np.arange(64, dtype=np.float32)))
    bad = b"\xff" + stream[1:]  # block type 3 does not exist: zlib.error
    path = tmp_path / "m.npz"
    path.write_bytes(raw_zip([(name, method, bad, crc, size)]))
    with pytest.raises(FormatError) as info:
        open_any(path)
    assert str(path) in str(info.value) and "'w'" in str(info.value)


def test_torch_zip_with_deflated_byteorder_bomb_is_not_inflated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkl = b"\x80\x02}" + _p("w") + tensor_ops((1,), (1,), 1) + b"s."
    order = deflated("archive/byteorder", b"little" + bytes(128 * MB))
    pkl_member = ("archive/data.pkl", 0, pkl, zlib.crc32(pkl), len(pkl))
    store = ("archive/data/0", 0, bytes(4), zlib.crc32(bytes(4)), 4)
    path = tmp_path / "o.pt"
    path.write_bytes(raw_zip([pkl_member, order, store]))
    monkeypatch.setitem(sys.modules, "torch", None)
    # Python's own allocations are what an inflated member costs, so tracemalloc sees it.
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="big-endian"):
            _read_all(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * MB, peak


def test_mxnet_csr_row_pointer_past_the_columns_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "csr.params"
    # Pointers 0, 5, 2: start and end are right, but row 0 claims columns 0..4 of 2.
    path.write_bytes(mx_file([mx_csr((2, 4), [0, 5, 2], [0, 1], [1.0, 2.0])], ["m"]))
    with pytest.raises(FormatError, match="decrease"):
        open_any(path)


def test_zero_size_arrays_with_absurd_dims_are_format_errors(tmp_path: Path) -> None:
    npy_path = tmp_path / "z.npy"
    header = repr({"descr": "<f4", "fortran_order": False, "shape": (0, 1 << 62, 1 << 62)})
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    npy_path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
    mx_path = tmp_path / "z.params"
    rec = struct.pack("<Ii", V2, 0) + tshape((0, 1 << 62, 1 << 62)) + struct.pack("<iii", 1, 0, 0)
    mx_path.write_bytes(mx_file([rec], ["z"]))
    for path in (npy_path, mx_path):
        with pytest.raises(FormatError, match="overflows 64 bits"), open_any(path) as ckpt:
            wvn.load_file(ckpt)


@pytest.mark.parametrize("mode", ["torch", "no-torch"])
def test_lone_surrogate_names_are_format_errors(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "torch" and torch is None:
        pytest.skip("PyTorch is not installed")
    if mode == "no-torch":
        monkeypatch.setitem(sys.modules, "torch", None)
    key = b"X\x03\x00\x00\x00\xed\xa0\x80"  # BINUNICODE of "\ud800" (pickle's surrogatepass)
    pkl = b"\x80\x02}" + key + tensor_ops((1,), (1,), 1) + b"s."
    path = torch_zip(tmp_path / "u.pt", pkl, {"0": bytes(4)})
    with pytest.raises(FormatError, match="not valid Unicode"):
        weightvault.convert(path, tmp_path / "u.safetensors")


# ---------------------------------------------------------------------------------------
# Mutation fuzz over every foreign reader
# ---------------------------------------------------------------------------------------


def _seed_files(tmp: Path) -> dict[str, bytes]:
    """One small valid file per format and layout, the fuzz's starting points."""
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    seeds: dict[str, bytes] = {}
    seeds["mxnet"] = mx_file(
        [
            mx_dense(w),
            mx_row_sparse((4, 2), [1, 3], np.ones((2, 2))),
            mx_csr((2, 3), [0, 1, 2], [2, 0], [5.0, 6.0]),
            mx_dense(w),
        ],
        ["arg:w", "arg:rs", "aux:csr", "arg:copy"],
    )
    buf = tmp / "seed.npz"
    np.savez(buf, a=w, b=w.astype(">f4"), c=np.ones(3, np.int8))
    seeds["npz"] = buf.read_bytes()
    np.savez_compressed(buf, a=w, b=np.zeros(5, np.int64))
    seeds["npz-deflate"] = buf.read_bytes()
    seeds["npy"] = npy(w)
    h5 = tmp / "seed.h5"
    with h5py.File(h5, "w", libver="latest") as f:  # the compact layout: a smaller seed
        f["layers/dense/vars/0"] = w
        f["layers/dense/vars/1"] = np.ones(4, np.float32)
        f.create_dataset("layers/conv/vars/0", data=w, compression="gzip", chunks=(1, 4))
    seeds["hdf5"] = h5.read_bytes()
    pkl = b"\x80\x02}(" + _p("w") + tensor_ops((3, 4), (4, 1), 12)
    pkl += (
        _p("t") + tensor_ops((4, 3), (1, 4), 12) + _p("b") + tensor_ops((2,), (1,), 2, "1") + b"u."
    )
    zpath = torch_zip(tmp / "seed.pt", pkl, {"0": w.tobytes(), "1": bytes(8)})
    seeds["torch"] = zpath.read_bytes()
    return seeds


def _mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3, 8))):
        kind = rng.random()
        at = rng.randrange(len(out)) if out else 0
        if kind < 0.55 and out:  # flip: a random byte, or one of the extremes
            out[at] = rng.choice((rng.randrange(256), 0, 0xFF, out[at] ^ (1 << rng.randrange(8))))
        elif kind < 0.7 and out:  # overwrite a little-endian word with a boundary value
            value = rng.choice((0, 1, 0x7F, 0xFF, 1 << 31, (1 << 32) - 1, 1 << 62, (1 << 64) - 1))
            word = value.to_bytes(8, "little")[: rng.choice((2, 4, 8))]
            out[at : at + len(word)] = word
        elif kind < 0.85:  # truncate
            del out[at:]
        elif kind < 0.95:  # insert
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
        elif out:  # delete a run
            del out[at : at + rng.randrange(1, 17)]
    return bytes(out)


def _put(path: Path, data: bytes) -> None:
    """Replace the file's bytes without O_TRUNC, which makes ext4 flush on close (~6 ms)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _read_all(path: Path) -> None:
    with open_any(path) as ckpt:
        wvn.load_file(ckpt)


def fuzz(tmp: Path, cases: int, seed: int = 9) -> tuple[int, int, list[str]]:
    """Mutate the seed files ``cases`` times; (read, refused, unexpected errors)."""
    rng = random.Random(seed)
    seeds = _seed_files(tmp)
    kinds = sorted(seeds)
    path = tmp / "case"
    read = refused = 0
    bad: list[str] = []
    for i in range(cases):
        kind = kinds[i % len(kinds)]
        _put(path, _mutate(rng, seeds[kind]))
        try:
            _read_all(path)
            read += 1
        except FormatError:
            refused += 1
        except Exception as e:  # anything else is a finding
            bad.append(f"case {i} ({kind}): {type(e).__name__}: {str(e)[:200]}")
    return read, refused, bad


#: Cases in the smoke run; with the torch reader imported, about 20 s on one core.
FUZZ_CASES = 6000


def test_mutation_fuzz_of_every_foreign_reader(tmp_path: Path) -> None:
    start = time.perf_counter()
    read, refused, bad = fuzz(tmp_path, FUZZ_CASES)
    elapsed = time.perf_counter() - start
    assert not bad, "\n".join(bad[:20])
    assert read + refused == FUZZ_CASES
    assert read > 0 and refused > 0
    print(f"fuzz: {FUZZ_CASES} cases, {read} read, {refused} FormatError, {elapsed:.1f} s")


def _main() -> None:  # pragma: no cover - the bigger one-off run, by hand
    import tempfile

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30000
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 2024
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        read, refused, bad = fuzz(Path(tmp), n, seed)
        print(
            f"{n} cases (seed {seed}): {read} read, {refused} FormatError, {len(bad)} other "
            f"in {time.perf_counter() - start:.0f} s"
        )
        for line in bad[:50]:
            print(line)


if __name__ == "__main__":  # pragma: no cover
    _main()
