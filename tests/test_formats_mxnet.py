"""MXNet ``.params``: real MXNet 1.9.1 files, every array layout, sparse, rules, hostile input.

The oracles are the ``.expected.npz`` files written beside each fixture by MXNet itself;
the layouts MXNet 1.9 no longer writes (V1, pre-V1, V3, sparse) are built byte by byte
from seed-systems.md §2, so each case exercises one field.
"""

from __future__ import annotations

import os
import re
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import weightvault
import weightvault.numpy as wvn
from weightvault import FormatError
from weightvault.formats import detect
from weightvault.formats._registry import open_checkpoint
from weightvault.rules import GLUON_TO_TORCH, MXNET_PREFIXES

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "mxnet"
PARAMS = sorted(FIXTURES.glob("*.params")) if FIXTURES.is_dir() else []
needs_fixtures = pytest.mark.skipif(not PARAMS, reason="shared/fixtures/mxnet is absent")

V1, V2, V3 = 0xF993FAC8, 0xF993FAC9, 0xF993FACA
CODES = {
    "float32": 0,
    "float64": 1,
    "float16": 2,
    "uint8": 3,
    "int32": 4,
    "int8": 5,
    "int64": 6,
    "bool": 7,
    "int16": 8,
    "uint16": 9,
    "uint32": 10,
    "uint64": 11,
}


# ---------------------------------------------------------------------------------------
# Writing .params by hand
# ---------------------------------------------------------------------------------------


def tshape(shape: tuple[int, ...]) -> bytes:
    return struct.pack(f"<i{len(shape)}q", len(shape), *shape)


def array(a: np.ndarray, magic: int = V2, code: int | None = None) -> bytes:
    """One dense array record in the V2/V3 (default) or V1/v0 (legacy) layout."""
    code = CODES[a.dtype.name] if code is None else code
    body = struct.pack("<iii", 1, 0, code) + np.ascontiguousarray(a).tobytes()
    if magic in (V2, V3):
        return struct.pack("<Ii", magic, 0) + tshape(a.shape) + body
    if magic == V1:
        return struct.pack("<I", V1) + tshape(a.shape) + body
    return struct.pack(f"<I{a.ndim}I", a.ndim, *a.shape) + body  # pre-V1: magic is ndim


def container(records: list[bytes], names: list[str] | None = None) -> bytes:
    out = struct.pack("<QQQ", 0x112, 0, len(records)) + b"".join(records)
    names = names or []
    out += struct.pack("<Q", len(names))
    for n in names:
        raw = n.encode()
        out += struct.pack("<Q", len(raw)) + raw
    return out


def params(path: Path, arrays: dict[str, np.ndarray], magic: int = V2) -> Path:
    path.write_bytes(container([array(a, magic) for a in arrays.values()], list(arrays)))
    return path


# ---------------------------------------------------------------------------------------
# Real MXNet files
# ---------------------------------------------------------------------------------------


@needs_fixtures
@pytest.mark.parametrize("path", PARAMS, ids=[p.name for p in PARAMS])
def test_every_fixture_reads_as_mxnet_wrote_it(path: Path) -> None:
    expected = np.load(path.with_name(path.name.replace(".params", ".expected.npz")))
    assert detect(path) == "mxnet"
    got = wvn.load_file(path)
    assert list(got) == list(expected.files)
    for name in expected.files:
        assert got[name].dtype == expected[name].dtype, name
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@needs_fixtures
def test_seed_000_four_copies_convert_to_the_deduplicated_size(tmp_path: Path) -> None:
    """Gluon's default save holds 4 copies; converted, it is the size of deduplicate=True."""
    default = FIXTURES / "shared_dense_default.params"
    dedup = FIXTURES / "shared_dense_dedup.params"
    out = tmp_path / "dense.safetensors"
    report = weightvault.convert(default, out, dedupe_copies=True)
    dedup_data = sum(
        a.nbytes for a in np.load(dedup.with_name(dedup.name[:-7] + ".expected.npz")).values()
    )
    assert report.stored_bytes == dedup_data == 16640
    assert len(report.copies) == 6 and report.logical_bytes == 4 * dedup_data
    # The same tensor bytes; only the JSON header (names, checksums) is added.
    assert out.stat().st_size <= dedup.stat().st_size + 1024
    assert default.stat().st_size > 3.8 * out.stat().st_size
    info = weightvault.inspect(out)
    assert info.names == [f"l{i}.{p}" for i in range(1, 5) for p in ("weight", "bias")]
    expected = np.load(default.with_name("shared_dense_default.expected.npz"))
    got = wvn.load_file(out)
    for name in info.names:
        np.testing.assert_array_equal(got[name], expected[name])


