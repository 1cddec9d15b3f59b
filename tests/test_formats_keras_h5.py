"""Keras ``.weights.h5``: paths become names, hard links aliases, equal datasets duplicates.

Files are built with h5py in Keras 3's layout (``layers/<name>/vars/<i>``, see
seed-systems.md §3), and once with Keras itself when it is installed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

import weightvault
import weightvault.numpy as wvn
from weightvault import FormatError
from weightvault.formats import detect
from weightvault.formats._registry import open_checkpoint
from weightvault.formats.keras_h5 import open_keras_h5

h5py = pytest.importorskip("h5py")

RNG = np.random.default_rng(0)
KERNEL = RNG.standard_normal((4, 3)).astype(np.float32)


def keras_like(path: Path) -> dict[str, np.ndarray]:
    """A Functional model's file: a Dense layer sharing its kernel variable with another."""
    expected = {
        "layers/dense/vars/0": KERNEL,
        "layers/dense/vars/1": np.zeros(3, np.float32),
        # One Variable tracked by two layers is written twice: a duplicate dataset.
        "layers/dense_1/vars/0": KERNEL,
        "layers/dense_1/vars/1": np.ones(3, np.float32),
        "layers/batch_normalization/vars/0": RNG.standard_normal(3).astype(np.float32),
        "layers/batch_normalization/vars/1": RNG.standard_normal(3).astype(np.float32),
        "layers/batch_normalization/vars/2": RNG.standard_normal(3).astype(np.float32),
        "layers/batch_normalization/vars/3": RNG.random(3).astype(np.float32),
    }
    with h5py.File(path, "w") as f:
        for name, value in expected.items():
            f[name] = value
        f["layers/dense/vars"].attrs["name"] = "dense"
        f.create_group("layers/input_layer/vars")
        f.create_group("vars")
        # Keras 3.0 wrote a second tree of the same layers; a hard link is one object.
        f["_layer_checkpoint_dependencies/dense/vars/0"] = f["layers/dense/vars/0"]
        for i in range(12):  # numeric order: 2 before 10
            f[f"optimizer/vars/{i}"] = np.full(2, i, np.int64)
    expected["_layer_checkpoint_dependencies/dense/vars/0"] = KERNEL
    for i in range(12):
        expected[f"optimizer/vars/{i}"] = np.full(2, i, np.int64)
    return expected


def test_paths_become_names_with_aliases_and_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "model.weights.h5"
    expected = keras_like(path)
    assert detect(path) == "hdf5"
    with open_keras_h5(path) as ckpt:
        assert sorted(ckpt.names) == sorted(expected)
        opt = [n for n in ckpt.names if n.startswith("optimizer/")]
        assert opt == [f"optimizer/vars/{i}" for i in range(12)]
        dense = [n for n in ckpt.names if n.startswith("layers/dense/")]
        assert dense == ["layers/dense/vars/0", "layers/dense/vars/1"]
        assert ckpt.entry("layers/dense/vars/0").kind == "alias"  # of the Keras 3.0 path
        # Stored again in the file, so stored here too, and listed as equal to the first.
        assert ckpt.entry("layers/dense_1/vars/0").kind == "stored"
        equal = ckpt.manifest.duplicates["layers/dense_1/vars/0"]
        assert ckpt.entry(equal).group == ckpt.entry("layers/dense/vars/0").group
    got = wvn.load_file(path)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_convert_stores_the_shared_kernel_once(tmp_path: Path) -> None:
    path = tmp_path / "model.weights.h5"
    expected = keras_like(path)
    out = tmp_path / "model.safetensors"
    report = weightvault.convert(path, out, dedupe_copies=True)
    assert report.logical_bytes - report.stored_bytes >= 2 * KERNEL.nbytes
    info = weightvault.inspect(out)
    assert sorted(info.names) == sorted(expected)
    got = wvn.load_file(out)
    np.testing.assert_array_equal(got["layers/dense_1/vars/0"], KERNEL)


