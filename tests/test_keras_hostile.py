"""Hostile Keras files: each refused with a FormatError naming the member, model untouched.

HDF5 links that loop, leave the file or make one dataset stand for two shapes; ``.keras``
zips with path traversal or a bomb; configs that would run code. Files are made here with
Keras, h5py and zipfile. Runs on torch and (tests/test_keras_jax.py) JAX.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
h5py = pytest.importorskip("h5py")

import weightvault.keras as wvk  # noqa: E402
from weightvault import FormatError  # noqa: E402

layers = keras.layers
WEIGHTS = "model.weights.h5"


def build(seed: int = 0) -> Any:
    """Dense 4 -> 3 then 3 -> 3: two kernels of different shapes."""
    model = keras.Sequential([keras.Input((4,)), layers.Dense(3), layers.Dense(3)])
    rng = np.random.default_rng(seed)
    for v in model.weights:
        v.assign(rng.standard_normal(tuple(v.shape)).astype("float32"))
    return model


def values(model: Any) -> list[Any]:
    return [np.array(keras.ops.convert_to_numpy(v)) for v in model.weights]


def assert_refused(model: Any, path: Path, *words: str) -> str:
    """``load`` raises a FormatError naming ``path`` and ``words``; nothing changed."""
    before = values(model)
    with pytest.raises(FormatError) as info:
        wvk.load(model, path)
    message = str(info.value)
    for word in (str(path), *words):
        assert word in message, message
    for a, b in zip(before, values(model), strict=True):
        assert np.array_equal(a, b)
    return message


def rewrite_h5(src: Path, dst: Path, edit: Any) -> None:
    """Copy a Keras weights file, then let ``edit(h5py.File)`` break it."""
    dst.write_bytes(src.read_bytes())
    with h5py.File(dst, "a") as f:
        edit(f)


def archive(path: Path, members: dict[str, bytes], deflate: tuple[str, ...] = ()) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            kind = zipfile.ZIP_DEFLATED if name in deflate else zipfile.ZIP_STORED
            z.writestr(name, data, compress_type=kind)
    return path


def keras_members(tmp_path: Path, model: Any, edit: Any = None) -> dict[str, bytes]:
    """The members of ``model.save(...)``, with the weights file broken by ``edit``."""
    path = tmp_path / "real.keras"
    model.save(path)
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    if edit is not None:
        h5 = tmp_path / "w.h5"
        h5.write_bytes(members[WEIGHTS])
        with h5py.File(h5, "a") as f:
            edit(f)
        members[WEIGHTS] = h5.read_bytes()
    return members


def loop(f: Any) -> None:
    f["layers/dense/loop"] = f["layers/dense"]  # a group that contains itself


def outside(f: Any) -> None:
    del f["layers/dense/vars/1"]
    f["layers/dense/vars/1"] = h5py.ExternalLink("/etc/passwd", "/x")


def two_shapes(f: Any) -> None:
    del f["layers/dense_1/vars/0"]  # (3, 3) in the model
    f["layers/dense_1/vars/0"] = f["layers/dense/vars/0"]  # (4, 3) on disk


# --- HDF5 links ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (loop, ["'layers/dense/loop'", "contains itself"]),
        (outside, ["'layers/dense/vars/1'", "external link"]),
        (two_shapes, ["'layers/dense/vars/0'", "'layers/dense_1/vars/0'", "different shapes"]),
    ],
)
def test_bad_links_in_weights_h5(tmp_path: Path, edit: Any, words: list[str]) -> None:
    model = build()
    model.save_weights(tmp_path / "good.weights.h5")
    bad = tmp_path / "bad.weights.h5"
    rewrite_h5(tmp_path / "good.weights.h5", bad, edit)
    assert_refused(build(1), bad, *words)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (loop, ["contains itself"]),
        (outside, ["external link"]),
        (two_shapes, ["different shapes"]),
    ],
)
def test_bad_links_in_keras_archive_name_the_member(
    tmp_path: Path, edit: Any, words: list[str]
) -> None:
    bad = archive(tmp_path / "bad.keras", keras_members(tmp_path, build(), edit))
    assert_refused(build(1), bad, f"member '{WEIGHTS}'", *words)
    with pytest.raises(FormatError, match=r"member 'model\.weights\.h5'"):
        wvk.load_model(bad)


def test_offsets_cannot_reach_past_the_member(tmp_path: Path) -> None:
    members = keras_members(tmp_path, build())
    weights = members.pop(WEIGHTS)
    # The HDF5 file cut short inside the archive; the rest of the zip follows it.
    members[WEIGHTS] = weights[: len(weights) // 2]
    members["zz.bin"] = weights[len(weights) // 2 :]
    bad = archive(tmp_path / "cut.keras", members)
    assert_refused(build(1), bad, f"member '{WEIGHTS}'")


# --- zips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../evil.txt", "/etc/cron.d/x", "assets\\..\\x", "C:/x"])
def test_path_traversal_in_a_member_name(tmp_path: Path, name: str) -> None:
    members = keras_members(tmp_path, build())
    members[name] = b"payload"
    bad = archive(tmp_path / "traversal.keras", members)
    assert_refused(build(1), bad, repr(name))
    with pytest.raises(FormatError, match="leaves the archive"):
        wvk.load_model(bad)


def lie_about_size(path: Path, member: str, size: int) -> None:
    """Make ``member``'s local and central headers claim ``size`` uncompressed bytes."""
    data = bytearray(path.read_bytes())
    encoded = member.encode()
    local = data.find(b"PK\x03\x04")
    while local != -1:
        if data[local + 30 : local + 30 + len(encoded)] == encoded:
            struct.pack_into("<I", data, local + 22, size)
        local = data.find(b"PK\x03\x04", local + 4)
    central = data.find(b"PK\x01\x02")
    while central != -1:
        if data[central + 46 : central + 46 + len(encoded)] == encoded:
            struct.pack_into("<I", data, central + 24, size)
        central = data.find(b"PK\x01\x02", central + 4)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("member", ["config.json", WEIGHTS])