@needs_fixtures
def test_fixture_copies_are_found_by_content() -> None:
    with open_checkpoint(FIXTURES / "shared_dense_default.params") as ckpt:
        assert ckpt.entry("l1.weight").kind == "stored"
        assert {ckpt.entry(f"l{i}.weight").kind for i in (2, 3, 4)} == {"copy"}
        assert ckpt.size == 16640
    with open_checkpoint(FIXTURES / "shared_dense_dedup.params") as ckpt:
        assert [ckpt.entry(n).kind for n in ckpt.names] == ["stored", "stored"]


@needs_fixtures
def test_mobilenet_fixture_loads_into_torch_modules_with_gluon_rules() -> None:
    torch = pytest.importorskip("torch")
    import weightvault.torch as wv

    expected = np.load(FIXTURES / "mobilenet0.25_random.expected.npz")
    with open_checkpoint(FIXTURES / "mobilenet0.25_random.params") as ckpt:
        names = ckpt.names
    model = torch.nn.Module()
    features = torch.nn.Module()
    for name in names:
        parts = name.split(".")
        if parts[0] != "features" or parts[-1] != "weight":
            continue
        shape = expected[name].shape
        layer: torch.nn.Module = torch.nn.Conv2d(shape[1], shape[0], shape[2:], bias=False)
        layer.weight = torch.nn.Parameter(torch.empty(shape))
        features.add_module(parts[1], layer)
    for name in names:
        parts = name.split(".")
        if parts[-1] == "gamma":
            features.add_module(parts[1], torch.nn.BatchNorm2d(expected[name].shape[0]))
    model.add_module("features", features)
    model.add_module("output", torch.nn.Linear(256, 1000))
    report = wv.load(
        model, FIXTURES / "mobilenet0.25_random.params", rules=GLUON_TO_TORCH, strict=False
    )
    assert not report.unexpected and not report.mismatched
    assert all(m.endswith("num_batches_tracked") for m in report.missing)
    bn = features.get_submodule("1")
    assert isinstance(bn, torch.nn.BatchNorm2d)
    np.testing.assert_array_equal(bn.weight.detach().numpy(), expected["features.1.gamma"])
    np.testing.assert_array_equal(bn.running_var.numpy(), expected["features.1.running_var"])


# ---------------------------------------------------------------------------------------
# Every layout and dtype
# ---------------------------------------------------------------------------------------


def test_every_dtype_code_in_every_dense_layout(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        name: (rng.standard_normal((2, 3)) * 50).astype(name) for name in CODES if name != "bool"
    }
    arrays["bool"] = rng.standard_normal((2, 3)) > 0
    for magic in (V2, V3, V1, 0):
        path = params(tmp_path / f"{magic}.params", arrays, magic)
        got = wvn.load_file(path)
        assert list(got) == list(arrays)
        for name, a in arrays.items():
            assert got[name].dtype == a.dtype and got[name].shape == a.shape
            np.testing.assert_array_equal(got[name], a)


def test_bfloat16_comes_back_as_ml_dtypes(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16)
    record = array(values.view(np.uint16), V2, code=12)
    path = tmp_path / "bf16.params"
    path.write_bytes(container([record], ["emb"]))
    got = wvn.load_file(path)["emb"]
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.astype(np.float32), [1.5, -2.0, 3.25])


