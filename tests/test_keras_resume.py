"""Keras training resumes bit for bit from a file or a vault: optimizer state by variable
path, RNG states (Dropout's seed included), and the ``VaultCheckpoint`` callback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import weightvault.keras as wvk  # noqa: E402
from weightvault import KeyMismatchError, Vault  # noqa: E402
from weightvault._base.errors import TrainingStateError  # noqa: E402
from weightvault.integrations.keras import VaultCheckpoint, restore  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
}

RS = np.random.RandomState(0)
X = RS.randn(32, 4).astype("float32")
Y = RS.randn(32, 1).astype("float32")


def build(seed: int, *, freeze: bool = True, seeded: bool = True) -> Any:
    """A layer used twice (one shared kernel), Dropout (so RNG matters), a frozen layer.

    A seeded Dropout draws from its own ``SeedGenerator``; an unseeded one (on the torch
    backend) from torch's global generator, which ``fit`` also draws from for its loader.
    """
    keras.utils.set_random_seed(seed)
    shared = keras.layers.Dense(4, activation="tanh", name="shared")
    inp = keras.Input((4,))
    drop = keras.layers.Dropout(0.3, name="drop", seed=seed + 1 if seeded else None)
    x = shared(drop(shared(inp)))
    fz = keras.layers.Dense(4, name="fz")
    x = fz(x)
    fz.trainable = not freeze
    return keras.Model(inp, keras.layers.Dense(1, name="head")(x))


def train(model: Any, opt: Any, start: int, steps: int) -> None:
    if getattr(model, "optimizer", None) is not opt:
        model.compile(optimizer=opt, loss="mse")
    for i in range(start, start + steps):
        j = (i * 8) % 32
        model.train_on_batch(X[j : j + 8], Y[j : j + 8])


def arrays(variables: Any) -> dict[str, Any]:
    # Keyed by position and name: Keras' auto-numbered paths (seed_generator_7) differ
    # between two builds of the same model.
    return {
        f"{i}:{v.name}": np.asarray(keras.ops.convert_to_numpy(v)) for i, v in enumerate(variables)
    }


def assert_bitwise(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def slots_of(opt: Any) -> dict[str, Any]:
    """The optimizer's variables by name (layers are named, so these names are stable)."""
    return {str(v.name): np.asarray(keras.ops.convert_to_numpy(v)) for v in opt.variables}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_each_optimizer_resumes_bitwise_from_a_file(kind: str, tmp_path: Path) -> None:
    straight, opt = build(0), OPTIMIZERS[kind]()
    train(straight, opt, 0, 6)

    first, opt1 = build(0), OPTIMIZERS[kind]()
    train(first, opt1, 0, 3)
    report = wvk.save(first, tmp_path / "c.safetensors", optimizer=opt1, rng=True)
    state = sorted(n for n in report.stored if "/optim/" in n)
    # One entry per distinct trainable variable: the shared kernel once, the frozen layer none.
    assert {n.split("/optim/")[1].rsplit("/", 1)[0] for n in state} == {
        "shared/kernel",
        "shared/bias",
        "head/kernel",
        "head/bias",
    }
    train(first, opt1, 3, 1)  # the live objects move on; the file must not

    resumed, opt2 = build(7), OPTIMIZERS[kind]()
    if keras.backend.backend() != "jax":
        # Built in reversed order: state must follow the variable paths, not positions.
        # (Keras' JAX train step pairs optimizer variables with the model's by position,
        # so there an optimizer must be built in model order.)
        opt2.build(list(reversed(resumed.trainable_variables)))
    loaded = wvk.load(resumed, tmp_path / "c.safetensors", optimizer=opt2, rng=True)
    assert loaded.optimizer is not None and loaded.optimizer.ok
    assert sorted(loaded.optimizer.loaded) == sorted(
        ["shared/kernel", "shared/bias", "head/kernel", "head/bias"]
    )
    assert loaded.restored == ["rng:python", "rng:numpy", "rng:keras"] + (
        ["rng:torch"] if keras.backend.backend() == "torch" else []
    )
    train(resumed, opt2, 3, 3)
    assert_bitwise(arrays(straight.variables), arrays(resumed.variables))
    assert_bitwise(slots_of(opt), slots_of(opt2))


