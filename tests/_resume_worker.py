"""A small GPT-2 training run, split so that its second half can run in a new process.

``python _resume_worker.py SOURCE KIND OUT`` builds the model from another seed, an
optimizer whose parameters are in reversed order, loads the checkpoint (``KIND`` is
``file`` or ``vault``), trains the remaining steps, saves the next vault checkpoint when
resuming from a vault, and writes parameters and optimizer state to ``OUT``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import weightvault
import weightvault.torch as wv

hf_logging.set_verbosity_error()
STEPS = 6
HALF = 3


def build(seed: int) -> tuple[GPT2LMHeadModel, torch.optim.Optimizer, object]:
    """Tied embedding, dropout on, block 0 frozen, AdamW with weight decay, LR warm-up."""
    # One thread in both processes: reductions split across threads round differently.
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=97, n_positions=16, resid_pdrop=0.2,
        embd_pdrop=0.2, attn_pdrop=0.2,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.train()
    wv.freeze(model, "transformer.h.0")
    params = wv.trainable(model)
    if seed != 0:
        params = params[::-1]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return model, optimizer, scheduler


def train(
    model: GPT2LMHeadModel, optimizer: torch.optim.Optimizer, scheduler: object, steps: range
) -> None:
    for step in steps:
        batch = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()  # type: ignore[attr-defined]


def dump(model: GPT2LMHeadModel, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Parameters and optimizer state by name, in a file (no ties, so every name is kept)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            out[f"state/{names[id(p)]}/{key}"] = value.detach().clone().reshape(-1)
    wv.save(out, path, dedupe_copies=False)


def main(source: str, kind: str, out: str) -> None:
    model, optimizer, scheduler = build(seed=999)
    options = {"optimizer": optimizer, "scheduler": scheduler, "rng": True}
    if kind == "vault":
        vault = weightvault.Vault(source)
        report = vault.load(model, "latest", **options)
    else:
        report = wv.load(model, source, **options)
    assert report.optimizer is not None and report.optimizer.ok, report.optimizer
    train(model, optimizer, scheduler, range(HALF, STEPS))
    if kind == "vault":
        vault.save(model, optimizer=optimizer, scheduler=scheduler, rng=True)
    dump(model, optimizer, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
