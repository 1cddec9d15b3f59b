"""``VaultCheckpoint``'s best checkpoint against ``keras.callbacks.ModelCheckpoint``.

Each test runs Keras' own ``ModelCheckpoint`` and ``VaultCheckpoint`` side by side in the
same ``fit`` on the same seeded data: the epochs Keras writes a file for are the epochs
the vault holds a checkpoint of, and the weights of Keras' best file and of the vault's
``"best"`` load bitwise equal into fresh models.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

keras = pytest.importorskip("keras")

from weightvault import Vault  # noqa: E402
from weightvault.integrations.keras import VaultCheckpoint, restore, vault_best  # noqa: E402

RS = np.random.RandomState(0)
TRUE_W = np.array([1.0, -2.0, 0.5, 1.0], "float32")
X = RS.randn(64, 4).astype("float32")
Y = (X @ TRUE_W > 0).astype("float32")[:, None]
XV = RS.randn(32, 4).astype("float32")
YV = (XV @ TRUE_W > 0).astype("float32")[:, None]
EPOCHS = 6


def build(seed: int, lr: float = 2.0) -> Any:
    """A tiny classifier; a high SGD rate makes the validation metrics go up and down."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh", name="body"),
            keras.layers.Dense(1, activation="sigmoid", name="head"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(lr, momentum=0.9),
        loss="binary_crossentropy",
        metrics=["accuracy", "mae"],
    )
    return model


def fit(model: Any, callbacks: list[Any], epochs: int = EPOCHS, **kw: Any) -> Any:
    return model.fit(
        X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0,
        validation_data=kw.pop("validation_data", (XV, YV)), callbacks=callbacks, **kw,
    )  # fmt: skip


def oracle(folder: Path, monitor: str, mode: str = "auto", **kw: Any) -> Any:
    """Keras' ``ModelCheckpoint`` writing one weights file per epoch it saves."""
    return keras.callbacks.ModelCheckpoint(
        str(folder / "e{epoch:02d}.weights.h5"), monitor=monitor, mode=mode,
        save_best_only=True, save_weights_only=True, **kw,
    )  # fmt: skip


def keras_epochs(folder: Path) -> list[int]:
    return sorted(int(p.name[1:3]) for p in folder.glob("e*.weights.h5"))


def vault_epochs(vault: Vault) -> list[int]:
    return [int(r.name.removeprefix("epoch-")) for r in vault.list()]


def weights(model: Any) -> list[np.ndarray]:
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in model.weights]