def test_without_rng_dropout_draws_other_masks(tmp_path: Path) -> None:
    straight, opt = build(0), OPTIMIZERS["adam"]()
    train(straight, opt, 0, 4)
    first, opt1 = build(0), OPTIMIZERS["adam"]()
    train(first, opt1, 0, 2)
    wvk.save(first, tmp_path / "c.safetensors", optimizer=opt1, rng=True)
    resumed, opt2 = build(7), OPTIMIZERS["adam"]()
    wvk.load(resumed, tmp_path / "c.safetensors", optimizer=opt2)  # unbuilt: built by load
    train(resumed, opt2, 2, 2)
    a, b = arrays(straight.trainable_variables), arrays(resumed.trainable_variables)
    assert any(a[k].tobytes() != b[k].tobytes() for k in a)


def test_frozen_layer_has_no_state_and_unfreezing_is_strict(tmp_path: Path) -> None:
    model, opt = build(0), OPTIMIZERS["adam"]()
    train(model, opt, 0, 2)
    wvk.save(model, tmp_path / "c.safetensors", optimizer=opt)
    thawed, opt2 = build(1, freeze=False), OPTIMIZERS["adam"]()
    opt2.build(thawed.trainable_variables)
    with pytest.raises(KeyMismatchError, match="fz/kernel"):
        wvk.load(thawed, tmp_path / "c.safetensors", optimizer=opt2)
    before = slots_of(opt2)
    assert all(not v.any() for v in before.values() if v.ndim)  # all or nothing: untouched
    report = wvk.load(thawed, tmp_path / "c.safetensors", optimizer=opt2, strict=False)
    assert report.optimizer is not None
    assert report.optimizer.missing == ["fz/kernel", "fz/bias"]
    assert int(keras.ops.convert_to_numpy(opt2.iterations)) == 2


def test_wrong_optimizer_options_and_scheduler_are_refused(tmp_path: Path) -> None:
    model, opt = build(0), OPTIMIZERS["adam"]()
    train(model, opt, 0, 1)
    wvk.save(model, tmp_path / "c.safetensors", optimizer=opt)
    with pytest.raises(TrainingStateError, match="Adam optimizer, which a SGD"):
        wvk.load(build(1), tmp_path / "c.safetensors", optimizer=keras.optimizers.SGD())
    with pytest.raises(TrainingStateError, match="velocity_hat"):
        wvk.load(
            build(1), tmp_path / "c.safetensors", optimizer=keras.optimizers.Adam(amsgrad=True)
        )
    with pytest.raises(TypeError, match="learning-rate schedule lives in"):
        wvk.save(model, tmp_path / "d.safetensors", optimizer=opt, scheduler=object())
    with pytest.raises(TrainingStateError, match="no optimizer or RNG state"):
        wvk.save(model, tmp_path / "w.safetensors")
        wvk.load(build(1), tmp_path / "w.safetensors", optimizer=OPTIMIZERS["adam"]())


def test_schedule_config_and_learning_rate_come_back(tmp_path: Path) -> None:
    sched = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)
    model, opt = build(0), keras.optimizers.SGD(sched, momentum=0.5)
    train(model, opt, 0, 3)
    wvk.save(model, tmp_path / "c.safetensors", optimizer=opt)
    model2, opt2 = build(0), keras.optimizers.SGD(sched, momentum=0.5)
    wvk.load(model2, tmp_path / "c.safetensors", optimizer=opt2)
    assert float(opt2.learning_rate) == float(opt.learning_rate)  # iterations came back
    plain, popt = build(0), keras.optimizers.Adam(0.01)
    train(plain, popt, 0, 1)
    popt.learning_rate = 0.003  # what ReduceLROnPlateau does
    wvk.save(plain, tmp_path / "p.safetensors", optimizer=popt)
    fresh = keras.optimizers.Adam(0.01, beta_1=0.8)
    report = wvk.load(build(0), tmp_path / "p.safetensors", optimizer=fresh)
    assert float(fresh.learning_rate) == pytest.approx(0.003)
    assert report.optimizer is not None and report.optimizer.groups_kept == [0]


