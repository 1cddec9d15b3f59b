"""A tiny Lightning fit with ``strategy="ddp"`` under ``torchrun`` (2 processes, gloo, CPU).

``torchrun --nproc_per_node=2 _lightning_ddp_worker.py MODE ROOT``:

- ``run``: fits from seed 5 for 3 epochs twice, with Lightning's own checkpoint files
  (``ROOT/own``) and with ``VaultCheckpointIO(ROOT/vault)`` (``ROOT/vaulted``). Rank 0
  writes both runs' final parameters; every rank writes the vault saves it made. Last
  (rank 0 exits after it), the vault's storage fails (a full disk) on rank 0 at the
  second checkpoint; every rank writes what it raised (``error-<rank>.json``).
- ``resume``: resumes each of the two from its epoch-0 checkpoint, in a model built from
  another seed; rank 0 writes both final parameters.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
import _lightning_worker as lw
import weightvault.torch as wv
from _ddp_helpers import count_saves, fail_on_rank0, raised, rank
from weightvault.integrations.lightning import VaultCheckpointIO

FIRST = "epoch=0-step=2.ckpt"  # 32 samples, batches of 8, over 2 ranks: 2 steps an epoch


class Start(L.Callback):
    """Writes the parameters training starts from (after a resume restored them)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        write_params(pl_module, self.path)


def fit(
    root: Path, *, vault: Path | None = None, ckpt: str | None = None, seed: int = 5,
    start: Path | None = None,
) -> Any:  # fmt: skip
    L.seed_everything(seed, verbose=False)
    model = lw.Tiny()
    trainer = L.Trainer(
        default_root_dir=str(root), max_epochs=lw.EPOCHS, accelerator="cpu", devices=2,
        strategy="ddp", deterministic=True, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(dirpath=str(root / "ckpts"), every_n_epochs=1, save_top_k=-1),
            *([Start(start)] if start else []),
        ],
        plugins=[VaultCheckpointIO(vault)] if vault is not None else None,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt)
    return model


def write_params(model: Any, path: Path) -> None:
    if rank() == 0:
        wv.save(lw.params(model), path)


def straight(root: Path) -> None:
    write_params(fit(root / "own"), root / "own.safetensors")
    names = count_saves()
    write_params(fit(root / "vaulted", vault=root / "vault"), root / "vaulted.safetensors")
    (root / f"saves-{rank()}.json").write_text(json.dumps(names))


def resume(root: Path) -> None:
    ckpt = str(root / "own" / "ckpts" / FIRST)
    own = fit(root / "again-own", ckpt=ckpt, seed=7, start=root / "start-own.safetensors")
    write_params(own, root / "resumed-own.safetensors")
    ckpt = str(root / "vaulted" / "ckpts" / FIRST)  # the path Lightning knows it by
    vaulted = fit(
        root / "again-vault", vault=root / "vault", ckpt=ckpt, seed=7,
        start=root / "start-vault.safetensors",
    )  # fmt: skip
    write_params(vaulted, root / "resumed-vault.safetensors")


def fail(root: Path) -> None:
    fail_on_rank0("epoch_1-step_4")
    error = None
    try:
        fit(root / "failing", vault=root / "vault-failing")
    except Exception as e:
        error = e
    (root / f"error-{rank()}.json").write_text(json.dumps(raised(error)))


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    if mode == "run":
        straight(root)
        fail(root)  # last: the other rank waits at Lightning's barrier until rank 0 exits
    else:
        resume(root)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