def test_dtypes_compression_and_byte_order(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = np.array([1.5, -2.0, 0.25], dtype=ml_dtypes.bfloat16)
    path = tmp_path / "d.weights.h5"
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("layers/emb/vars/0", data=bf)  # as Keras writes bfloat16
        ds.attrs["dtype"] = "bfloat16"
        f.create_dataset("layers/c/vars/0", data=np.arange(100.0), compression="gzip")
        f.create_dataset("layers/be/vars/0", data=np.arange(4, dtype=">i4"))
        f.create_dataset("layers/ch/vars/0", data=np.ones((8, 8), np.float16), chunks=(4, 4))
        f["layers/s/vars/0"] = np.float64(3.0)
        f["layers/b/vars/0"] = np.array([True, False])
    got = wvn.load_file(path)
    assert got["layers/emb/vars/0"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["layers/emb/vars/0"], bf)
    np.testing.assert_array_equal(got["layers/c/vars/0"], np.arange(100.0))
    np.testing.assert_array_equal(got["layers/be/vars/0"], np.arange(4, dtype=np.int32))
    assert got["layers/ch/vars/0"].dtype == np.float16 and got["layers/s/vars/0"] == 3.0
    assert got["layers/b/vars/0"].tolist() == [True, False]


def test_torch_adapter_loads_keras_weights_with_rules(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import weightvault.torch as wv

    path = tmp_path / "dense.weights.h5"
    with h5py.File(path, "w") as f:
        f["layers/dense/vars/0"] = KERNEL  # Keras kernels are (in, out)
        f["layers/dense/vars/1"] = np.arange(3, dtype=np.float32)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4))
    report = wv.load(
        model,
        path,
        rules=[("layers/dense/vars/0", "0.weight"), ("layers/dense/vars/1", None)],
        strict=False,
    )
    # (4, 3) on disk matches Linear(3, 4).weight's (4, 3); Keras' transpose is the user's job.
    assert report.loaded == ["0.weight"]
    np.testing.assert_array_equal(model[0].weight.detach().numpy(), KERNEL)


def test_real_keras_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KERAS_BACKEND", os.environ.get("KERAS_BACKEND", "torch"))
    keras = pytest.importorskip("keras")
    inp = keras.Input((4,))
    dense = keras.layers.Dense(3)
    out = keras.layers.BatchNormalization()(dense(inp))
    model = keras.Model(inp, out)
    path = tmp_path / "real.weights.h5"
    model.save_weights(path)
    got = wvn.load_file(path)
    assert np.array_equal(got["layers/dense/vars/0"], keras.ops.convert_to_numpy(dense.kernel))
    assert "layers/batch_normalization/vars/3" in got


# ---------------------------------------------------------------------------------------
# Hostile input
# ---------------------------------------------------------------------------------------


def _hostile(tmp_path: Path, case: str) -> Path:
    path = tmp_path / f"{case}.weights.h5"
    if case == "truncated":
        keras_like(path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3])
    elif case == "garbage-after-magic":
        path.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\xff" * 4000)
    elif case == "external-link":
        other = tmp_path / "other.h5"
        with h5py.File(other, "w") as f:
            f["secret"] = np.ones(3)
        with h5py.File(path, "w") as f:
            f["layers/x/vars/0"] = h5py.ExternalLink(str(other), "/secret")
    elif case == "string-dataset":
        with h5py.File(path, "w") as f:
            f["layers/x/vars/0"] = "not a tensor"
    elif case == "absurd-unwritten-shape":
        with h5py.File(path, "w") as f:
            f.create_dataset("layers/x/vars/0", shape=(1 << 40,), dtype="f4", chunks=(1024,))
    elif case == "dangling-soft-link":
        with h5py.File(path, "w") as f:
            f["layers/x/vars/0"] = h5py.SoftLink("/nowhere")
    return path


@pytest.mark.parametrize(
    "case",
    [
        "truncated",
        "garbage-after-magic",
        "external-link",
        "string-dataset",
        "absurd-unwritten-shape",
        "dangling-soft-link",
    ],
)
def test_hostile_h5_raise_format_error_quickly(tmp_path: Path, case: str) -> None:
    path = _hostile(tmp_path, case)
    start = time.perf_counter()
    with pytest.raises(FormatError) as info:
        open_checkpoint(path)
    assert time.perf_counter() - start < 2.0
    assert str(path) in str(info.value)
    if case == "external-link":
        assert "external link" in str(info.value)
