"""A tiny Hugging Face Trainer run, shared by the tests and run as a worker process.

``python _hf_trainer_worker.py VAULT NAME SEED OUT`` builds the model from ``SEED``,
resumes from vault checkpoint ``NAME`` (``resume``, or ``checkout`` when NAME ends in
``:folder``), trains to the end and saves the final parameters to ``OUT``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import weightvault.torch as wv
from weightvault.integrations.transformers import VaultCallback, checkout, resume

# The parent test passes its thread count: a reduction split over other threads rounds
# differently, and the comparisons are bitwise.
if "WEIGHTVAULT_TEST_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["WEIGHTVAULT_TEST_THREADS"]))

STEPS = 6


def model(seed: int, *, frozen: int = 2) -> GPT2LMHeadModel:
    """A tied GPT-2 with dropout; its ``frozen`` lowest blocks frozen."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=512, n_positions=32, n_embd=64, n_layer=3, n_head=2,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, tie_word_embeddings=True,
    )  # fmt: skip
    m = GPT2LMHeadModel(config)
    for block in m.transformer.h[:frozen]:
        for p in block.parameters():
            p.requires_grad_(False)
    return m


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    out = []
    for _ in range(24):
        ids = torch.randint(0, 512, (16,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def args(folder: Path, **overrides: Any) -> TrainingArguments:
    options: dict[str, Any] = dict(
        output_dir=str(folder), max_steps=STEPS, save_steps=2, per_device_train_batch_size=4,
        learning_rate=1e-3, weight_decay=0.1, warmup_steps=3, logging_steps=100,
        report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, save_strategy="steps",
        disable_tqdm=True,
    )  # fmt: skip
    options.update(overrides)
    return TrainingArguments(**options)


def trainer(m: torch.nn.Module, folder: Path, callbacks: list[Any], **overrides: Any) -> Trainer:
    return Trainer(
        model=m, args=args(folder, **overrides), train_dataset=dataset(), callbacks=callbacks
    )


def params(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.named_parameters()}


def main() -> None:
    vault, name, seed, out = sys.argv[1:5]  # the vault as a path, as users pass it
    m = model(int(seed))
    folder = Path(out).parent / "run"
    t = trainer(m, folder, [VaultCallback(vault)])
    if name.endswith(":folder"):
        resumed = checkout(vault, name.removesuffix(":folder"), Path(out).parent / "ckpt")
        t.train(resume_from_checkpoint=str(resumed))
    else:
        resume(t, vault, name)
    wv.save(params(m), out)
    os._exit(0)  # no teardown of the Trainer's threads in a short-lived worker


if __name__ == "__main__":
    main()