def assert_bitwise(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def assert_best_is_keras_best(vault: Vault, folder: Path, trained: Any) -> None:
    """The vault's "best" is Keras' last best file, weights bit for bit."""
    best = keras_epochs(folder)[-1]
    assert vault.resolve("best") == f"epoch-{best:04d}"
    theirs, ours = build(7), build(8)
    theirs.load_weights(str(folder / f"e{best:02d}.weights.h5"))
    vault.load(ours, "best")
    assert_bitwise(weights(theirs), weights(ours))
    if best != EPOCHS:  # the best is not simply the end of training
        final = zip(weights(ours), weights(trained), strict=True)
        assert any(x.tobytes() != y.tobytes() for x, y in final)


@pytest.mark.parametrize(
    ("monitor", "mode"),
    [
        ("val_loss", "min"),
        ("val_loss", "max"),
        ("val_accuracy", "max"),
        ("val_loss", "auto"),
        ("val_accuracy", "auto"),  # a compiled metric whose direction is up
        ("val_mae", "auto"),  # ... and one whose direction is down
    ],
)
def test_save_best_only_saves_the_epochs_keras_saves(
    tmp_path: Path, monitor: str, mode: str
) -> None:
    vault = Vault(tmp_path / "v")
    model = build(0)
    history = fit(
        model,
        [
            oracle(tmp_path / "k", monitor, mode),
            VaultCheckpoint(vault, monitor=monitor, mode=mode, save_best_only=True),
        ],
    )
    saved = keras_epochs(tmp_path / "k")
    assert 0 < len(saved) < EPOCHS  # some epochs did not improve: the rule is exercised
    assert vault_epochs(vault) == saved
    assert_best_is_keras_best(vault, tmp_path / "k", model)
    record = {r.name: r for r in vault.list()}[vault.resolve("best")]
    values = history.history[monitor]
    best = min(values) if record.metadata["keras.mode"] == "min" else max(values)
    assert record.metadata["keras.monitor"] == monitor
    assert float(record.metadata["keras.best"]) == best
    assert record.metadata["keras.mode"] == ("max" if mode == "max" or "acc" in monitor else "min")


def test_without_save_best_only_every_epoch_is_saved_and_the_best_marked(
    tmp_path: Path,
) -> None:
    vault = Vault(tmp_path / "v")
    model = build(0)
    fit(
        model,
        [oracle(tmp_path / "k", "val_accuracy"), VaultCheckpoint(vault, monitor="val_accuracy")],
    )
    assert vault_epochs(vault) == list(range(1, EPOCHS + 1))
    assert len(keras_epochs(tmp_path / "k")) < EPOCHS
    assert_best_is_keras_best(vault, tmp_path / "k", model)
    assert vault.marks() == {"best": vault.resolve("best")}


@pytest.mark.parametrize(
    ("monitor", "mode", "threshold"), [("val_loss", "min", 0.25), ("val_accuracy", "max", 0.9)]
)
def test_initial_value_threshold(tmp_path: Path, monitor: str, mode: str, threshold: float) -> None:
    vault = Vault(tmp_path / "v")
    model = build(0)
    history = fit(
        model,
        [
            oracle(tmp_path / "k", monitor, mode, initial_value_threshold=threshold),
            VaultCheckpoint(
                vault, monitor=monitor, mode=mode, save_best_only=True,
                initial_value_threshold=threshold,
            ),
        ],
    )  # fmt: skip
    saved = keras_epochs(tmp_path / "k")
    assert saved and 1 not in saved  # the first epoch did not beat the threshold
    assert history.history[monitor][0] != threshold
    assert vault_epochs(vault) == saved
    assert_best_is_keras_best(vault, tmp_path / "k", model)


def test_a_missing_metric_warns_in_both_and_marks_nothing(tmp_path: Path) -> None:
    # Keras 3 warns and saves anyway (ModelCheckpoint._should_save_model returns True).
    vault = Vault(tmp_path / "v")
    callbacks = [
        oracle(tmp_path / "k", "val_nope", "min"),
        VaultCheckpoint(vault, monitor="val_nope", mode="min", save_best_only=True),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(build(0), callbacks, epochs=2)
    said = [str(w.message) for w in caught if "val_nope" in str(w.message)]
    assert said == ["Can save best model only with val_nope available."] * 4  # 2 epochs x 2
    assert vault_epochs(vault) == keras_epochs(tmp_path / "k") == [1, 2]
    assert vault.marks() == {}


def test_monitor_of_unknown_direction_raises_as_keras(tmp_path: Path) -> None:
    for callback in (
        oracle(tmp_path / "k", "val_nope"),
        VaultCheckpoint(tmp_path / "v", monitor="val_nope"),
    ):
        with pytest.raises(ValueError, match="isn't able to automatically determine"):
            fit(build(0), [callback], epochs=1)
    with pytest.warns(UserWarning, match="mode 'lowest' is unknown"):
        assert VaultCheckpoint(tmp_path / "v", mode="lowest").mode == "auto"


@pytest.mark.parametrize("lr", [1.0, 2.0])
def test_a_resumed_fit_compares_against_the_vaults_best(tmp_path: Path, lr: float) -> None:
    # The uninterrupted run with Keras' callback is the oracle for what the resumed one saves.
    straight = build(0, lr)
    fit(straight, [oracle(tmp_path / "k", "val_loss")])
    expected = keras_epochs(tmp_path / "k")

    vault = Vault(tmp_path / "v")
    resumable = Vault(tmp_path / "r")  # every epoch: what training resumes from
    history = fit(
        build(0, lr),
        [VaultCheckpoint(vault, save_best_only=True), VaultCheckpoint(resumable)],
        epochs=3,
    )
    best_before = vault.resolve("best")
    assert float({r.name: r for r in vault.list()}[best_before].metadata["keras.best"]) == min(
        history.history["val_loss"]
    )

    resumed = build(5, lr)
    start = restore(resumable, resumed, "epoch-0003")
    fresh_keras = oracle(tmp_path / "fresh", "val_loss")  # keras-team/keras#17012: no memory
    fit(resumed, [VaultCheckpoint(vault, save_best_only=True), fresh_keras], initial_epoch=start)
    assert vault_epochs(vault) == expected  # the resumed part saved what the straight run did
    assert keras_epochs(tmp_path / "fresh")[0] == 4  # a fresh ModelCheckpoint saves a worse epoch
    assert_best_is_keras_best(vault, tmp_path / "k", straight)
    if lr == 1.0:  # every resumed epoch is worse than epoch 2's: the best stays
        assert expected == [1, 2] and vault.resolve("best") == best_before


def test_keep_retains_the_best(tmp_path: Path) -> None:
    vault = Vault(tmp_path / "v")
    model = build(0, lr=1.0)
    fit(model, [oracle(tmp_path / "k", "val_loss"), VaultCheckpoint(vault, keep=1)])
    best = keras_epochs(tmp_path / "k")[-1]
    assert best < EPOCHS
    assert vault_epochs(vault) == [best, EPOCHS]
    assert_best_is_keras_best(vault, tmp_path / "k", model)
    vault.retain(keep_last=1)
    vault.gc()
    assert vault_epochs(vault) == [best, EPOCHS]
    assert_best_is_keras_best(vault, tmp_path / "k", model)


def test_vault_best_reads_the_marked_checkpoint(tmp_path: Path) -> None:
    vault = Vault(tmp_path / "v")
    assert vault_best(vault, "val_loss") is None  # no vault yet
    history = fit(build(0, lr=1.0), [VaultCheckpoint(vault)], epochs=3)
    best = min(history.history["val_loss"])
    assert vault_best(vault, "val_loss") == (best, "min")
    assert vault_best(vault, "val_loss", "max") is None  # recorded as min
    assert vault_best(vault, "val_accuracy") is None  # another monitor
    vault.unmark("best")  # the newest checkpoint's best of the run then
    assert vault_best(vault, "val_loss") == (best, "min")


#: Values where float32 ties, NaN and infinities decide.
POOL = [0.1, 0.1 + 1e-12, 0.1 + 1e-9, 0.2, -0.5, 0.0, -0.0, math.inf, -math.inf, math.nan]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    values=st.lists(
        st.one_of(st.none(), st.sampled_from(POOL), st.floats(-10, 10, width=32)), max_size=12
    ),
    mode=st.sampled_from(["min", "max"]),
    save_best_only=st.booleans(),
    threshold=st.one_of(st.none(), st.sampled_from(POOL[:6])),
)
def test_decisions_match_model_checkpoint(
    tmp_path: Path, values: list[float | None], mode: str, save_best_only: bool,
    threshold: float | None,
) -> None:  # fmt: skip
    theirs = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "x.keras"), monitor="m", mode=mode, save_best_only=True,
        initial_value_threshold=threshold,
    )  # fmt: skip
    theirs._set_monitor_op()
    ours = VaultCheckpoint(
        tmp_path / "v", monitor="m", mode=mode, save_best_only=save_best_only,
        initial_value_threshold=threshold,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for value in values:
            logs = {} if value is None else {"m": value}
            best = theirs._should_save_model(0, None, logs, "x.keras")
            assert ours._decide(logs, "e", 1) == (
                best or not save_best_only,
                best and value is not None,
            )
            assert repr(ours.best) == repr(theirs.best)
