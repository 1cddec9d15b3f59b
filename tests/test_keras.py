"""weightvault.keras: shared variables stored once, renamed and subset loads, freezing.

Runs on whatever ``KERAS_BACKEND`` says (tests/conftest.py defaults it to ``torch``).
Models are small and built per test; Keras itself is imported once per module.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
h5py = pytest.importorskip("h5py")

import weightvault  # noqa: E402
import weightvault.keras as wvk  # noqa: E402
from weightvault._file.checkpoint import MemoryCheckpoint  # noqa: E402
from weightvault._load.transforms import Permute, parse, resolve  # noqa: E402

layers = keras.layers
KERNEL = 256


class Tied(layers.Layer):
    """A layer that uses a kernel it is given: how Keras users share one variable."""

    def __init__(self, kernel: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.kernel = kernel

    def call(self, x: Any) -> Any:
        return keras.ops.tanh(keras.ops.matmul(x, self.kernel))


def np_(x: Any) -> Any:
    return keras.ops.convert_to_numpy(x)


def seed_model(shared: bool, seed: int = 0) -> Any:
    """Seed 003: four layers over one kernel (or four separate kernels)."""
    rng = np.random.default_rng(seed)

    def var() -> Any:
        k = rng.standard_normal((KERNEL, KERNEL)).astype("float32") / 16
        return keras.Variable(k, name="kernel")

    kernels = [var()] * 4 if shared else [var() for _ in range(4)]
    inp = keras.Input((KERNEL,))
    x = inp
    for k in kernels:
        x = Tied(k)(x)
    return keras.Model(inp, x)


def set_random(model: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for v in model.variables:
        if "float" in str(v.dtype):
            v.assign(rng.standard_normal(tuple(v.shape)).astype(str(v.dtype)) * 0.1)


def functional(seed: int = 0) -> Any:
    """A functional model with a nested Sequential sub-model, BatchNorm and dropout."""
    inner = keras.Sequential(
        [layers.Dense(16, activation="relu"), layers.BatchNormalization()], name="inner"
    )
    inp = keras.Input((8,))
    x = layers.Dense(12, name="stem")(inp)
    x = inner(x)
    x = layers.Dropout(0.1)(x)
    out = layers.Dense(3, name="head")(x)
    model = keras.Model(inp, out)
    set_random(model, seed)
    return model


X = np.random.default_rng(7).standard_normal((5, 8)).astype("float32")


@pytest.fixture
def count_assigns(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Counts ``Variable.assign`` calls per variable."""
    counts: dict[int, int] = {}
    cls = type(keras.Variable(0.0))
    real = cls.assign

    def assign(self: Any, value: Any) -> Any:
        counts[id(self)] = counts.get(id(self), 0) + 1
        return real(self, value)

    monkeypatch.setattr(cls, "assign", assign)
    return counts


# --- Seed 003 -----------------------------------------------------------------------


def test_seed_003_shared_kernel_stored_once_loaded_once(tmp_path, count_assigns):
    model = seed_model(shared=True)
    assert len(model.weights) == 1  # Keras dedups in memory...
    h5 = str(tmp_path / "keras.weights.h5")
    model.save_weights(h5)
    kernel_bytes = KERNEL * KERNEL * 4
    # ...but writes the kernel once per layer: four times on disk.
    assert os.path.getsize(h5) > 4 * kernel_bytes

    report = wvk.save(model, tmp_path / "m.safetensors")
    assert report.stored == ["tied/kernel"]
    assert report.aliases == {f"tied_{i}/kernel": "tied/kernel" for i in (1, 2, 3)}
    assert kernel_bytes <= report.file_bytes < 1.05 * kernel_bytes
    assert os.path.getsize(tmp_path / "m.safetensors") == report.file_bytes

    fresh = seed_model(shared=True, seed=1)
    loaded = wvk.load(fresh, tmp_path / "m.safetensors")
    assert loaded.ok and loaded.untied == []
    assert len(fresh.weights) == 1  # still one shared variable...
    assert count_assigns == {id(fresh.weights[0]): 1}  # ...assigned once
    x = np.random.default_rng(0).standard_normal((3, KERNEL)).astype("float32")
    np.testing.assert_array_equal(np_(fresh(x)), np_(model(x)))


