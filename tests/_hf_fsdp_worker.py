"""The Hugging Face Trainer on an FSDP2 model under ``torchrun`` (2 processes, gloo, CPU).

transformers shards the model as it loads it (``distributed_config=DistributedConfig(
fsdp_size=2)``), the one way the Trainer trains FSDP2 on CPUs (accelerate's FSDP plugin
needs an accelerator). ``torchrun --nproc_per_node=2 _hf_fsdp_worker.py MODE OUT [NAME]``:

- ``run``: trains from ``OUT/init-0`` for 6 steps without the callback, then with
  ``VaultCallback(OUT/vault)`` (saves at steps 2, 4, 6); rank 0 writes both runs' final
  parameters, gathered (``own.safetensors``, ``vaulted.safetensors``). Last, rank 1's
  disk fills once ``checkpoint-2`` is in ``OUT/vault-failing``; every rank writes what
  it raised (``error-<rank>.json``).
- ``resume``: loads ``OUT/init-7`` (other weights) and resumes from vault checkpoint
  ``NAME`` in a new launch; rank 0 writes ``resumed.safetensors``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig

sys.path.insert(0, str(Path(__file__).parent))
import weightvault
import weightvault.torch as wv
from _ddp_helpers import raised, rank
from weightvault.integrations.transformers import VaultCallback, resume

STEPS = 6


def model(folder: Path) -> GPT2LMHeadModel:
    return GPT2LMHeadModel.from_pretrained(
        str(folder), distributed_config=DistributedConfig(fsdp_size=2)
    )


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    ids = [torch.randint(0, 100, (8,), generator=g) for _ in range(48)]
    return [{"input_ids": i, "labels": i.clone()} for i in ids]


def trainer(m: torch.nn.Module, folder: Path, callbacks: list[Any], save: str) -> Trainer:
    args = TrainingArguments(
        output_dir=str(folder), max_steps=STEPS, save_steps=2, per_device_train_batch_size=4,
        learning_rate=1e-3, weight_decay=0.1, warmup_steps=3, logging_steps=100, report_to=[],
        use_cpu=True, ddp_backend="gloo", seed=0, dataloader_num_workers=0,
        save_strategy=save, save_only_model=True, disable_tqdm=True,
    )  # fmt: skip
    return Trainer(model=m, args=args, train_dataset=dataset(), callbacks=callbacks)


def write_params(m: torch.nn.Module, path: Path) -> None:
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in m.named_parameters()
    }  # collective: every rank gathers
    if rank() == 0:
        wv.save(full, path)


def failing(root: Path) -> weightvault.Vault:
    """A vault whose objects cannot be written on rank 1 once ``checkpoint-2`` is in it."""
    vault = weightvault.Vault(root)
    real = vault.store.stage

    def stage(key: str, data: Any) -> Any:  # every object write (Store.stage)
        full = vault.store.exists("checkpoints/checkpoint-2.json")
        if rank() == 1 and full:
            raise OSError(28, "No space left on device")
        return real(key, data)

    vault.store.stage = stage  # type: ignore[method-assign]
    return vault


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "run":
        m = model(out / "init-0")
        trainer(m, out / "own", [], "no").train()
        write_params(m, out / "own.safetensors")
        m = model(out / "init-0")
        trainer(m, out / "run", [VaultCallback(out / "vault")], "steps").train()
        write_params(m, out / "vaulted.safetensors")
        callback = VaultCallback(failing(out / "vault-failing"))
        error = None
        try:
            trainer(model(out / "init-0"), out / "failing", [callback], "steps").train()
        except Exception as e:  # what a training script catches
            error = e
        (out / f"error-{rank()}.json").write_text(json.dumps(raised(error)))
    else:
        m = model(out / "init-7")
        t = trainer(m, out / "again", [VaultCallback(out / "vault")], "steps")
        resume(t, out / "vault", sys.argv[3])
        write_params(m, out / "resumed.safetensors")
    sys.stdout.flush()
    os._exit(0)  # no teardown of the Trainer's threads in a short-lived worker


if __name__ == "__main__":
    main()
