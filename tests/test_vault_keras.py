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


def test_the_keras_callback_and_restore_take_a_path(tmp_path):
    """``VaultCheckpoint("runs/vault")`` as ``ModelCheckpoint`` takes a path (it used to fail
    with "'str' object has no attribute 'save'"), and ``restore`` reads the same path."""
    from weightvault.integrations.keras import VaultCheckpoint, restore

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 16)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    root = tmp_path / "runs" / "vault"
    model = build(0)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[VaultCheckpoint(str(root))])  # fmt: skip
    assert [r.name for r in weightvault.Vault(root).list()] == ["epoch-0001", "epoch-0002"]

    fresh = build(1)
    fresh.compile(optimizer="adam", loss="mse")
    assert restore(root, fresh) == 2  # a PathLike; "latest" is the second epoch
    for a, b in zip(model.variables, fresh.variables, strict=True):
        assert np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
    for a, b in zip(model.optimizer.variables, fresh.optimizer.variables, strict=True):
        assert np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))

    with pytest.raises(weightvault.VaultNotFoundError, match="check the path"):
        restore(tmp_path / "typo", fresh)
    assert not (tmp_path / "typo").exists()