def test_seed_003_separate_variables_are_all_filled_and_reported_untied(tmp_path):
    model = seed_model(shared=True)
    wvk.save(model, tmp_path / "m.safetensors")
    separate = seed_model(shared=False, seed=2)
    assert len(separate.weights) == 4
    report = wvk.load(separate, tmp_path / "m.safetensors")
    assert report.untied == [("tied/kernel", "tied_1/kernel", "tied_2/kernel", "tied_3/kernel")]
    for v in separate.weights:
        np.testing.assert_array_equal(np_(v), np_(model.weights[0]))
    x = np.random.default_rng(0).standard_normal((3, KERNEL)).astype("float32")
    np.testing.assert_array_equal(np_(separate(x)), np_(model(x)))


def test_tie_true_is_refused_before_anything_changes(tmp_path):
    wvk.save(seed_model(shared=True), tmp_path / "m.safetensors")
    separate = seed_model(shared=False, seed=2)
    before = [np_(v).copy() for v in separate.weights]
    with pytest.raises(weightvault.WeightvaultError, match="cannot make built layers share"):
        wvk.load(separate, tmp_path / "m.safetensors", tie=True)
    for b, v in zip(before, separate.weights, strict=True):
        np.testing.assert_array_equal(b, np_(v))


def test_load_file_returns_one_array_for_aliases(tmp_path):
    wvk.save(seed_model(shared=True), tmp_path / "m.safetensors")
    arrays = wvk.load_file(tmp_path / "m.safetensors")
    assert list(arrays) == ["tied/kernel", "tied_1/kernel", "tied_2/kernel", "tied_3/kernel"]
    assert arrays["tied_3/kernel"] is arrays["tied/kernel"]


# --- Functional round trip: nested model, BatchNorm, frozen layer ------------------


def test_functional_round_trip_with_frozen_layer(tmp_path):
    model = functional(seed=0)
    assert wvk.freeze(model, "stem") == ["stem/kernel", "stem/bias"]
    assert model.get_layer("stem").trainable is False
    report = wvk.save(model, tmp_path / "f.safetensors")
    assert report.frozen == ["stem/kernel", "stem/bias"]
    names = [
        "stem/kernel",
        "stem/bias",
        "inner/dense/kernel",
        "inner/dense/bias",
        "inner/batch_normalization/gamma",
        "inner/batch_normalization/beta",
        "inner/batch_normalization/moving_mean",
        "inner/batch_normalization/moving_variance",
        "head/kernel",
        "head/bias",
    ]
    assert wvk.load_file(tmp_path / "f.safetensors").keys() == set(names)

    fresh = functional(seed=1)
    assert not np.allclose(np_(fresh(X)), np_(model(X)))
    loaded = wvk.load(fresh, tmp_path / "f.safetensors", restore_frozen=True)
    assert loaded.ok and sorted(loaded.loaded) == sorted(names)
    assert loaded.frozen == ["stem/kernel", "stem/bias"]
    np.testing.assert_array_equal(np_(fresh(X)), np_(model(X)))
    assert fresh.get_layer("stem").trainable is False
    assert fresh.get_layer("head").trainable is True
    trainable_ids = {id(v) for v in wvk.trainable(fresh)}
    assert {id(v) for v in fresh.get_layer("stem").weights}.isdisjoint(trainable_ids)
    assert len(wvk.trainable(fresh)) == len(wvk.trainable(model)) == 6


def test_names_do_not_depend_on_keras_layer_counters(tmp_path):
    """Two builds of one model get different auto names (dense_3 vs dense_5) but ours match."""
    a, b = functional(0), functional(1)
    auto_a = a.get_layer("inner").layers[0].name
    auto_b = b.get_layer("inner").layers[0].name
    assert auto_a != auto_b  # Keras' counters moved on between the two builds
    wvk.save(a, tmp_path / "a.safetensors")
    assert wvk.load(b, tmp_path / "a.safetensors").ok


def h5_checkpoint(path: str) -> MemoryCheckpoint:
    """Keras' .weights.h5 read naively (every dataset stored), for tests of the mapping."""
    arrays: dict[str, tuple[str, tuple[int, ...], bytes]] = {}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            a = np.ascontiguousarray(obj[()])
            arrays[name] = (wvk.NAMES[str(a.dtype)], tuple(a.shape), a.tobytes())

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return MemoryCheckpoint(path, arrays)


def test_keras_weights_h5_imports_exactly(tmp_path):
    model = functional(seed=0)
    model.compile(optimizer="adam", loss="mse")
    model.fit(X, X[:, :3], epochs=1, verbose=0)  # the file then holds optimizer state too
    h5 = str(tmp_path / "f.weights.h5")
    model.save_weights(h5)
    with open(h5, "rb") as f:
        before = f.read()
    fresh = functional(seed=1)
    report = wvk.load(fresh, h5_checkpoint(h5))
    assert report.ok, report
    np.testing.assert_array_equal(np_(fresh(X)), np_(model(X)))
    for a, b in zip(model.weights, fresh.weights, strict=True):
        np.testing.assert_array_equal(np_(a), np_(b))
    with open(h5, "rb") as f:
        assert f.read() == before  # never modified


