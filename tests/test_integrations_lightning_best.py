"""Lightning's best checkpoints through ``VaultCheckpointIO``, against its own files.

The same seeded run is fitted twice in one test, once with Lightning's default
``CheckpointIO`` (its ``.ckpt`` files are the oracle) and once with the vault's:
``ModelCheckpoint(monitor=..., save_top_k=k)`` keeps the same checkpoints with the same
scores, each with bitwise equal weights, and ``trainer.validate(ckpt_path=
checkpoint_callback.best_model_path)`` loads the best one's weights into the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import weightvault
from weightvault.integrations.lightning import VaultCheckpointIO, checkpoint_name

EPOCHS = 8
TOP_K = 2


class Classifier(L.LightningModule):
    """Two classes of noisy points; a high SGD rate makes validation go up and down."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1.5, momentum=0.9)

    def _data(self, seed: int) -> Any:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(48, 8, generator=g)
        y = ((x[:, 0] - x[:, 1] + 0.5 * torch.randn(48, generator=g)) > 0).long()
        return torch.utils.data.TensorDataset(x, y)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self._data(3), batch_size=16, shuffle=False)

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self._data(4), batch_size=48)


def run(root: Path, monitor: str, mode: str, vault: weightvault.Vault | None) -> Any:
    L.seed_everything(0, verbose=False)
    model = Classifier()
    checkpoint_callback = ModelCheckpoint(
        dirpath=str(root / "ckpts"), monitor=monitor, mode=mode, save_top_k=TOP_K
    )
    trainer = L.Trainer(
        default_root_dir=str(root), max_epochs=EPOCHS, accelerator="cpu", devices=1,
        deterministic=True, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[checkpoint_callback],
        plugins=[VaultCheckpointIO(vault)] if vault is not None else None,
    )  # fmt: skip
    trainer.fit(model)
    return trainer, model, checkpoint_callback


def by_name(scores: dict[str, Any]) -> dict[str, float]:
    return {Path(p).name: float(s) for p, s in scores.items()}


@pytest.mark.parametrize(("monitor", "mode"), [("val_loss", "min"), ("val_acc", "max")])
def test_save_top_k_keeps_lightnings_best_and_validate_loads_it(
    tmp_path: Path, monitor: str, mode: str
) -> None:
    own_trainer, own_model, own = run(tmp_path / "own", monitor, mode, None)
    kept = sorted(p.name for p in (tmp_path / "own" / "ckpts").glob("*.ckpt"))
    assert len(kept) == TOP_K and sorted(by_name(own.best_k_models)) == kept
    last = sorted(f"epoch={e}-step={3 * (e + 1)}.ckpt" for e in range(EPOCHS - TOP_K, EPOCHS))
    assert kept != last  # the metric, not the order, chose them

    vault = weightvault.Vault(tmp_path / "vault")
    trainer, model, ours = run(tmp_path / "vaulted", monitor, mode, vault)
    assert not list((tmp_path / "vaulted").rglob("*.ckpt"))
    assert sorted(r.name for r in vault.list()) == sorted(checkpoint_name(f) for f in kept)
    assert by_name(ours.best_k_models) == by_name(own.best_k_models)  # same steps, same scores
    assert Path(ours.best_model_path).name == Path(own.best_model_path).name
    assert float(ours.best_model_score) == float(own.best_model_score)

    io = VaultCheckpointIO(vault)
    for name in kept:
        theirs = torch.load(tmp_path / "own" / "ckpts" / name, weights_only=True)["state_dict"]
        back = io.load_checkpoint(tmp_path / "vaulted" / "ckpts" / name)["state_dict"]
        assert sorted(back) == sorted(theirs)
        for key, value in theirs.items():
            assert back[key].dtype == value.dtype and torch.equal(back[key], value), (name, key)

    # validate with the best: the model ends holding its weights, on both sides.
    best = torch.load(own.best_model_path, weights_only=True)["state_dict"]
    assert any(not torch.equal(v, best[f"net.{k}"]) for k, v in model.net.state_dict().items())
    theirs_metrics = own_trainer.validate(own_model, ckpt_path=own.best_model_path, verbose=False)
    ours_metrics = trainer.validate(model, ckpt_path=ours.best_model_path, verbose=False)
    assert ours_metrics == theirs_metrics
    assert ours_metrics[0][monitor] == float(own.best_model_score)
    for key, value in model.state_dict().items():
        assert torch.equal(value, best[key]), key
    # ckpt_path="best" is the same checkpoint.
    assert trainer.validate(model, ckpt_path="best", verbose=False) == theirs_metrics
