"""``mirror=`` in the Lightning plugin and the Keras callback: every checkpoint the loop
saved is on the mirror when ``fit`` returns, local retention deletes locally only, and a
mirror that cannot take checkpoints warns without failing the run."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from weightvault import Vault

sys.path.insert(0, str(Path(__file__).parent))

#: Lightning's files of the unmirrored run (``_lightning_worker.fit``, 3 epochs of 4 steps).
FILES = ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt"]
NAMES = ["epoch_0-step_4", "epoch_1-step_8", "epoch_2-step_12"]


def _objects(vault: Vault, name: str) -> dict[str, str]:
    with vault.open(name) as ckpt:
        return dict(ckpt.objects)


def _unusable(tmp_path: Path, kind: str) -> tuple[Path, dict[str, bytes]]:
    """A mirror destination no push can use, and what it holds (to check it is untouched)."""
    if kind == "file":
        target = tmp_path / "mirror"
        target.write_bytes(b"not a vault")
        return target, {"": target.read_bytes()}
    target = tmp_path / "data"
    (target / "logs").mkdir(parents=True)
    (target / "logs" / "run.txt").write_text("someone else's files")
    return target, _tree(target)


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def _still(target: Path, before: dict[str, bytes]) -> None:
    if target.is_file():
        assert {"": target.read_bytes()} == before
    else:
        assert _tree(target) == before


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "weightvault"
        and r.levelno == logging.WARNING
        and r.getMessage().startswith("mirror ")
    ]


# -- Lightning ---------------------------------------------------------------------------


def _lightning_fit(root: Path, io: Any, save_top_k: int) -> Any:
    """``_lightning_worker.fit``'s run (seed 0, so it matches the unmirrored run bit for
    bit), with ``io`` as the plugin and ``save_top_k`` for ModelCheckpoint."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import _lightning_worker as lw

    L.seed_everything(0, verbose=False)
    model = lw.Tiny()
    trainer = L.Trainer(
        default_root_dir=str(root), max_epochs=lw.EPOCHS, accelerator="cpu", devices=1,
        deterministic=True, logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=str(root / "ckpts"), every_n_epochs=1,
                                   save_top_k=save_top_k)],
    )  # fmt: skip
    trainer.fit(model)
    return model


def _bits(t: Any) -> Any:
    import torch

    # Bytes, not values: torch.equal takes -0.0 for 0.0.
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_lightning_equal(theirs: dict[str, Any], ours: dict[str, Any], where: str) -> None:
    """``ours`` (read from a vault) holds Lightning's own checkpoint ``theirs`` bitwise:
    weights, optimizer state and the loops' progress."""
    import torch

    assert sorted(theirs["state_dict"]) == sorted(ours["state_dict"]), where
    for key, value in theirs["state_dict"].items():
        assert torch.equal(_bits(value), _bits(ours["state_dict"][key])), (where, key)
    assert ours["loops"] == theirs["loops"], where
    mine, own = ours["optimizer_states"][0], theirs["optimizer_states"][0]
    assert mine["param_groups"] == own["param_groups"], where
    assert sorted(mine["state"]) == sorted(own["state"]), where
    for i, state in own["state"].items():
        for k, v in state.items():
            assert torch.equal(_bits(v), _bits(mine["state"][i][k])), (where, i, k)