def test_keras_weights_h5_with_shared_kernel_loads_once(tmp_path, count_assigns):
    model = seed_model(shared=True)
    h5 = str(tmp_path / "s.weights.h5")
    model.save_weights(h5)
    fresh = seed_model(shared=True, seed=3)
    report = wvk.load(fresh, h5_checkpoint(h5))
    assert report.ok
    assert count_assigns == {id(fresh.weights[0]): 1}
    np.testing.assert_array_equal(np_(fresh.weights[0]), np_(model.weights[0]))


def test_keras_weights_h5_through_the_reader_and_convert(tmp_path):
    model = seed_model(shared=True)
    h5 = str(tmp_path / "s.weights.h5")
    model.save_weights(h5)
    fresh = seed_model(shared=True, seed=3)
    assert wvk.load(fresh, h5).ok
    np.testing.assert_array_equal(np_(fresh.weights[0]), np_(model.weights[0]))
    weightvault.convert(h5, str(tmp_path / "s.safetensors"), dedupe_copies=True)
    info = weightvault.inspect(str(tmp_path / "s.safetensors"))
    # Keras' four copies of the kernel are stored once.
    assert os.path.getsize(tmp_path / "s.safetensors") < 1.1 * KERNEL * KERNEL * 4, info


# --- Subclassed models, nesting, reuse ------------------------------------------------


class Encoder(keras.Model):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.proj = layers.Dense(6)
        self.blocks = [layers.Dense(6), layers.Dense(6)]
        self.norm = layers.BatchNormalization()
        self.again = self.proj  # one layer reachable under two attributes

    def call(self, x: Any) -> Any:
        x = self.proj(x)
        for b in self.blocks:
            x = b(x)
        return self.again(self.norm(x)[:, :6])


def encoder(seed: int) -> Any:
    m = Encoder()
    m(X[:, :6])
    set_random(m, seed)
    return m


def test_subclassed_model_names_are_attribute_paths(tmp_path):
    m = encoder(0)
    report = wvk.save(m, tmp_path / "e.safetensors")
    # Keras visits attributes in alphabetical order and each layer once, so the layer
    # held as both ``proj`` and ``again`` is named by ``again``.
    assert report.stored == [
        "again/kernel",
        "again/bias",
        "blocks/dense/kernel",
        "blocks/dense/bias",
        "blocks/dense_1/kernel",
        "blocks/dense_1/bias",
        "norm/gamma",
        "norm/beta",
        "norm/moving_mean",
        "norm/moving_variance",
    ]
    fresh = encoder(1)
    assert wvk.load(fresh, tmp_path / "e.safetensors").ok
    np.testing.assert_array_equal(np_(fresh(X[:, :6])), np_(m(X[:, :6])))


def test_sequential_without_optimizer_and_a_reused_layer(tmp_path):
    shared = layers.Dense(4, name="shared")
    inp = keras.Input((4,))
    out = shared(layers.Dense(4, name="mid")(shared(inp)))
    m = keras.Model(inp, out)
    set_random(m, 0)
    report = wvk.save(m, tmp_path / "r.safetensors")
    assert report.stored == ["shared/kernel", "shared/bias", "mid/kernel", "mid/bias"]
    seq = keras.Sequential([keras.Input((4,)), layers.Dense(4), layers.Dense(4)])
    set_random(seq, 1)
    assert wvk.save(seq, tmp_path / "s.safetensors").stored[:2] == ["dense/kernel", "dense/bias"]


# --- Renamed and subset loads, errors ------------------------------------------------


def test_renamed_and_subset_loads(tmp_path):
    model = functional(seed=0)
    wvk.save(model, tmp_path / "f.safetensors")
    renamed = keras.Sequential(
        [keras.Input((8,)), layers.Dense(12, name="first"), layers.Dense(3, name="last")]
    )
    with pytest.raises(weightvault.KeyMismatchError) as e:
        wvk.load(renamed, tmp_path / "f.safetensors")
    assert e.value.missing == ["first/kernel", "first/bias", "last/kernel", "last/bias"]
    report = wvk.load(
        renamed,
        tmp_path / "f.safetensors",
        rules=[("stem/*", "first/*"), ("head/*", "last/*")],
        strict=False,
    )
    assert report.missing == [] and "inner/dense/kernel" in report.unexpected
    assert ("stem/kernel", "first/kernel") in report.renamed
    np.testing.assert_array_equal(
        np_(renamed.layers[0].kernel), np_(model.get_layer("stem").kernel)
    )


