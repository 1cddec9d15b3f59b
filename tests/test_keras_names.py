"""Pins the weight names of a small Keras model, and the error for changed internals.

weightvault.keras names weights with private Keras helpers (see _keras/internals.py). If
a Keras release changes them, these tests fail first, naming what moved, instead of
files that silently stop loading into Keras' own ``load_weights``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

keras = pytest.importorskip("keras")
h5py = pytest.importorskip("h5py")

import weightvault.keras as wvk  # noqa: E402
from weightvault._base.errors import KerasInternalsChanged  # noqa: E402
from weightvault._file.checkpoint import SafetensorsFile  # noqa: E402
from weightvault._keras.internals import SUPPORTED, _lookup  # noqa: E402
from weightvault._keras.walk import walk  # noqa: E402

#: (weightvault's name, the dataset path in Keras' own .weights.h5), in save order.
PINNED = [
    ("dense/kernel", "layers/dense/vars/0"),
    ("dense/bias", "layers/dense/vars/1"),
    ("batch_normalization/gamma", "layers/batch_normalization/vars/0"),
    ("batch_normalization/beta", "layers/batch_normalization/vars/1"),
    ("batch_normalization/moving_mean", "layers/batch_normalization/vars/2"),
    ("batch_normalization/moving_variance", "layers/batch_normalization/vars/3"),
    ("head/kernel", "layers/dense_1/vars/0"),
    ("head/bias", "layers/dense_1/vars/1"),
]


def _model() -> Any:
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(2, name="head"),
        ]
    )


def test_weight_names_are_pinned(tmp_path: Path) -> None:
    model = _model()
    wvk.save(model, tmp_path / "m.safetensors")
    with SafetensorsFile(tmp_path / "m.safetensors") as ckpt:
        assert ckpt.names == [ours for ours, _ in PINNED]
    assert [(v.name, v.keras_name) for v in walk(model)] == PINNED
    # The oracle: the paths Keras itself writes.
    model.save_weights(tmp_path / "m.weights.h5")
    paths: list[str] = []
    with h5py.File(tmp_path / "m.weights.h5") as f:
        f.visititems(lambda n, o: paths.append(n) if isinstance(o, h5py.Dataset) else None)
    assert sorted(paths) == sorted(theirs for _, theirs in PINNED)


def test_a_changed_internal_names_itself_and_the_supported_range() -> None:
    with pytest.raises(
        KerasInternalsChanged, match=r"changed keras\.src\.saving\.saving_lib\._gone"
    ):
        _lookup("keras.src.saving.saving_lib", "_gone")
    with pytest.raises(ImportError, match=SUPPORTED.replace(".", r"\.")):
        _lookup("keras.src.no_such_module", "x")