def test_a_member_claiming_more_than_deflate_gives_is_a_bomb(tmp_path: Path, member: str) -> None:
    members = keras_members(tmp_path, build())
    bad = archive(tmp_path / "bomb.keras", members, deflate=(member,))
    lie_about_size(bad, member, 1 << 31)
    message = assert_refused(build(1), bad, f"member '{member}'", "zip bomb")
    assert "2147483648" in message
    with pytest.raises(FormatError, match="zip bomb"):
        wvk.load_model(bad)


def test_a_real_deflate_bomb_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    members = keras_members(tmp_path, build())
    members[WEIGHTS] = bytes(160 << 20)  # 160 MiB of zeros, about 160 KiB deflated
    bad = archive(tmp_path / "bomb.keras", members, deflate=(WEIGHTS,))
    assert bad.stat().st_size < 1 << 20
    assert_refused(build(1), bad, f"member {WEIGHTS!r}", "would decode")


def test_a_member_named_twice_is_refused(tmp_path: Path) -> None:
    members = keras_members(tmp_path, build())
    path = tmp_path / "twice.keras"
    with pytest.warns(UserWarning, match="Duplicate name"), zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr(WEIGHTS, members[WEIGHTS])
    assert_refused(build(1), path, f"member '{WEIGHTS}'", "appears twice")


# --- configs that would run code -----------------------------------------------------------


def test_a_lambda_layer_is_refused_unless_the_caller_opts_in(tmp_path: Path) -> None:
    model = keras.Sequential(
        [keras.Input((4,)), layers.Dense(3), layers.Lambda(lambda x: x * 2, name="double")]
    )
    path = tmp_path / "lambda.keras"
    model.save(path)
    with pytest.raises(FormatError) as info:
        wvk.load_model(path)
    assert "member 'config.json'" in str(info.value) and "'double'" in str(info.value)
    assert "Lambda" in str(info.value) and "safe_mode=False" in str(info.value)
    trusted = wvk.load_model(path, safe_mode=False)
    x = np.ones((1, 4), "float32")
    assert np.allclose(keras.ops.convert_to_numpy(trusted(x)), keras.ops.convert_to_numpy(model(x)))


@keras.saving.register_keras_serializable(package="wvhostile")
class Scaled(layers.Layer):
    """A custom layer: registered in this process, so Keras itself would build it."""

    def call(self, x: Any) -> Any:
        return x * 3.0


def test_a_custom_object_is_refused_unless_named(tmp_path: Path) -> None:
    model = keras.Sequential([keras.Input((4,)), layers.Dense(3), Scaled(name="scaled")])
    path = tmp_path / "custom.keras"
    model.save(path)
    with pytest.raises(FormatError, match=r"'scaled' is a custom object \(wvhostile>Scaled\)"):
        wvk.load_model(path)
    loaded = wvk.load_model(path, custom_objects={"Scaled": Scaled})
    x = np.ones((1, 4), "float32")
    assert np.allclose(keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(model(x)))


def test_config_that_is_not_json_is_refused(tmp_path: Path) -> None:
    members = keras_members(tmp_path, build())
    members["config.json"] = b"{" * 100_000  # deeper than the JSON parser recurses
    bad = archive(tmp_path / "deep.keras", members)
    with pytest.raises(FormatError, match=r"member 'config\.json'"):
        wvk.load_model(bad)


def test_inflated_weights_member_still_loads(tmp_path: Path) -> None:
    """A member someone deflated is read from memory, within the decode budget."""
    model = build()
    members = keras_members(tmp_path, model)
    good = archive(tmp_path / "deflated.keras", members, deflate=(WEIGHTS,))
    fresh = build(1)
    assert wvk.load(fresh, good).ok
    for a, b in zip(values(model), values(fresh), strict=True):
        assert np.array_equal(a, b)