def test_vault_resumes_and_the_next_checkpoint_costs_trainable_weights_and_slots(
    tmp_path: Path,
) -> None:
    vault = Vault(tmp_path / "v")
    straight, opt = build(0), OPTIMIZERS["adam"]()
    train(straight, opt, 0, 6)

    model, opt1 = build(0), OPTIMIZERS["adam"]()
    train(model, opt1, 0, 3)
    vault.save(model, "half", optimizer=opt1, rng=True)
    resumed, opt2 = build(3), OPTIMIZERS["adam"]()
    vault.load(resumed, "half", optimizer=opt2, rng=True)
    train(resumed, opt2, 3, 3)
    assert_bitwise(arrays(straight.variables), arrays(resumed.variables))
    assert_bitwise(slots_of(opt), slots_of(opt2))

    train(model, opt1, 3, 1)
    vault.save(model, "next", optimizer=opt1)
    trainable = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    assert len(model.trainable_variables) == 4  # shared kernel once, frozen layer none
    assert vault.list()[-1].new_bytes == 3 * trainable  # weights, momentum, velocity


def fit_model(seed: int, *, seeded: bool = True) -> Any:
    model = build(seed, seeded=seeded)
    model.compile(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.05), loss="mse")
    return model


def test_vault_checkpoint_callback_resumes_fit_bitwise(tmp_path: Path) -> None:
    straight = fit_model(0)
    straight.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    vault = Vault(tmp_path / "v")
    run = fit_model(0)
    run.fit(
        X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[VaultCheckpoint(vault)]
    )
    assert [r.name for r in vault.list()] == ["epoch-0001", "epoch-0002"]
    assert_bitwise(arrays(straight.variables), arrays(run.variables))  # the callback is inert

    resumed = fit_model(5)
    start = restore(vault, resumed, "epoch-0001")
    assert start == 1
    resumed.fit(X, Y, batch_size=8, epochs=2, initial_epoch=start, shuffle=False, verbose=0)
    assert_bitwise(arrays(straight.variables), arrays(resumed.variables))
    assert_bitwise(slots_of(straight.optimizer), slots_of(resumed.optimizer))


def test_vault_resume_equals_resuming_from_keras_own_file(tmp_path: Path) -> None:
    # Keras' .keras file holds no RNG state, so both resumes start from the same reseed.
    vault = Vault(tmp_path / "v")
    model = fit_model(0, seeded=False)
    cb = VaultCheckpoint(vault)
    model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    model.save(tmp_path / "own.keras")
    theirs = keras.models.load_model(tmp_path / "own.keras")
    ours = fit_model(9, seeded=False)
    start = restore(vault, ours, rng=False)
    for resumed in (theirs, ours):
        keras.utils.set_random_seed(11)
        # On JAX an unseeded Dropout draws from its own generator, made from a random seed.
        resumed.get_layer("drop").seed_generator.state.assign(np.array([7, 0], "int32"))
        resumed.fit(X, Y, batch_size=8, epochs=2, initial_epoch=start, shuffle=False, verbose=0)
    assert_bitwise(arrays(theirs.trainable_variables), arrays(ours.trainable_variables))
    assert_bitwise(slots_of(theirs.optimizer), slots_of(ours.optimizer))


def test_callback_step_frequency_and_retention(tmp_path: Path) -> None:
    vault = Vault(tmp_path / "v")
    model = fit_model(0)
    cb = VaultCheckpoint(vault, save_freq=3, keep=2)
    model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
    records = vault.list()
    assert [r.name for r in records] == ["step-000003", "step-000006"]  # step-000003.. kept 2
    assert records[-1].metadata["keras.epoch"] == "1"
    with pytest.raises(ValueError, match="save_freq"):
        VaultCheckpoint(vault, save_freq=0)
    plain = Vault(tmp_path / "p")
    plain.save(model, "manual")
    with pytest.raises(Exception, match="records no Keras epoch"):
        restore(plain, fit_model(1))


