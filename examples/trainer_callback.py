"""Fine-tune with the Hugging Face Trainer, checkpointing into a vault instead of folders.

A small GPT-2 (random weights, nothing downloaded) with its lowest blocks frozen trains
for a few steps; ``VaultCallback`` stores each checkpoint the Trainer decides on in
``./trainer-vault``. The frozen blocks are stored once, so later checkpoints cost only the
trained weights and their AdamW state. Then a fresh model built from another seed resumes
from the middle checkpoint with ``resume`` and ends bitwise equal to the first run.

Run it with ``.venv/bin/python examples/trainer_callback.py [--vault DIR]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import weightvault
import weightvault.torch as wv
from weightvault.integrations.transformers import VaultCallback, resume


def build(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1000))
    wv.freeze(model, "transformer.h.0.*", "transformer.h.1.*")
    return model


def trainer(model: GPT2LMHeadModel, vault: weightvault.Vault, out: str) -> Trainer:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 1000, (32,), generator=g) for _ in range(32)]
    args = TrainingArguments(
        output_dir=out, max_steps=8, save_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-3, weight_decay=0.1, warmup_steps=2, report_to=[], use_cpu=True,
        logging_steps=1000, disable_tqdm=True,
    )  # fmt: skip
    data = [{"input_ids": x, "labels": x.clone()} for x in ids]
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[VaultCallback(vault)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vault", default="trainer-vault")
    a = ap.parse_args()
    shutil.rmtree(a.vault, ignore_errors=True)
    vault = weightvault.Vault(a.vault)
    out = tempfile.mkdtemp(prefix="trainer-out-")
    try:
        model = build(0)
        trainer(model, vault, out).train()  # the one-line change: callbacks=[VaultCallback]
        print(f"Trainer folders written: {sorted(os.listdir(out))}")
        trainable = sum(p.numel() * p.element_size() for p in wv.trainable(model))
        for r in vault.list():
            print(f"{r.name:14} new bytes {r.new_bytes / 1e6:6.2f} MB "
                  f"({r.new_bytes / trainable:.2f}x the trainable weights)")  # fmt: skip

        again = build(1)  # other weights: everything comes from the vault
        resume(trainer(again, vault, out), vault, "checkpoint-4")
        same = all(
            torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(), strict=True)
        )
        print(f"resumed from checkpoint-4: parameters bitwise identical: {same}")
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
