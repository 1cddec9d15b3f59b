"""Fine-tune GPT-2's last block with a frozen backbone, checkpointing into a vault.

This is what ``make demo`` runs. It builds GPT-2 small (124M parameters) from its config
with random weights (nothing is downloaded), freezes everything but the last block and
the final LayerNorm, trains on synthetic tokens, and saves a checkpoint into
``./demo-vault`` every few steps. Only the trained tensors cost new bytes; the frozen
backbone is stored once. At the end it reloads the last checkpoint into a fresh model and
checks that the outputs are identical.

Run it with ``make demo`` or ``.venv/bin/python examples/finetune.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import weightvault
import weightvault.torch as wv
from weightvault._cli_vault import plot

MiB = 2**20


def build(seed: int, tiny: bool = False) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500) if tiny else GPT2Config()
    model = GPT2LMHeadModel(config)
    model.eval()  # no dropout, so two identical models give identical outputs
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps")
    parser.add_argument("--every", type=int, default=2, help="save every N steps")
    parser.add_argument("--vault", default="demo-vault", help="where the vault lives")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2, for smoke tests")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    hf_logging.set_verbosity_error()

    model = build(seed=0, tiny=args.tiny)
    last = model.config.n_layer - 1
    everything = wv.freeze(model)
    head = wv.unfreeze(model, f"transformer.h.{last}.*", "transformer.ln_f.*")
    trainable = wv.trainable(model)
    n_train = sum(p.numel() for p in trainable)
    n_all = sum(p.numel() for p in model.parameters())
    print(
        f"GPT-2: {n_all / 1e6:.1f}M parameters; frozen {len(everything) - len(head)} "
        f"names, training {len(head)} names ({n_train / 1e6:.1f}M parameters)"
    )

    if os.path.exists(args.vault):
        shutil.rmtree(args.vault)  # a fresh run each time the demo is started
    vault = weightvault.Vault(args.vault)
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (8, 4, 32), generator=generator)

    started = time.perf_counter()
    save_seconds = 0.0
    for step in range(1, args.steps + 1):
        batch = tokens[step % len(tokens)]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.every == 0:
            t = time.perf_counter()
            record = vault.save(model, metadata={"step": str(step), "loss": f"{loss.item():.4f}"})
            save_seconds += time.perf_counter() - t
            print(
                f"  step {step:3d}  loss {loss.item():.4f}  saved {record.name}: "
                f"{record.new_bytes / MiB:7.1f} MiB new"
            )
    print(
        f"trained {args.steps} steps in {time.perf_counter() - started:.1f} s "
        f"(of which saving {save_seconds:.2f} s)\n"
    )

    records = vault.list()
    rows = [("checkpoint", "step", "logical MiB", "new MiB", "vault MiB", "files MiB")]
    vault_total = files_total = 0
    for r in records:
        vault_total += r.new_bytes
        files_total += r.stored_bytes
        rows.append(
            (
                r.name,
                r.metadata["step"],
                f"{r.logical_bytes / MiB:.1f}",
                f"{r.new_bytes / MiB:.1f}",
                f"{vault_total / MiB:.1f}",
                f"{files_total / MiB:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    disk = vault.disk_bytes()
    print(
        f"\nvault on disk: {disk / MiB:.1f} MiB; {len(records)} separate safetensors files: "
        f"{files_total / MiB:.1f} MiB ({files_total / disk:.1f}x more)"
    )

    fresh = build(seed=123, tiny=args.tiny)
    batch = tokens[0]
    with torch.no_grad():
        before = fresh(batch).logits
        expected = model(batch).logits
    report = vault.load(fresh, "latest", restore_frozen=True)
    with torch.no_grad():
        after = fresh(batch).logits
    same = torch.equal(after, expected)
    print(
        f"reloaded {records[-1].name} into a fresh GPT-2: {len(report.loaded)} names loaded, "
        f"{len(report.frozen)} frozen again, missing={report.missing}, "
        f"unexpected={report.unexpected}"
    )
    print(
        f"outputs identical to the trained model: {same} "
        f"(max abs difference before loading {float((before - expected).abs().max()):.3f})"
    )
    png = plot(vault, os.path.join(args.vault, "bytes.png"))
    print(f"picture of bytes on disk: {png}")
    if not same:
        raise SystemExit("reloaded outputs differ")


if __name__ == "__main__":
    main()