def test_unseeded_dropout_resumes_through_the_global_generators(tmp_path: Path) -> None:
    straight, opt = build(0, seeded=False), OPTIMIZERS["adam"]()
    train(straight, opt, 0, 4)
    first, opt1 = build(0, seeded=False), OPTIMIZERS["adam"]()
    train(first, opt1, 0, 2)
    wvk.save(first, tmp_path / "c.safetensors", optimizer=opt1, rng=True)
    resumed, opt2 = build(4, seeded=False), OPTIMIZERS["adam"]()
    wvk.load(resumed, tmp_path / "c.safetensors", optimizer=opt2, rng=True)
    train(resumed, opt2, 2, 2)
    assert_bitwise(arrays(straight.trainable_variables), arrays(resumed.trainable_variables))


def test_background_vault_save_holds_the_values_at_the_call(tmp_path: Path) -> None:
    vault = Vault(tmp_path / "v")
    model, opt = build(0), OPTIMIZERS["adam"]()
    train(model, opt, 0, 2)
    at_call, slots_at_call = arrays(model.variables), slots_of(opt)
    handle = vault.save(model, "bg", optimizer=opt, rng=True, background=True)
    train(model, opt, 2, 2)  # at once: the checkpoint must not see these steps
    handle.wait()
    resumed, opt2 = build(5), OPTIMIZERS["adam"]()
    vault.load(resumed, "bg", optimizer=opt2, rng=True)
    assert_bitwise(at_call, arrays(resumed.variables))
    assert_bitwise(slots_at_call, slots_of(opt2))


def test_rules_rename_optimizer_state_and_unused_state_is_strict(tmp_path: Path) -> None:
    model, opt = build(0), OPTIMIZERS["sgd"]()
    train(model, opt, 0, 2)
    wvk.save(model, tmp_path / "c.safetensors", optimizer=opt)
    renamed = build(1)
    renamed.get_layer("head").name = "out"
    renamed = keras.Model(renamed.inputs, renamed.outputs)  # walk again under the new name
    opt2 = OPTIMIZERS["sgd"]()
    with pytest.raises(KeyMismatchError, match="head/kernel"):
        wvk.load(renamed, tmp_path / "c.safetensors", optimizer=opt2)
    report = wvk.load(
        renamed, tmp_path / "c.safetensors", optimizer=opt2, rules=[("head/*", "out/*")]
    )
    assert report.optimizer is not None and report.optimizer.ok
    assert ("head/kernel", "out/kernel") in report.optimizer.renamed
    saved = slots_of(opt)["head_kernel_momentum"]
    got = {k: v for k, v in slots_of(opt2).items() if k.endswith("kernel_momentum")}
    assert any(v.tobytes() == saved.tobytes() for v in got.values())


def test_callback_training_state_last_keeps_weights_and_the_newest_resumes(
    tmp_path: Path,
) -> None:
    """``training_state_last=1``: the first epoch's checkpoint keeps its weights but not
    its optimizer state (restoring it names it); the newest resumes bitwise."""
    straight = fit_model(0)
    straight.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0)

    vault = Vault(tmp_path / "v")
    run = fit_model(0)
    cb = VaultCheckpoint(vault, training_state_last=1)
    run.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
    assert [(r.name, r.weights_only) for r in vault.list()] == [
        ("epoch-0001", True), ("epoch-0002", False)
    ]  # fmt: skip
    with pytest.raises(TrainingStateError, match="'epoch-0001' holds weights only"):
        restore(vault, fit_model(5), "epoch-0001")
    # The callback freed what the dropped state held: nothing is left for a gc.
    assert vault.gc() == 0 and vault.verify().ok
    early = fit_model(5)
    assert restore(vault, early, "epoch-0001", optimizer=False, rng=False) == 1
    again = fit_model(0)
    again.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert_bitwise(arrays(again.trainable_variables), arrays(early.trainable_variables))

    resumed = fit_model(5)
    start = restore(vault, resumed, "epoch-0002")
    resumed.fit(X, Y, batch_size=8, epochs=3, initial_epoch=start, shuffle=False, verbose=0)
    assert_bitwise(arrays(straight.variables), arrays(resumed.variables))
    assert_bitwise(slots_of(straight.optimizer), slots_of(resumed.optimizer))
    with pytest.raises(ValueError, match="training_state_last"):
        VaultCheckpoint(vault, training_state_last=0)
