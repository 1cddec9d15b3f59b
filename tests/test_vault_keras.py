"""The vault takes a Keras model as it takes a PyTorch one: dispatch by the model's type."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import weightvault  # noqa: E402
import weightvault.keras as wk  # noqa: E402


def build(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    backbone = keras.layers.Dense(32, name="backbone")
    head = keras.layers.Dense(4, name="head")
    model = keras.Model(inputs, head(backbone(inputs)))
    return model


def test_keras_checkpoints_share_the_frozen_backbone(tmp_path):
    model = build(0)
    wk.freeze(model, "backbone")
    vault = weightvault.Vault(tmp_path / "v")
    first = vault.save(model)
    head = model.get_layer("head")
    head.kernel.assign(head.kernel.numpy() + 1.0)
    second = vault.save(model, metadata={"step": "2"})
    assert first.new_bytes == first.stored_bytes
    assert second.new_bytes == 32 * 4 * 4  # only the head's kernel changed
    assert second.framework == "keras"

    fresh = build(1)
    report = vault.load(fresh, "latest", restore_frozen=True)
    assert report.missing == [] and report.unexpected == []
    x = np.random.default_rng(0).normal(size=(3, 16)).astype("float32")
    assert np.array_equal(fresh.predict(x, verbose=0), model.predict(x, verbose=0))
    assert [v.path for v in wk.trainable(fresh)] == ["head/kernel", "head/bias"]
    assert vault.verify().ok
