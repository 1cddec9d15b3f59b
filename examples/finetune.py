"""Fine-tune GPT-2's last block with a frozen backbone, checkpointing into a vault.

This is what ``make demo`` runs. It builds GPT-2 small (124M parameters) from its config
with random weights (nothing is downloaded), freezes everything but the last block and
the final LayerNorm, trains with dropout on synthetic tokens, and saves a checkpoint with
the optimizer, the LR scheduler and the RNG states into ``./demo-vault`` every few steps,
in the background. Half-way it simulates a restart: fresh objects (another seed, the
optimizer's parameters in another order) resume from the vault's latest checkpoint, and
the run continues. It checks that losses and parameters are bitwise identical to an
uninterrupted run. Only the trained tensors and their AdamW state cost new bytes; the
frozen backbone is stored once; saves write raw bytes and the vault's compactor then
compresses them and turns older checkpoints into deltas on newer ones. It prints the
bytes saved: each checkpoint's raw bytes against what its objects take on disk, and all
of them against the whole vault. Then it times a save and a resume of model + optimizer
against plain files (``save_model`` + ``torch.save``, fsynced, and ``load_model`` +
``torch.load``). At the end it reloads the last checkpoint into a fresh model and checks
that the outputs are identical.

Run it with ``make demo`` or ``.venv/bin/python examples/finetune.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import weightvault
import weightvault.torch as wv
from weightvault._base.atomic import fsync_file
from weightvault._cli.plot import plot
from weightvault._vault.records.usage import vault_usage

MiB = 2**20


def build(seed: int, tiny: bool = False) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500) if tiny else GPT2Config()
    return GPT2LMHeadModel(config)


def setup(
    seed: int, tiny: bool, reverse: bool = False
) -> tuple[GPT2LMHeadModel, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR, int]:
    """The model with only its last block and ln_f trainable, AdamW and an LR warm-up."""
    model = build(seed, tiny)
    model.train()  # dropout on: resuming exactly needs the RNG state too
    last = model.config.n_layer - 1
    wv.freeze(model)
    head = wv.unfreeze(model, f"transformer.h.{last}.*", "transformer.ln_f.*")
    params = wv.trainable(model)
    # A restarted job may list parameters in another order; state is matched by name.
    optimizer = torch.optim.AdamW(params[::-1] if reverse else params, lr=1e-4, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return model, optimizer, scheduler, len(head)


def train_step(model, optimizer, scheduler, batch) -> float:  # type: ignore[no-untyped-def]
    loss = model(batch, labels=batch).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return float(loss.item())


class Phases:
    """Prints each phase as it starts, with the seconds since the demo started."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.started = total, 0, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def start(self, text: str) -> None:
        self.done += 1
        print(f"\n[{self.done}/{self.total}] {text}  (at {self.elapsed():.0f} s)", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps")
    parser.add_argument("--every", type=int, default=2, help="save every N steps")
    parser.add_argument("--stop", type=int, default=4, help="simulate a restart after this step")
    parser.add_argument("--vault", default="demo-vault", help="where the vault lives")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer GPT-2, for smoke tests")
    return parser.parse_args()


def reference_run(
    args: argparse.Namespace,
    model: GPT2LMHeadModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    tokens: torch.Tensor,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One uninterrupted run without checkpoints: the losses and parameters to match."""
    losses = []
    for s in range(args.steps):
        losses.append(train_step(model, optimizer, scheduler, tokens[s % 8]))
        print(f"  step {s + 1:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def checkpointed_run(
    args: argparse.Namespace, vault: weightvault.Vault, tokens: torch.Tensor
) -> tuple[GPT2LMHeadModel, torch.optim.Optimizer, list[float]]:
    """The same run, saving into ``vault`` in the background and restarting half-way."""
    model, optimizer, scheduler, _ = setup(seed=0, tiny=args.tiny)
    started, save_seconds = time.perf_counter(), 0.0
    losses: list[float] = []
    handle = None
    for step in range(1, args.steps + 1):
        if step == args.stop + 1:
            # Simulate a restart: new objects (another seed, another parameter order),
            # everything restored from the vault's latest checkpoint.
            handle.wait()  # type: ignore[union-attr]
            model, optimizer, scheduler, _ = setup(seed=123, tiny=args.tiny, reverse=True)
            report = vault.load(model, "latest", optimizer=optimizer, scheduler=scheduler, rng=True)
            assert report.optimizer is not None
            print(
                f"  -- restarted: resumed {vault.list()[-1].name} into fresh objects; optimizer "
                f"state for {len(report.optimizer.loaded)} parameters, restored "
                f"{', '.join(report.restored)}",
                flush=True,
            )
        losses.append(train_step(model, optimizer, scheduler, tokens[(step - 1) % 8]))
        note = ""
        if step % args.every == 0:
            t = time.perf_counter()
            meta = {"step": str(step), "loss": f"{losses[-1]:.4f}"}
            # In the background: training goes on while the checkpoint is written.
            handle = vault.save(
                model, optimizer=optimizer, scheduler=scheduler, rng=True, metadata=meta,
                background=True,
            )  # fmt: skip
            save_seconds += time.perf_counter() - t
            record = handle.wait() if step == args.steps else None
            note = "  saving in the background" + (f" (committed {record.name})" if record else "")
        print(f"  step {step:3d}  loss {losses[-1]:.4f}{note}", flush=True)
    assert handle is not None
    handle.wait()
    print(
        f"trained {args.steps} steps in {time.perf_counter() - started:.1f} s "
        f"(of which blocked by saves {save_seconds:.2f} s)"
    )
    return model, optimizer, losses


def print_vault(vault: weightvault.Vault) -> None:
    """Each checkpoint's raw bytes against what its objects take on disk, and the bytes
    saved: all checkpoints' raw bytes against the whole vault on disk."""
    use = vault_usage(vault.store)
    rows = [("checkpoint", "step", "raw MiB", "new MiB", "on disk MiB", "disk/raw")]
    for r, c in zip(use.records, use.checkpoints, strict=True):
        # raw: its distinct tensors uncompressed, as one file would hold them; new: the
        # raw bytes of the objects its save added; on disk: what those take now.
        rows.append(
            (
                r.name,
                r.metadata["step"],
                f"{c.raw_bytes / MiB:.1f}",
                f"{c.new_bytes / MiB:.1f}",
                f"{c.disk_bytes / MiB:.1f}",
                f"{c.disk_bytes / c.raw_bytes:.2f}x",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    raw = use.raw_bytes
    disk = vault.disk_bytes()  # everything: objects and records
    print(
        f"\nbytes saved: {len(use.records)} checkpoints hold {raw / MiB:.1f} MiB raw; the vault "
        f"takes {disk / MiB:.1f} MiB on disk ({disk / raw:.2f}x of raw, {raw / disk:.1f}x "
        f"smaller), {(raw - disk) / MiB:.1f} MiB saved"
    )


def time_against_files(
    vault: weightvault.Vault, model: GPT2LMHeadModel, optimizer: torch.optim.Optimizer
) -> None:
    """A save and a resume of model + optimizer, the vault's against plain files', each
    made durable the same way (fsynced), 5 rounds alternating, medians. The vault's are
    timed in a copy of the demo's vault (its backbone already stored, as in the run), so
    the demo's own stays as the run left it."""
    from safetensors.torch import load_model, save_model

    folder = tempfile.mkdtemp(prefix="wv-demo-files-")
    shutil.copytree(vault.url, os.path.join(folder, "vault"))
    vault = weightvault.Vault(os.path.join(folder, "vault"))
    # What the timed saves and loads change is put back afterwards, for the reload check.
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(optimizer.state_dict())
    times: dict[str, list[float]] = {
        k: [] for k in ("vault save", "files save", "vault load", "files load")
    }
    try:
        for r in range(5):
            with torch.no_grad():  # a step's worth of change, so the save has new bytes
                for p in wv.trainable(model):
                    p.add_(1e-6)
            for what in ["vault", "files"] if r % 2 == 0 else ["files", "vault"]:
                t = time.perf_counter()
                if what == "vault":
                    vault.save(model, optimizer=optimizer, metadata={"step": f"timed-{r}"})
                else:
                    save_model(model, os.path.join(folder, "model.safetensors"))
                    torch.save(optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))
                    for f in ("model.safetensors", "optimizer.pt", ""):
                        fsync_file(os.path.join(folder, f))
                times[f"{what} save"].append(time.perf_counter() - t)
                vault.wait()  # the compactor runs between the timed calls, not during them
            for what in ["vault", "files"] if r % 2 == 0 else ["files", "vault"]:
                t = time.perf_counter()
                if what == "vault":
                    vault.load(model, "latest", optimizer=optimizer)
                else:
                    load_model(model, os.path.join(folder, "model.safetensors"))
                    loaded = torch.load(os.path.join(folder, "optimizer.pt"), weights_only=True)
                    optimizer.load_state_dict(loaded)
                times[f"{what} load"].append(time.perf_counter() - t)
    finally:
        shutil.rmtree(folder)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
        optimizer.load_state_dict(state)
    ms = {k: statistics.median(v) * 1000 for k, v in times.items()}
    for kind in ("save", "load"):
        print(
            f"  {kind} of model + optimizer: vault {ms['vault ' + kind]:.0f} ms, plain files "
            f"{ms['files ' + kind]:.0f} ms ({ms['vault ' + kind] / ms['files ' + kind]:.2f}x)"
        )


def reload_check(
    args: argparse.Namespace, vault: weightvault.Vault, model: GPT2LMHeadModel, batch: torch.Tensor
) -> bool:
    """Load the last checkpoint into a fresh GPT-2; whether its outputs equal ``model``'s."""
    fresh = build(seed=123, tiny=args.tiny).eval()
    model.eval()  # no dropout, so two identical models give identical outputs
    with torch.no_grad():
        before = fresh(batch).logits
        expected = model(batch).logits
    report = vault.load(fresh, "latest", restore_frozen=True)
    with torch.no_grad():
        after = fresh(batch).logits
    same = torch.equal(after, expected)
    print(
        f"reloaded {vault.list()[-1].name} into a fresh GPT-2: {len(report.loaded)} names "
        f"loaded, {len(report.frozen)} frozen again, missing={report.missing}, "
        f"unexpected={report.unexpected}"
    )
    print(
        f"outputs identical to the trained model: {same} "
        f"(max abs difference before loading {float((before - expected).abs().max()):.3f})"
    )
    return same


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    hf_logging.set_verbosity_error()
    phases = Phases(5)

    phases.start("building GPT-2 and running the reference: uninterrupted, no checkpoints")
    model, optimizer, scheduler, n_head = setup(seed=0, tiny=args.tiny)
    n_train = sum(p.numel() for p in wv.trainable(model))
    n_all = sum(p.numel() for p in model.parameters())
    print(
        f"GPT-2: {n_all / 1e6:.1f}M parameters; training {n_head} names "
        f"({n_train / 1e6:.1f}M parameters), the rest frozen",
        flush=True,
    )
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (8, 4, 32), generator=generator)
    reference, expected = reference_run(args, model, optimizer, scheduler, tokens)

    phases.start(
        f"the same run, saving into {args.vault}/ every {args.every} steps in the "
        f"background, restarting after step {args.stop}"
    )
    if os.path.exists(args.vault):
        shutil.rmtree(args.vault)  # a fresh run each time the demo is started
    vault = weightvault.Vault(args.vault)
    model, optimizer, losses = checkpointed_run(args, vault, tokens)
    same_params = all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
    print(
        f"stopped after step {args.stop} and resumed: losses identical to the uninterrupted "
        f"run: {losses == reference}; parameters bitwise identical: {same_params}"
    )
    if losses != reference or not same_params:
        raise SystemExit("the resumed run differs from the uninterrupted one")

    phases.start("what the vault holds, once compaction settles")
    vault.compact()  # as the integrations do when training ends: the newest compressed too
    print_vault(vault)

    phases.start("save and resume time, the vault against plain files")
    time_against_files(vault, model, optimizer)

    phases.start("reloading the last checkpoint into a fresh GPT-2")
    same = reload_check(args, vault, model, tokens[0])
    png = plot(vault, os.path.join(args.vault, "bytes.png")).file
    print(f"picture of bytes on disk: {png}")
    print(f"\ndone in {phases.elapsed():.0f} s")
    if not same:
        raise SystemExit("reloaded outputs differ")


if __name__ == "__main__":
    main()