def test_numpy_mode_scalars_and_zero_size_shapes(tmp_path: Path) -> None:
    scalar = np.array(7.5, dtype=np.float32)
    empty = np.zeros((0, 4), dtype=np.float32)
    also_empty = np.zeros((3, 0), dtype=np.int64)
    path = tmp_path / "np.params"
    path.write_bytes(
        container([array(scalar, V3), array(empty, V3), array(also_empty, V2)], ["s", "e", "z"])
    )
    got = wvn.load_file(path)
    assert got["s"].shape == () and got["s"] == 7.5
    assert got["e"].shape == (0, 4) and got["z"].shape == (3, 0) and got["z"].dtype == np.int64


def test_list_files_name_arrays_like_savez(tmp_path: Path) -> None:
    path = tmp_path / "list.params"
    path.write_bytes(container([array(np.ones(2, np.float32)), array(np.arange(3))]))
    assert list(wvn.load_file(path)) == ["arr_0", "arr_1"]


def test_prefixes_are_kept_and_the_rule_set_strips_them(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import weightvault.torch as wv

    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones(3, np.float32)
    path = params(tmp_path / "export.params", {"arg:fc.weight": w, "aux:fc.bias": b})
    assert list(wvn.load_file(path)) == ["arg:fc.weight", "aux:fc.bias"]
    model = torch.nn.Sequential()
    model.add_module("fc", torch.nn.Linear(4, 3))
    report = wv.load(model, path, rules=MXNET_PREFIXES)
    assert report.ok and report.renamed == [
        ("arg:fc.weight", "fc.weight"),
        ("aux:fc.bias", "fc.bias"),
    ]
    np.testing.assert_array_equal(model.fc.weight.detach().numpy(), w)


def test_gluon_dense_conv_and_batchnorm_load_into_pytorch_modules(tmp_path: Path) -> None:
    """GLUON_TO_TORCH maps gamma/beta to weight/bias; Dense, Conv and running stats agree."""
    torch = pytest.importorskip("torch")
    import weightvault.torch as wv

    rng = np.random.default_rng(1)
    gluon = {
        "dense.weight": rng.standard_normal((5, 4)).astype(np.float32),
        "dense.bias": rng.standard_normal(5).astype(np.float32),
        "conv.weight": rng.standard_normal((6, 3, 3, 3)).astype(np.float32),
        "conv.bias": rng.standard_normal(6).astype(np.float32),
        "bn.gamma": rng.standard_normal(6).astype(np.float32),
        "bn.beta": rng.standard_normal(6).astype(np.float32),
        "bn.running_mean": rng.standard_normal(6).astype(np.float32),
        "bn.running_var": rng.random(6).astype(np.float32),
    }
    path = params(tmp_path / "gluon.params", gluon)
    model = torch.nn.Module()
    model.dense = torch.nn.Linear(4, 5)
    model.conv = torch.nn.Conv2d(3, 6, 3)
    model.bn = torch.nn.BatchNorm2d(6)
    report = wv.load(model, path, rules=GLUON_TO_TORCH, strict=False)
    # PyTorch's BatchNorm counts batches; Gluon has no such buffer.
    assert report.missing == ["bn.num_batches_tracked"] and not report.unexpected
    assert ("bn.gamma", "bn.weight") in report.renamed and ("bn.beta", "bn.bias") in report.renamed
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for name, value in gluon.items():
        torch_name = name.replace("gamma", "weight").replace("beta", "bias")
        np.testing.assert_array_equal(state[torch_name], value, err_msg=name)


def test_gluon_rules_also_take_prefixed_names() -> None:
    from weightvault.rules import rename

    assert rename(GLUON_TO_TORCH, "aux:bn.running_var") == "bn.running_var"
    assert rename(GLUON_TO_TORCH, "arg:bn.gamma") == "bn.weight"
    assert rename(GLUON_TO_TORCH, "rnn.l0_i2h_weight") == "rnn.weight_ih_l0"
    assert rename(GLUON_TO_TORCH, "fc.weight") == "fc.weight"


# ---------------------------------------------------------------------------------------
# Sparse arrays are densified
# ---------------------------------------------------------------------------------------


def row_sparse(shape: tuple[int, ...], rows: list[int], values: np.ndarray) -> bytes:
    head = struct.pack("<Ii", V2, 1) + tshape(values.shape) + tshape(shape)
    head += struct.pack("<iii", 1, 0, 0) + struct.pack("<i", 6) + tshape((len(rows),))
    return head + values.astype(np.float32).tobytes() + np.array(rows, np.int64).tobytes()


def csr(shape: tuple[int, int], indptr: list[int], cols: list[int], values: list[float]) -> bytes:
    head = struct.pack("<Ii", V2, 2) + tshape((len(values),)) + tshape(shape)
    head += struct.pack("<iii", 1, 0, 0)
    head += (
        struct.pack("<i", 6) + tshape((len(indptr),)) + struct.pack("<i", 6) + tshape((len(cols),))
    )
    data = np.array(values, np.float32).tobytes()
    return head + data + np.array(indptr, np.int64).tobytes() + np.array(cols, np.int64).tobytes()


def test_row_sparse_and_csr_are_densified(tmp_path: Path) -> None:
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = tmp_path / "sparse.params"
    path.write_bytes(
        container(
            [row_sparse((4, 3), [1, 3], values), csr((2, 3), [0, 1, 3], [2, 0, 1], [5, 6, 7])],
            ["emb", "m"],
        )
    )
    got = wvn.load_file(path)
    dense = np.zeros((4, 3), np.float32)
    dense[[1, 3]] = values
    np.testing.assert_array_equal(got["emb"], dense)
    np.testing.assert_array_equal(got["m"], [[0, 0, 5], [6, 7, 0]])


@pytest.mark.parametrize(
    "record",
    [
        row_sparse((4, 3), [1, 9], np.ones((2, 3))),
        csr((2, 3), [0, 1, 3], [2, 0, 5], [5, 6, 7]),
        csr((2, 3), [0, 2, 1], [2, 0, 1], [5, 6, 7]),
        row_sparse((1 << 40, 3), [1], np.ones((1, 3))),
    ],
    ids=["row-out-of-range", "col-out-of-range", "indptr-decreases", "absurd-dense-size"],
)
def test_bad_sparse_arrays_are_refused_naming_them(tmp_path: Path, record: bytes) -> None:
    path = tmp_path / "bad.params"
    path.write_bytes(container([record], ["embedding.weight"]))
    with pytest.raises(FormatError, match=r"sparse.*'embedding\.weight'"):
        wvn.load_file(path)


def test_none_arrays_are_refused_naming_them(tmp_path: Path) -> None:
    none = struct.pack("<Ii", V2, 0) + tshape(())
    path = tmp_path / "none.params"
    path.write_bytes(container([none], ["head.weight"]))
    with pytest.raises(FormatError, match=r"'head\.weight'.*none"):
        open_checkpoint(path)


# ---------------------------------------------------------------------------------------
# Hostile input
# ---------------------------------------------------------------------------------------


def _good() -> bytes:
    return container(
        [
            array(np.ones((2, 3), np.float32)),
            array(np.arange(4), V1),
            array(np.ones(2, np.int8), 0),
        ],
        ["a", "b", "c"],
    )


HEADER = struct.pack("<QQ", 0x112, 0)


def _patch(data: bytes, at: int, value: bytes) -> bytes:
    return data[:at] + value + data[at + len(value) :]


HOSTILE: dict[str, Callable[[], bytes]] = {
    "absurd-array-count": lambda: HEADER + struct.pack("<Q", 1 << 60) + _good()[24:],
    "absurd-ndim": lambda: _patch(_good(), 32, struct.pack("<i", 1 << 30)),
    "negative-ndim-v1": lambda: container([struct.pack("<Ii", V1, 1) + struct.pack("<q", -5)]),
    "absurd-dims": lambda: _patch(_good(), 36, struct.pack("<qq", 1 << 62, 1 << 62)),
    "unknown-array-magic": lambda: _patch(_good(), 24, struct.pack("<I", 0xDEADBEEF)),
    "unknown-list-magic": lambda: b"\x12\x01\x00\x00\x00\x00\x00\x00\x01" + _good()[9:],
    "unknown-dtype-code": lambda: container([array(np.ones(2, np.float32), code=99)]),
    "unknown-storage-type": lambda: _patch(_good(), 28, struct.pack("<i", 7)),
    "names-count-mismatch": lambda: container([array(np.ones(2, np.float32))], ["a", "b"]),
    "absurd-name-length": lambda: (
        container([array(np.ones(2, np.float32))])[:-8] + struct.pack("<QQ", 1, 1 << 62)
    ),
    "bad-utf8-name": lambda: container([array(np.ones(2, np.float32))], ["x"]).replace(
        b"\x01\x00\x00\x00\x00\x00\x00\x00x", b"\x01\x00\x00\x00\x00\x00\x00\x00\xff"
    ),
    "duplicate-names": lambda: container(
        [array(np.ones(2, np.float32)), array(np.ones(2, np.float32))], ["a", "a"]
    ),
    "trailing-bytes": lambda: _good() + b"\x00" * 9,
}


def _assert_fast_and_small(path: Path) -> FormatError:
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(FormatError) as info, open_checkpoint(path) as ckpt:
            wvn.load_file(ckpt)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.perf_counter() - start < 2.0
    assert peak < 16 << 20, peak
    assert str(path) in str(info.value)
    return info.value


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_params_raise_format_error_quickly(tmp_path: Path, case: str) -> None:
    path = tmp_path / f"{case}.params"
    path.write_bytes(HOSTILE[case]())
    _assert_fast_and_small(path)


def test_every_truncation_of_a_valid_file_is_a_format_error(tmp_path: Path) -> None:
    good = _good()
    path = tmp_path / "cut.params"
    for cut in range(16, len(good)):  # shorter than 16 bytes is not recognised as MXNet
        path.write_bytes(good[:cut])
        with pytest.raises(FormatError):
            open_checkpoint(path)
    path.write_bytes(good)
    assert list(wvn.load_file(path)) == ["a", "b", "c"]


def test_truncated_array_names_the_array_index_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "t.params"
    path.write_bytes(_good()[:60])
    with pytest.raises(FormatError, match=r"array #0 .*offset"):
        open_checkpoint(path)


def test_cli_converts_params_with_builtin_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from weightvault._cli.app import main

    path = params(
        tmp_path / "m.params", {"arg:w": np.ones(4, np.float32), "aux:v": np.ones(4, np.float32)}
    )
    out = tmp_path / "m.safetensors"
    assert main(["convert", str(path), str(out), "--rules", "MXNET_PREFIXES"]) == 0
    assert "1 copies kept under their own names" in capsys.readouterr().out
    assert weightvault.inspect(out).names == ["w", "v"]


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


@needs_fixtures
def test_the_mobilenet_fixture_loads_without_a_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    path = FIXTURES / "mobilenet0.25_random.params"
    expected = np.load(path.with_name("mobilenet0.25_random.expected.npz"))
    tried = _no_file_maps(monkeypatch)
    got = {n: np.zeros_like(expected[n]) for n in expected.files}
    wvn.load(got, path)
    for name in expected.files:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    assert not tried


def test_a_params_file_cut_after_it_was_opened_names_the_array(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(1)
    arrays = {
        "arg:w": rng.standard_normal((256, 1024)).astype(np.float32),
        "arg:v": rng.standard_normal((256, 1024)).astype(np.float32),  # a lookalike
        "aux:b": np.arange(16, dtype=np.float32),
    }
    path = params(tmp_path / "m.params", arrays)
    tried = _no_file_maps(monkeypatch)
    with open_checkpoint(path) as ckpt:
        # Cut short after it was opened (safe in this process: nothing is mapped).
        os.truncate(path, path.stat().st_size // 2)
        got = {n: np.zeros_like(a) for n, a in arrays.items()}
        with pytest.raises(FormatError, match=rf"{re.escape(str(path))}: tensor 'arg:v'"):
            wvn.load(got, ckpt)
        assert not any(a.any() for a in got.values()), "the load changed the arrays"
        np.testing.assert_array_equal(
            np.frombuffer(ckpt.raw("arg:w"), np.float32).reshape(256, 1024), arrays["arg:w"]
        )
        with pytest.raises(FormatError, match=rf"{re.escape(str(path))}: tensor 'aux:b'"):
            ckpt.raw("aux:b")
    assert not tried
