"""A PyTorch model's file loads into the equivalent Keras model, and back.

``torch.nn.Linear.weight`` is ``(out, in)``; ``keras.layers.Dense.kernel`` is
``(in, out)``. Renames (``rules``) say which name fills which; value transforms
(``transforms``) say how the values are rearranged. The two are kept apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
keras = pytest.importorskip("keras")

import weightvault  # noqa: E402
import weightvault.keras as wvk  # noqa: E402
import weightvault.torch as wvt  # noqa: E402
from weightvault.rules import invert  # noqa: E402

# torch names -> keras names. Both directions use the same table, inverted for the way back.
RULES = [
    ("0.weight", "fc1/kernel"),
    ("0.bias", "fc1/bias"),
    ("2.weight", "fc2/kernel"),
    ("2.bias", "fc2/bias"),
]
X = np.random.default_rng(0).standard_normal((4, 6)).astype("float32")


def torch_mlp(seed: int) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))


def keras_mlp(seed: int) -> Any:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(10, activation="relu", name="fc1"),
            keras.layers.Dense(3, name="fc2"),
        ]
    )


def torch_out(m: Any) -> Any:
    with torch.no_grad():
        return m(torch.from_numpy(X)).numpy()


def keras_out(m: Any) -> Any:
    return keras.ops.convert_to_numpy(m(X))


def test_torch_file_loads_into_keras(tmp_path):
    t = torch_mlp(0)
    wvt.save(t, tmp_path / "t.safetensors")
    k = keras_mlp(1)
    report = wvk.load(
        k, tmp_path / "t.safetensors", rules=RULES, transforms={"*/kernel": "transpose"}
    )
    assert report.ok and ("0.weight", "fc1/kernel") in report.renamed
    np.testing.assert_allclose(keras_out(k), torch_out(t), rtol=1e-5, atol=1e-6)


def test_keras_file_loads_into_torch(tmp_path):
    k = keras_mlp(2)
    wvk.save(k, tmp_path / "k.safetensors")
    t = torch_mlp(3)
    report = wvt.load(
        t, tmp_path / "k.safetensors", rules=invert(RULES), transforms={"*.weight": "transpose"}
    )
    assert report.ok
    np.testing.assert_allclose(torch_out(t), keras_out(k), rtol=1e-5, atol=1e-6)


def test_without_the_transform_the_shapes_disagree_and_nothing_changes(tmp_path):
    wvt.save(torch_mlp(0), tmp_path / "t.safetensors")
    k = keras_mlp(1)
    before = keras_out(k)
    with pytest.raises(weightvault.ShapeMismatchError, match=r"F32\[10, 6\] on disk"):
        wvk.load(k, tmp_path / "t.safetensors", rules=RULES)
    np.testing.assert_array_equal(keras_out(k), before)


def test_a_transform_that_does_not_fit_is_reported_before_any_copy(tmp_path):
    wvk.save(keras_mlp(2), tmp_path / "k.safetensors")
    t = torch_mlp(3)
    before = t[0].weight.detach().clone()
    # A 3-axis permutation cannot apply to 2-D weights: refused before anything is copied.
    with pytest.raises(weightvault.ShapeMismatchError, match="reorders 3 axes"):
        wvt.load(t, tmp_path / "k.safetensors", rules=invert(RULES), transforms={"*": (2, 1, 0)})
    assert torch.equal(t[0].weight, before)
