"""weightvault.keras in Keras' own files: ``.weights.h5`` and ``.keras``, each shared
variable stored once (HDF5 hard links), checked against Keras itself as the oracle.

Runs on whatever ``KERAS_BACKEND`` says; tests/test_keras_jax.py reruns it on JAX.
"""

from __future__ import annotations

import json
import os
import threading
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
h5py = pytest.importorskip("h5py")

import weightvault  # noqa: E402
import weightvault.keras as wvk  # noqa: E402
from weightvault._cli.app import main  # noqa: E402

layers = keras.layers
WIDTH = 64
KERNEL_BYTES = WIDTH * WIDTH * 4
X = np.random.default_rng(7).standard_normal((3, WIDTH)).astype("float32")


class Tied(layers.Layer):
    """A layer that uses a kernel it is given: how Keras users share one variable."""

    def __init__(self, kernel: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.kernel = kernel

    def call(self, x: Any) -> Any:
        return keras.ops.tanh(keras.ops.matmul(x, self.kernel))


@keras.saving.register_keras_serializable(package="wvtest")
class SharedKernel(keras.Model):
    """A subclassed model with ``get_config`` whose blocks share one kernel."""

    def __init__(self, width: int = WIDTH, depth: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.width, self.depth = width, depth
        self.kernel = self.add_weight(
            shape=(width, width), initializer="glorot_uniform", name="kernel"
        )
        self.blocks = [Tied(self.kernel) for _ in range(depth)]
        self.head = layers.Dense(4, name="head")

    def call(self, x: Any) -> Any:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "width": self.width, "depth": self.depth}


def np_(x: Any) -> Any:
    return np.asarray(keras.ops.convert_to_numpy(x))


def randomize(model: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    for v in model.weights:
        value = rng.standard_normal(tuple(v.shape)).astype(str(v.dtype)) * 0.1
        v.assign(np.abs(value) + 0.5 if "variance" in v.path else value)
    return model


def tied_functional(seed: int = 0) -> Any:
    """Three layers over one kernel, a BatchNorm, and two Dense layers with zero biases."""
    kernel = keras.Variable(np.zeros((WIDTH, WIDTH), "float32"), name="kernel")
    inp = keras.Input((WIDTH,))
    x = inp
    for _ in range(3):
        x = Tied(kernel)(x)
    x = layers.BatchNormalization()(x)
    x = layers.Dense(8, name="mid")(x)
    out = layers.Dense(8, name="head")(x)
    model = keras.Model(inp, out)
    randomize(model, seed)
    for name in ("mid", "head"):  # equal constant copies, as a fresh model has them
        model.get_layer(name).bias.assign(np.zeros(8, "float32"))
    return model


def sequential(seed: int = 0) -> Any:
    model = keras.Sequential(
        [keras.Input((WIDTH,)), layers.Dense(16, activation="relu"), layers.Dense(4)]
    )
    return randomize(model, seed)


def plain_functional(seed: int = 0) -> Any:
    inp = keras.Input((WIDTH,))
    x = layers.Dense(16, name="stem")(inp)
    x = layers.BatchNormalization(name="norm")(x)
    model = keras.Model(inp, layers.Dense(4, name="head")(x))
    return randomize(model, seed)


def subclassed(seed: int = 0) -> Any:
    model = SharedKernel()
    model(X)
    return randomize(model, seed)


def tree(path: Path) -> dict[str, Any]:
    """Every path of an HDF5 file, links included: groups' attributes, datasets' values."""
    out: dict[str, Any] = {}
    with h5py.File(path, "r") as f:

        def walk(group: Any, prefix: str) -> None:
            for key in group:
                obj = group[key]
                name = prefix + key
                if isinstance(obj, h5py.Group):
                    out[name + "/"] = dict(obj.attrs)
                    walk(obj, name + "/")
                else:
                    out[name] = np.array(obj)
                    if obj.attrs:
                        out[name + "/"] = dict(obj.attrs)  # bfloat16's marker

        walk(f, "")
    return out


def same_object(path: Path, names: list[str]) -> bool:
    """Whether every path names one HDF5 object (hard links), not equal copies."""
    with h5py.File(path, "r") as f:
        first = f[names[0]]
        return all(f[n] == first for n in names[1:])


# --- save_weights ----------------------------------------------------------------------


def test_save_weights_is_keras_layout_name_for_name_value_for_value(tmp_path: Path) -> None:
    model = tied_functional()
    model.compile(optimizer="adam", loss="mse")
    model.fit(X, np.zeros((3, 8), "float32"), verbose=0)  # optimizer state is in Keras' file
    theirs, ours = tmp_path / "keras.weights.h5", tmp_path / "ours.weights.h5"
    model.save_weights(theirs)
    report = wvk.save_weights(model, ours)

    expected, got = tree(theirs), tree(ours)
    assert list(got) == list(expected)  # every group and dataset, in the same order
    for name, value in expected.items():
        if name.endswith("/"):
            assert got[name] == value, name  # the groups' attributes (layer names)
        else:
            assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name
    assert any(n.startswith("optimizer/vars/") for n in got)

    tied = ["layers/tied/vars/0", "layers/tied_1/vars/0", "layers/tied_2/vars/0"]
    assert same_object(ours, tied) and not same_object(theirs, tied)
    assert report.aliases == {tied[1]: tied[0], tied[2]: tied[0]}
    assert report.file_bytes == os.path.getsize(ours)
    assert os.path.getsize(theirs) - os.path.getsize(ours) >= 2 * KERNEL_BYTES

    fresh = tied_functional(seed=1)
    fresh.load_weights(ours)  # Keras reads the hard links as its own datasets
    assert np.array_equal(np_(fresh(X)), np_(model(X)))


def test_bfloat16_and_computed_values_are_written_as_keras_writes_them(tmp_path: Path) -> None:
    model = keras.Sequential(
        [keras.Input((8,)), layers.Dense(4, dtype="bfloat16", name="a"), layers.Dense(2, name="b")]
    )
    model.get_layer("b").enable_lora(2)  # saves a merged kernel: a computed array
    theirs, ours = tmp_path / "keras.weights.h5", tmp_path / "ours.weights.h5"
    model.save_weights(theirs)
    wvk.save_weights(model, ours)
    expected, got = tree(theirs), tree(ours)
    assert list(got) == list(expected)
    for name, value in expected.items():
        if name.endswith("/"):
            assert got[name] == value, name
        else:
            assert got[name].dtype == value.dtype and got[name].tobytes() == value.tobytes()
    assert expected["layers/dense/vars/0/"] == {"dtype": "bfloat16"}


def test_weightvault_reads_the_links_as_one_variable_assigned_once(tmp_path: Path) -> None:
    model = tied_functional()
    wvk.save_weights(model, tmp_path / "m.weights.h5")
    info = weightvault.inspect(tmp_path / "m.weights.h5")
    assert info.aliases == {
        "layers/tied_1/vars/0": "layers/tied/vars/0",
        "layers/tied_2/vars/0": "layers/tied/vars/0",
    }
    fresh = tied_functional(seed=1)
    report = wvk.load(fresh, tmp_path / "m.weights.h5")
    assert report.ok and report.untied == []
    assert np.array_equal(np_(fresh(X)), np_(model(X)))


def test_frozen_set_and_metadata_are_attributes_keras_ignores(tmp_path: Path) -> None:
    model = plain_functional()
    wvk.freeze(model, "stem")
    path = tmp_path / "m.weights.h5"
    wvk.save_weights(model, path, metadata={"step": "7"})
    with h5py.File(path, "r") as f:
        doc = json.loads(f.attrs["weightvault"])
    assert doc["frozen"] == ["layers/dense/vars/0", "layers/dense/vars/1"]
    info = weightvault.inspect(path)
    assert info.frozen == doc["frozen"] and info.metadata == {"step": "7"}

    fresh = plain_functional(seed=1)
    fresh.load_weights(path)  # Keras: the attribute changes nothing
    assert np.array_equal(np_(fresh(X)), np_(model(X)))
    again = plain_functional(seed=2)
    report = wvk.load(again, path, restore_frozen=True)
    assert report.frozen == ["stem/kernel", "stem/bias"]
    assert not again.get_layer("stem").trainable


# --- save_model ----------------------------------------------------------------------------


@pytest.mark.parametrize("build", [plain_functional, sequential, subclassed])
def test_save_model_opens_in_keras_with_keras_config(tmp_path: Path, build: Any) -> None:
    model = build()
    theirs, ours = tmp_path / "keras.keras", tmp_path / "ours.keras"
    model.save(theirs)
    report = wvk.save_model(model, ours)
    assert report.file_bytes == os.path.getsize(ours)

    with zipfile.ZipFile(theirs) as a, zipfile.ZipFile(ours) as b:
        assert b.namelist() == a.namelist()
        assert b.read("config.json") == a.read("config.json")
        meta_a, meta_b = json.loads(a.read("metadata.json")), json.loads(b.read("metadata.json"))
        assert meta_b.keys() == meta_a.keys()
        assert meta_b["keras_version"] == meta_a["keras_version"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in b.infolist())

    loaded = keras.models.load_model(ours)
    assert type(loaded) is type(model)
    assert np.allclose(np_(loaded(X)), np_(model(X)), atol=1e-6)
    ours_too = wvk.load_model(ours, custom_objects={"SharedKernel": SharedKernel})
    assert np.allclose(np_(ours_too(X)), np_(model(X)), atol=1e-6)


def test_save_model_stores_the_shared_kernel_once(tmp_path: Path) -> None:
    model = subclassed()
    model.save(tmp_path / "keras.keras")
    report = wvk.save_model(model, tmp_path / "ours.keras")
    assert report.aliases == {f"blocks/tied{s}/vars/0": "vars/0" for s in ("", "_1", "_2")}
    saved = os.path.getsize(tmp_path / "keras.keras") - report.file_bytes
    assert saved >= 3 * KERNEL_BYTES
    fresh = SharedKernel()
    fresh(X)
    wvk.load(fresh, tmp_path / "ours.keras")
    assert np.array_equal(np_(fresh(X)), np_(model(X)))


# --- the guardrail -------------------------------------------------------------------------


def test_check_reports_every_shared_variable_and_what_keras_writes_again(tmp_path: Path) -> None:
    model = tied_functional()
    report = wvk.check(model)
    assert not report.ok and len(report.shared) == 1
    shared = report.shared[0]
    assert shared.names == ("tied/kernel", "tied_1/kernel", "tied_2/kernel")
    assert shared.paths == ("layers/tied/vars/0", "layers/tied_1/vars/0", "layers/tied_2/vars/0")
    assert (shared.dtype, shared.shape, shared.nbytes) == ("F32", (WIDTH, WIDTH), KERNEL_BYTES)
    assert report.extra_bytes == 2 * KERNEL_BYTES
    assert "written 3 times" in str(report)

    # The oracle: what Keras' own file holds beyond save_weights' is that many bytes.
    model.save_weights(tmp_path / "keras.weights.h5")
    wvk.save_weights(model, tmp_path / "ours.weights.h5")
    extra = os.path.getsize(tmp_path / "keras.weights.h5") - os.path.getsize(
        tmp_path / "ours.weights.h5"
    )
    assert report.extra_bytes <= extra < report.extra_bytes + 8192

    clean = wvk.check(plain_functional())
    assert clean.ok and clean.extra_bytes == 0 and "no variable" in str(clean)


# --- convert and inspect -------------------------------------------------------------------


def test_inspect_tells_which_keras_datasets_are_equal(tmp_path: Path) -> None:
    model = tied_functional()
    model.save_weights(tmp_path / "m.weights.h5")
    info = weightvault.inspect(tmp_path / "m.weights.h5")
    assert info.duplicates == {
        "layers/tied_1/vars/0": "layers/tied/vars/0",
        "layers/tied_2/vars/0": "layers/tied/vars/0",
        "layers/dense_1/vars/1": "layers/dense/vars/1",  # two zero biases
    }
    assert info.dedupe_savings == 2 * KERNEL_BYTES + 8 * 4
    sub = subclassed()
    sub.save(tmp_path / "m.keras")
    archive = weightvault.inspect(tmp_path / "m.keras")
    assert archive.dedupe_savings == 3 * KERNEL_BYTES
    assert main(["inspect", str(tmp_path / "m.keras")]) == 0


def test_cli_convert_stores_each_shared_variable_once_keras_still_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tied_functional()
    src, small = tmp_path / "model.weights.h5", tmp_path / "small.weights.h5"
    model.save_weights(src)
    assert main(["convert", str(src), str(small)]) == 0
    assert "--dedupe-copies would save 32 (32 B) more" in capsys.readouterr().out

    tied = ["layers/tied/vars/0", "layers/tied_1/vars/0", "layers/tied_2/vars/0"]
    assert same_object(small, tied)
    biases = ["layers/dense/vars/1", "layers/dense_1/vars/1"]
    assert not same_object(small, biases)  # equal constants: separate variables
    assert os.path.getsize(src) - os.path.getsize(small) >= 2 * KERNEL_BYTES
    fresh = tied_functional(seed=1)
    fresh.load_weights(small)
    assert np.array_equal(np_(fresh(X)), np_(model(X)))

    smaller = tmp_path / "smaller.weights.h5"
    assert main(["convert", str(src), str(smaller), "--dedupe-copies"]) == 0
    assert same_object(smaller, biases)
    info = weightvault.inspect(smaller)
    assert info.copies == {"layers/dense_1/vars/1": "layers/dense/vars/1"}
    again = tied_functional(seed=2)
    again.load_weights(smaller)
    assert np.array_equal(np_(again(X)), np_(model(X)))
    report = wvk.load(tied_functional(seed=3), smaller)
    assert report.ok and report.untied == []  # a copy is its own variable again


def test_cli_convert_keeps_separate_variables_weightvault_wrote_separate(tmp_path: Path) -> None:
    model = plain_functional()
    stem, head = model.get_layer("stem"), model.get_layer("head")
    kernel = np.random.default_rng(3).standard_normal((16, 4)).astype("float32")
    head.kernel.assign(kernel)
    model.get_layer("norm").gamma.assign(np.arange(16, dtype="float32"))
    model.get_layer("norm").beta.assign(np.arange(16, dtype="float32"))
    src, out = tmp_path / "m.weights.h5", tmp_path / "out.weights.h5"
    wvk.save_weights(model, src)  # the manifest says gamma and beta are separate
    assert main(["convert", str(src), str(out)]) == 0
    gamma, beta = "layers/batch_normalization/vars/0", "layers/batch_normalization/vars/1"
    assert not same_object(out, [gamma, beta])
    assert stem.kernel is not head.kernel


def test_cli_convert_keras_archive_to_archive(tmp_path: Path) -> None:
    model = subclassed()
    src, small = tmp_path / "model.keras", tmp_path / "small.keras"
    model.save(src)
    assert main(["convert", str(src), str(small)]) == 0
    assert os.path.getsize(src) - os.path.getsize(small) >= 3 * KERNEL_BYTES
    loaded = keras.models.load_model(small)
    assert np.array_equal(np_(loaded(X)), np_(model(X)))
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(small) as b:
        assert b.read("config.json") == a.read("config.json")


def test_a_weights_file_cannot_become_an_archive(tmp_path: Path) -> None:
    sequential().save_weights(tmp_path / "m.weights.h5")
    with pytest.raises(weightvault.FormatError, match="holds no model config"):
        weightvault.convert(tmp_path / "m.weights.h5", tmp_path / "m.keras")


# --- load memory -----------------------------------------------------------------------


def _peak_extra(load: Any) -> int:
    """The peak RSS ``load()`` adds (the kernel's high-water mark, reset just before).

    Memory freed earlier but kept by malloc would be reused unseen, so it is handed back
    to the system first: every byte the load allocates then shows.
    """
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
    load()
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) * 1024 - before


def dense_stack(width: int, depth: int) -> Any:
    return keras.Sequential(
        [keras.Input((width,))] + [layers.Dense(width, use_bias=False) for _ in range(depth)]
    )


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
@pytest.mark.parametrize("kind", ["safetensors", "weights.h5", "keras"])
def test_load_streams_one_variable_at_a_time(tmp_path: Path, kind: str) -> None:
    width, depth = 512, 24  # 24 MiB in 1 MiB kernels
    model = randomize(dense_stack(width, depth), 0)
    path = tmp_path / f"m.{kind}"
    {"safetensors": wvk.save, "weights.h5": wvk.save_weights, "keras": wvk.save_model}[kind](
        model, path
    )
    model.save_weights(tmp_path / "keras.weights.h5")
    # The oracle: Keras' own load_weights, which assigns one variable at a time. On the
    # PyTorch backend it costs next to nothing; on JAX every new value is a new buffer,
    # and the freed ones are not handed back at once, for Keras as for anyone.
    keras_fresh = dense_stack(width, depth)
    keras_extra = _peak_extra(lambda: keras_fresh.load_weights(tmp_path / "keras.weights.h5"))
    fresh = dense_stack(width, depth)
    extra = _peak_extra(lambda: wvk.load(fresh, path))
    # Reading everything first held the whole model again (24 MiB on PyTorch).
    slack = 2 * (width * width * 4) + (2 << 20)
    if keras.backend.backend() == "jax":
        # JAX hands freed buffers back late and by its own schedule, for Keras as for us;
        # there only a whole extra copy of the model (24 MiB) is told apart from noise.
        slack = width * width * 4 * depth // 2
    assert extra < keras_extra + slack, (extra, keras_extra)
    x = np.ones((1, width), "float32")
    assert np.array_equal(np_(fresh(x)), np_(model(x)))


@pytest.mark.parametrize("writer", ["keras", "weightvault"])
def test_weights_h5_is_read_without_a_mapping_and_a_cut_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    import mmap

    model = tied_functional(3)
    path = tmp_path / "m.weights.h5"
    if writer == "keras":
        model.save_weights(path)
    else:
        wvk.save_weights(model, path)
    real, tried = mmap.mmap, []

    def mapping(fileno: int, *args: Any, **kwargs: Any) -> Any:
        if fileno >= 0:
            tried.append(fileno)
            raise AssertionError("the .weights.h5 file was mapped")
        return real(fileno, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", mapping)
    # The oracle: Keras' own load_weights of the same file.
    keras_fresh = tied_functional(9)
    keras_fresh.load_weights(path)
    fresh = tied_functional(9)
    wvk.load(fresh, path)
    assert np.array_equal(np_(fresh(X)), np_(keras_fresh(X)))
    assert np.array_equal(np_(fresh(X)), np_(model(X)))
    # Cut short after it was opened: refused before any variable changes.
    with weightvault.formats.open_any(path) as ckpt:
        os.truncate(path, path.stat().st_size // 2)
        other = tied_functional(9)
        before = [np_(v).copy() for v in other.weights]
        with pytest.raises(weightvault.FormatError, match=f"{path}: tensor "):
            wvk.load(other, ckpt)
        assert all(np.array_equal(np_(v), b) for v, b in zip(other.weights, before, strict=True))
    assert not tried


# --- background saves -----------------------------------------------------------------


def test_background_save_keeps_the_values_of_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tied_functional()
    expected = np_(model(X))
    release = threading.Event()
    real = wvk.save_file

    def slow(*args: Any, **kw: Any) -> Any:
        assert release.wait(30)
        return real(*args, **kw)

    monkeypatch.setattr(wvk, "save_file", slow)
    handle = wvk.save(model, tmp_path / "m.safetensors", background=True)
    assert isinstance(handle, weightvault.SaveHandle) and not handle.done()
    randomize(model, 99)  # training goes on while the file is written
    release.set()
    report = handle.wait(60)
    assert report.aliases  # the shared kernel, once
    fresh = tied_functional(seed=1)
    wvk.load(fresh, tmp_path / "m.safetensors")
    assert np.array_equal(np_(fresh(X)), expected)
    second = wvk.save(model, tmp_path / "n.safetensors")  # a plain save after it
    assert second.file_bytes == os.path.getsize(tmp_path / "n.safetensors")


# --- refusals --------------------------------------------------------------------------


def test_unbuilt_models_and_assets_are_refused(tmp_path: Path) -> None:
    unbuilt = keras.Sequential([layers.Dense(3)])
    for verb in (wvk.save_weights, wvk.save_model):
        with pytest.raises(weightvault.ModelNotBuiltError):
            verb(unbuilt, tmp_path / "x")
    with pytest.raises(weightvault.ModelNotBuiltError):
        wvk.check(unbuilt)

    class Vocabulary(layers.Layer):
        """Keeps a file beside its weights, as TextVectorization does."""

        def call(self, x: Any) -> Any:
            return x

        def save_assets(self, dir_path: str) -> None:
            Path(dir_path, "vocabulary.txt").write_text("a\nb\n")

    with_assets = keras.Sequential([keras.Input((2,)), layers.Dense(2), Vocabulary()])
    with pytest.raises(weightvault.UnsupportedValueError, match="keep assets"):
        wvk.save_model(with_assets, tmp_path / "v.keras")
    assert not (tmp_path / "v.keras").exists()


def test_convert_of_a_keras_file_plans_without_writing_and_takes_no_rules(tmp_path: Path) -> None:
    model = tied_functional()
    model.save_weights(tmp_path / "m.weights.h5")
    dry = weightvault.convert(tmp_path / "m.weights.h5", tmp_path / "o.weights.h5", dry_run=True)
    assert not (tmp_path / "o.weights.h5").exists() and dry.file_bytes == 0
    assert len(dry.aliases) == 2 and dry.bytes_saved == 2 * KERNEL_BYTES
    with pytest.raises(weightvault.RuleError, match="names are its layout"):
        weightvault.convert(
            tmp_path / "m.weights.h5", tmp_path / "o.weights.h5", rules=[("a", "b")]
        )
