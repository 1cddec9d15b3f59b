"""A tiny Lightning fit, shared by the tests and run as a worker process.

``python _lightning_worker.py ROOT CKPT OUT [VAULT]`` fits from seed 5 to the end, resuming
from ``CKPT`` (Lightning's own file, or with ``VAULT`` the same path through
``VaultCheckpointIO``), and saves the final parameters to ``OUT``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import weightvault
import weightvault.torch as wv
from weightvault.integrations.lightning import VaultCheckpointIO

# The parent test passes its thread count: a reduction split over other threads rounds
# differently, and the comparisons are bitwise.
if "WEIGHTVAULT_TEST_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["WEIGHTVAULT_TEST_THREADS"]))

EPOCHS = 3


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 2)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return [opt], [sched]

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(3)
        data = torch.utils.data.TensorDataset(
            torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)
        )
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)


def fit(root: Path, *, vault: weightvault.Vault | str | os.PathLike[str] | None = None,
        ckpt: str | None = None, seed: int = 0, training_state_last: int | None = None,
) -> Tiny:  # fmt: skip
    L.seed_everything(seed, verbose=False)
    model = Tiny()
    trainer = L.Trainer(
        default_root_dir=str(root), max_epochs=EPOCHS, accelerator="cpu", devices=1,
        deterministic=True, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=str(root / "ckpts"), every_n_epochs=1, save_top_k=-1)],
        plugins=[VaultCheckpointIO(vault, training_state_last=training_state_last)]
        if vault is not None else None,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt)
    return model


def params(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.named_parameters()}


def main() -> None:
    root, ckpt, out = sys.argv[1:4]
    vault = sys.argv[4] if len(sys.argv) > 4 else None  # a path: VaultCheckpointIO opens it
    model = fit(Path(root), vault=vault, ckpt=ckpt, seed=5)
    wv.save(params(model), out)
    os._exit(0)


if __name__ == "__main__":
    main()