def test_shape_mismatch_leaves_model_untouched(tmp_path):
    wvk.save(functional(0), tmp_path / "f.safetensors")
    other = keras.Sequential([keras.Input((8,)), layers.Dense(5, name="stem")])
    before = np_(other.layers[0].kernel).copy()
    with pytest.raises(weightvault.ShapeMismatchError, match=r"F32\[8, 12\] on disk"):
        wvk.load(other, tmp_path / "f.safetensors")
    report = wvk.load(other, tmp_path / "f.safetensors", strict=False)
    assert report.mismatched[0][0] == "stem/kernel"
    np.testing.assert_array_equal(np_(other.layers[0].kernel), before)


def test_unbuilt_model_is_refused(tmp_path):
    with pytest.raises(weightvault.WeightvaultError, match="not built"):
        wvk.save(keras.Sequential([layers.Dense(2)]), tmp_path / "x.safetensors")


def test_save_a_dict_of_variables(tmp_path):
    v = keras.Variable(np.ones((3, 2), "float32"), name="v")
    report = wvk.save({"a": v, "b": v, "c": np.zeros(2, "float16")}, tmp_path / "d.safetensors")
    assert report.aliases == {"b": "a"}
    out = wvk.load_file(tmp_path / "d.safetensors")
    assert out["c"].dtype == np.float16 and out["b"] is out["a"]


# --- Freezing ---------------------------------------------------------------------


def test_freeze_by_path_by_layer_name_and_unfreeze():
    m = functional(0)
    inner_dense = m.get_layer("inner").layers[0]
    # A Keras layer name (auto-generated here) works as well as a path.
    assert wvk.freeze(m, inner_dense.name) == ["inner/dense/kernel", "inner/dense/bias"]
    assert inner_dense.trainable is False
    assert wvk.freeze(m, "head/kernel") == ["head/kernel"]
    assert m.get_layer("head").trainable is True  # its bias still trains
    assert len(wvk.trainable(m)) == 8 - 3
    assert wvk.unfreeze(m, "inner/*") == [
        "inner/dense/kernel",
        "inner/dense/bias",
        "inner/batch_normalization/gamma",
        "inner/batch_normalization/beta",
    ]
    assert inner_dense.trainable is True and len(wvk.trainable(m)) == 7
    with pytest.raises(weightvault.RuleError, match="Did you mean 'head'"):
        wvk.freeze(m, "haed")


def test_freezing_a_shared_variable_freezes_every_name():
    m = seed_model(shared=True)
    assert wvk.freeze(m, "tied_2/kernel") == [f"tied{s}/kernel" for s in ("", "_1", "_2", "_3")]
    assert wvk.trainable(m) == []


def test_freeze_takes_effect_in_fit_after_recompile():
    """Keras builds the optimizer on trainable variables at compile(): recompile after freeze."""
    m = functional(0)
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    wvk.freeze(m, "stem")
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    stem = np_(m.get_layer("stem").kernel).copy()
    head = np_(m.get_layer("head").kernel).copy()
    m.fit(X, X[:, :3], epochs=2, verbose=0)
    np.testing.assert_array_equal(np_(m.get_layer("stem").kernel), stem)
    assert not np.array_equal(np_(m.get_layer("head").kernel), head)


def test_compiled_model_saves_no_optimizer_state(tmp_path):
    m = functional(0)
    m.compile(optimizer="adam", loss="mse")
    m.fit(X, X[:, :3], epochs=1, verbose=0)
    report = wvk.save(m, tmp_path / "c.safetensors")
    assert not any(n.startswith("optimizer") for n in report.stored)
    assert len(wvk.load_file(tmp_path / "c.safetensors")) == 10


# --- Transforms (framework-free part) ---------------------------------------------


def test_transform_spellings():
    assert parse("transpose") == Permute()
    assert parse("permute(2, 3, 1, 0)").shape((8, 3, 5, 5)) == (5, 5, 3, 8)
    assert parse((1, 0)).shape((2, 3)) == (3, 2)
    assert resolve({"*/kernel": "transpose"}, ["fc/bias"]) is None
    with pytest.raises(weightvault.RuleError, match="unknown transform"):
        parse("flip")
    with pytest.raises(weightvault.RuleError, match="not a permutation"):
        parse((0, 0))
    with pytest.raises(weightvault.ShapeMismatchError):
        parse((1, 0)).shape((1, 2, 3))
