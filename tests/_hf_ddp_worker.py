"""A tiny Hugging Face Trainer run under ``torchrun`` (DDP, gloo, CPU), as users launch it.

``torchrun --nproc_per_node=2 _hf_ddp_worker.py MODE OUT [NAME]``:

- ``run``: trains from seed 0 twice, without the callback (the Trainer's own folders) and
  with ``VaultCallback(OUT/vault)``. Rank 0 writes both runs' final parameters
  (``own.safetensors``, ``vaulted.safetensors``); every rank writes the vault saves it
  made (``saves-<rank>.json``). Then the vault's storage fails (a full disk) on rank 0 at
  step 4, in a run with foreground and one with background saves; every rank writes
  what it raised (``error-<mode>-<rank>.json``).
- ``resume``: builds the model from seed 7 and resumes from vault checkpoint ``NAME``
  through ``resume``; rank 0 writes ``resumed.safetensors``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).parent))
import weightvault.torch as wv
from _ddp_helpers import count_saves, fail_on_rank0, raised, rank
from weightvault.integrations.transformers import VaultCallback, resume

STEPS = 6


def model(seed: int) -> GPT2LMHeadModel:
    """A tied two-block GPT-2 with dropout; its lowest block frozen."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )  # fmt: skip
    m = GPT2LMHeadModel(config)
    for p in m.transformer.h[0].parameters():
        p.requires_grad_(False)
    return m


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    ids = [torch.randint(0, 100, (8,), generator=g) for _ in range(48)]
    return [{"input_ids": i, "labels": i.clone()} for i in ids]


def trainer(m: torch.nn.Module, folder: Path, callbacks: list[Any]) -> Trainer:
    args = TrainingArguments(
        output_dir=str(folder), max_steps=STEPS, save_steps=2, per_device_train_batch_size=4,
        learning_rate=1e-3, weight_decay=0.1, warmup_steps=3, logging_steps=100, report_to=[],
        use_cpu=True, ddp_backend="gloo", seed=0, dataloader_num_workers=0,
        save_strategy="steps", disable_tqdm=True,
    )  # fmt: skip
    return Trainer(model=m, args=args, train_dataset=dataset(), callbacks=callbacks)


def write_params(m: torch.nn.Module, path: Path) -> None:
    if rank() == 0:
        wv.save({k: v.detach().clone() for k, v in m.named_parameters()}, path)


def straight(out: Path) -> None:
    m = model(0)
    trainer(m, out / "own", []).train()
    write_params(m, out / "own.safetensors")
    names = count_saves()
    m = model(0)
    trainer(m, out / "run", [VaultCallback(out / "vault")]).train()
    write_params(m, out / "vaulted.safetensors")
    (out / f"saves-{rank()}.json").write_text(json.dumps(names))


def fail(out: Path) -> None:
    fail_on_rank0("checkpoint-4")
    for background in (False, True):
        mode = "background" if background else "foreground"
        callback = VaultCallback(out / f"vault-{mode}", background=background)
        error = None
        try:
            trainer(model(0), out / f"run-{mode}", [callback]).train()
        except Exception as e:
            error = e
        (out / f"error-{mode}-{rank()}.json").write_text(json.dumps(raised(error)))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "run":
        straight(out)
        fail(out)  # the process group outlives a failed save: every rank raised alike
    else:
        m = model(7)
        vault = out / "vault"
        resume(trainer(m, out / "again", [VaultCallback(vault)]), vault, sys.argv[3])
        write_params(m, out / "resumed.safetensors")
    sys.stdout.flush()
    os._exit(0)  # no teardown of the Trainer's threads in a short-lived worker


if __name__ == "__main__":
    main()
