"""A small byte-level GPT-2, really trained on text every machine has (for bench_compress.py).

The text is the Python standard library's own source (``os.path.dirname(os.__file__)``),
read as bytes, so the vocabulary is 256 and nothing is downloaded. The model is GPT-2 with
4 blocks of width 256 (about 3.3 M parameters, the head tied to the embedding), trained
with AdamW from a random start. A run has two phases, as a fine-tune does: ``steps_a``
steps at lr 1e-3 (a checkpoint every ``every_a`` steps), then ``steps_b`` steps at lr 3e-5
(every ``every_b``). Each checkpoint is written the way the Hugging Face Trainer writes
one: ``model.safetensors`` (``safetensors.torch.save_model``) plus ``torch.save`` of the
optimizer's, the scheduler's and the RNG's state, each file fsynced.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import fsync_path

SEQ = 128
#: The learning rates of the two phases.
LR_A, LR_B = 1e-3, 3e-5
BATCH = 8
TEXT_BYTES = 4 << 20


def text() -> torch.Tensor:
    """The standard library's top-level ``.py`` files, concatenated, as byte ids."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    data = b"".join(Path(f).read_bytes() for f in files)[:TEXT_BYTES]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def build() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=256, n_positions=SEQ)
    return GPT2LMHeadModel(cfg).train()


def batches(ids: torch.Tensor, seed: int) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, ids.numel() - SEQ - 1, (BATCH,), generator=g)
        yield torch.stack([ids[s : s + SEQ] for s in starts.tolist()])


def optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def save_trainer_style(folder: Path, model: torch.nn.Module, opt: Any, sched: Any) -> float:
    """One Trainer-style checkpoint folder, every file fsynced; returns the seconds taken."""
    from safetensors.torch import save_model

    t0 = time.perf_counter()
    folder.mkdir(parents=True)
    save_model(model, str(folder / "model.safetensors"))
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save(sched.state_dict(), folder / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, folder / "rng_state.pth")
    for f in folder.iterdir():
        fsync_path(str(f))
    return time.perf_counter() - t0


def train(out: Path, steps_a: int, every_a: int, steps_b: int, every_b: int) -> list[Path]:
    """Train, writing a Trainer-style checkpoint folder at each checkpoint; return them.

    The learning rate comes from the scheduler alone: ``LambdaLR`` sets every group's lr
    from its base lr at each ``sched.step()``, so a ``g["lr"] = x`` set by hand lasts one
    step (issue 27 found the lr 3e-5 phase of an earlier version training at 1e-3). The
    lr of every optimizer step is recorded from the optimizer itself and printed with
    each checkpoint.
    """
    torch.set_num_threads(os.cpu_count() or 1)
    model, ids = build(), text()
    opt = optimizer(model, LR_A)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < steps_a else LR_B / LR_A)
    data = batches(ids, 0)
    folders: list[Path] = []
    used: list[float] = []
    step = 0
    for steps, every, phase in ((steps_a, every_a, "a"), (steps_b, every_b, "b")):
        for _ in range(steps):
            batch = next(data)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            used.append(opt.param_groups[0]["lr"])  # what this step really uses
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % every == 0:
                folder = out / f"{phase}-checkpoint-{step}"
                save_trainer_style(folder, model, opt, sched)
                folders.append(folder)
                lrs = sorted({f"{lr:g}" for lr in used[-every:]})
                print(
                    f"step {step} lr of steps {step - every + 1}-{step}: {', '.join(lrs)} "
                    f"loss {loss.item():.3f} -> {folder.name}",
                    flush=True,
                )
    (out / "lr.json").write_text(json.dumps(used))
    return folders


def restore(folder: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The model, optimizer and scheduler as they were at checkpoint ``folder``."""
    from safetensors.torch import load_model

    model = build()
    load_model(model, str(folder / "model.safetensors"))
    opt = optimizer(model, 1e-3)
    opt.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    sched.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))
    return model, opt, sched


class MasterAdamW(torch.optim.Optimizer):
    """The bf16 variant's optimizer: bf16 parameters, fp32 master weights and moments.

    Only its state is used here (filled from an fp32 run by :func:`as_bf16`): a mixed
    precision optimizer keeps exactly these tensors, and the model it trains holds the
    master weights rounded to bf16.
    """

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8})

    def step(self, closure: Any = None) -> None:  # pragma: no cover - state only
        raise NotImplementedError


def as_bf16(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, Any]:
    """The bf16 variant of a checkpoint: bf16 weights, fp32 master weights and moments."""
    import copy

    half = copy.deepcopy(model).to(torch.bfloat16)
    master = MasterAdamW(half.parameters())
    by_name = dict(model.named_parameters())
    for name, p in half.named_parameters():
        st = opt.state[by_name[name]]
        master.state[p] = {
            "step": st["step"].clone(),
            "master": by_name[name].detach().clone(),
            "exp_avg": st["exp_avg"].clone(),
            "exp_avg_sq": st["exp_avg_sq"].clone(),
        }
    return half, master


def checkpoints(root: Path, phase: str) -> list[Path]:
    found = [p for p in root.iterdir() if p.name.startswith(f"{phase}-checkpoint-")]
    return sorted(found, key=lambda p: int(p.name.rsplit("-", 1)[1]))


def checkpoints_exist(root: Path) -> bool:
    return root.is_dir() and bool(checkpoints(root, "a")) and bool(checkpoints(root, "b"))