@pytest.fixture(scope="module")
def lightning_own(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Lightning's own checkpoint files of the run, read back: the oracle."""
    pytest.importorskip("lightning")
    import torch

    import _lightning_worker as lw

    root = tmp_path_factory.mktemp("own")
    lw.fit(root)
    assert sorted(p.name for p in (root / "ckpts").glob("*.ckpt")) == FILES
    return {
        n: torch.load(root / "ckpts" / f, weights_only=True)
        for n, f in zip(NAMES, FILES, strict=True)
    }


def test_lightning_mirror_gets_every_checkpoint_whole_while_training_state_last_trims_locally(
    tmp_path: Path, lightning_own: dict[str, dict[str, Any]]
) -> None:
    """``training_state_last=1`` drops the older checkpoints' optimizer state locally; the
    mirror keeps every checkpoint as it committed, resumable, equal to Lightning's files."""
    from weightvault.integrations.lightning import VaultCheckpointIO

    io = VaultCheckpointIO(tmp_path / "local", training_state_last=1, mirror=tmp_path / "mirror")
    _lightning_fit(tmp_path / "run", io, save_top_k=-1)
    local, remote = Vault(tmp_path / "local"), Vault(tmp_path / "mirror")
    assert [(r.name, r.weights_only) for r in local.list()] == [
        (NAMES[0], True), (NAMES[1], True), (NAMES[2], False)
    ]  # fmt: skip
    assert [(r.name, r.weights_only) for r in remote.list()] == [(n, False) for n in NAMES]
    assert remote.verify().ok and local.verify().ok
    assert _objects(remote, NAMES[2]) == _objects(local, NAMES[2])
    for name in NAMES[:2]:
        # Locally weights only: a subset of what the mirror got, under the same digests.
        assert _objects(local, name).items() < _objects(remote, name).items(), name
    mirrored = VaultCheckpointIO(remote)
    for name, file in zip(NAMES, FILES, strict=True):
        _assert_lightning_equal(lightning_own[name], mirrored.load_checkpoint(file), name)
    _assert_lightning_equal(
        lightning_own[NAMES[2]], VaultCheckpointIO(local).load_checkpoint(FILES[2]), "local"
    )


def test_lightning_save_top_k_deletes_locally_only(
    tmp_path: Path, lightning_own: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save_top_k=1`` removes the previous checkpoint through the plugin after each save;
    the mirror, which never deletes, still gets each one, even when pushing a checkpoint
    takes longer than an epoch (as to S3 it often does)."""
    import weightvault._vault.travel.mirror as mirror_module
    from weightvault.integrations.lightning import VaultCheckpointIO

    removed = threading.Event()

    class Removing(VaultCheckpointIO):  # type: ignore[misc]
        def remove_checkpoint(self, path: Any) -> None:
            super().remove_checkpoint(path)
            removed.set()

    real = mirror_module.transfer

    def slow(*args: Any, **kwargs: Any) -> Any:
        # A network slower than one epoch: the first push starts once Lightning has
        # removed a checkpoint (bounded, so a run that never removes one still ends).
        removed.wait(timeout=30)
        return real(*args, **kwargs)

    monkeypatch.setattr(mirror_module, "transfer", slow)
    io = Removing(tmp_path / "local", mirror=tmp_path / "mirror")
    _lightning_fit(tmp_path / "run", io, save_top_k=1)
    assert removed.is_set()
    local = Vault(tmp_path / "local")
    assert [r.name for r in local.list()] == NAMES[-1:] and local.verify().ok
    remote = Vault(tmp_path / "mirror")
    assert [r.name for r in remote.list()] == NAMES
    assert remote.verify().ok
    assert _objects(remote, NAMES[2]) == _objects(local, NAMES[2])
    mirrored = VaultCheckpointIO(remote)
    for name, file in zip(NAMES, FILES, strict=True):
        _assert_lightning_equal(lightning_own[name], mirrored.load_checkpoint(file), name)


@pytest.mark.parametrize("kind", ["file", "folder of other data"])
def test_lightning_unusable_mirror_warns_and_the_run_completes(
    tmp_path: Path,
    kind: str,
    lightning_own: dict[str, dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    from weightvault.integrations.lightning import VaultCheckpointIO

    target, before = _unusable(tmp_path, kind)
    io = VaultCheckpointIO(tmp_path / "local", mirror=target)
    with caplog.at_level(logging.WARNING, logger="weightvault"):
        _lightning_fit(tmp_path / "run", io, save_top_k=-1)
    warned = _warnings(caplog)
    assert warned and all("could not push" in w for w in warned), warned
    # Each checkpoint is warned about once, however many pushes retried it.
    assert sorted(n for n in NAMES if any(n in w for w in warned)) == NAMES, warned
    assert sum(w.count(NAMES[0]) for w in warned) == 1, warned
    _still(target, before)
    local = Vault(tmp_path / "local")
    assert [r.name for r in local.list()] == NAMES and local.verify().ok
    reader = VaultCheckpointIO(local)
    for name, file in zip(NAMES, FILES, strict=True):
        _assert_lightning_equal(lightning_own[name], reader.load_checkpoint(file), name)


# -- Keras -------------------------------------------------------------------------------

KERAS_EPOCHS = ["epoch-0001", "epoch-0002", "epoch-0003"]


def _keras_model(seed: int) -> Any:
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(hidden))
    model.compile(optimizer="adam", loss="mse")
    return model


def _keras_state(model: Any) -> list[bytes]:
    """The bytes of every model variable, then of every optimizer variable, in order (the
    optimizer's paths carry a per-process counter, so two models' do not match by path)."""
    import keras

    variables = [*model.variables, *model.optimizer.variables]
    return [keras.ops.convert_to_numpy(v).tobytes() for v in variables]


def _keras_fit(callback: Any) -> dict[str, list[bytes]]:
    """Three epochs of two steps; the state each epoch ended with, by checkpoint name."""
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 16)).astype("float32")
    y = rng.normal(size=(16, 4)).astype("float32")
    model = _keras_model(0)
    seen: dict[str, list[bytes]] = {}
    capture = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.update(
            {f"epoch-{epoch + 1:04d}": _keras_state(model)}
        )
    )
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[callback, capture])  # fmt: skip
    return seen


def test_keras_mirror_gets_every_checkpoint_and_keep_deletes_locally_only(tmp_path: Path) -> None:
    """``keep=1`` leaves the newest locally; the mirror holds all three, each restoring the
    weights and optimizer state its epoch ended with."""
    pytest.importorskip("keras")
    from weightvault.integrations.keras import VaultCheckpoint, restore

    callback = VaultCheckpoint(tmp_path / "local", keep=1, mirror=tmp_path / "mirror")
    seen = _keras_fit(callback)
    assert sorted(seen) == KERAS_EPOCHS
    local, remote = Vault(tmp_path / "local"), Vault(tmp_path / "mirror")
    assert [r.name for r in local.list()] == KERAS_EPOCHS[-1:]
    assert [r.name for r in remote.list()] == KERAS_EPOCHS
    assert remote.verify().ok and local.verify().ok
    assert _objects(remote, KERAS_EPOCHS[-1]) == _objects(local, KERAS_EPOCHS[-1])
    for i, name in enumerate(KERAS_EPOCHS):
        fresh = _keras_model(1 + i)
        assert restore(remote, fresh, name) == i + 1
        assert _keras_state(fresh) == seen[name], name
    fresh = _keras_model(9)
    restore(local, fresh, KERAS_EPOCHS[-1])
    assert _keras_state(fresh) == seen[KERAS_EPOCHS[-1]]


@pytest.mark.parametrize("kind", ["file", "folder of other data"])
def test_keras_unusable_mirror_warns_and_the_run_completes(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("keras")
    from weightvault.integrations.keras import VaultCheckpoint, restore

    target, before = _unusable(tmp_path, kind)
    callback = VaultCheckpoint(tmp_path / "local", keep=2, mirror=target)
    with caplog.at_level(logging.WARNING, logger="weightvault"):
        seen = _keras_fit(callback)
    warned = _warnings(caplog)
    assert warned and all("could not push" in w for w in warned), warned
    assert sorted(n for n in KERAS_EPOCHS if any(n in w for w in warned)) == KERAS_EPOCHS
    _still(target, before)
    # Retention went on without the mirror: the local disk does not wait for it.
    local = Vault(tmp_path / "local")
    assert [r.name for r in local.list()] == KERAS_EPOCHS[-2:] and local.verify().ok
    assert not callback.vault.spared
    for name in KERAS_EPOCHS[-2:]:
        fresh = _keras_model(5)
        restore(local, fresh, name)
        assert _keras_state(fresh) == seen[name], name
