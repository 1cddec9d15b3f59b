"""Worker processes for tests/test_vault_compression_crash.py, killed with SIGKILL.

``python tests/_compression_workers.py COMMAND ...``:

- ``saver ROOT``: a server that forks a child per ``go FIRST`` line; the child trains a
  small model deterministically and saves a checkpoint after every step from ``FIRST``
  on, into a vault with deltas and ``training_state_last=1`` (so each save also drops
  the training state of the one before) until it is killed.
- ``gc ROOT``: runs gc in a loop until killed.

:func:`state_at` rebuilds, in any process, exactly the weights and optimizer state of
the checkpoint of a step: it replays training from the same seeds.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

WIDTH = 48


def state_at(step: int) -> tuple[Any, Any]:
    """The model and AdamW optimizer after ``step`` deterministic training steps."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for s in range(step):
        train_step(model, opt, s)
    return model, opt


def train_step(model: Any, opt: Any, s: int) -> None:
    """Training step ``s`` (its batch comes from seed ``s``)."""
    import torch

    g = torch.Generator().manual_seed(s)
    model(torch.randn(4, WIDTH, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def name_of(step: int) -> str:
    return f"s{step:06d}"


def _train_and_save(root: str, first: int) -> None:
    import weightvault

    model, opt = state_at(first)
    vault = weightvault.Vault(root, delta_chain=3, training_state_last=1)
    for step in range(first, first + 100_000):
        if step > first:
            train_step(model, opt, step - 1)
        vault.save(model, name_of(step), optimizer=opt, metadata={"step": str(step)})
        time.sleep(0.05)  # a pace, so that a round commits a dozen saves, not hundreds


def saver(root: str) -> None:
    import blosc2  # imported once here, not in every child (a second each)
    import torch

    import weightvault

    torch.set_num_threads(1)
    del blosc2, weightvault
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd != "go":
            break
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _train_and_save(root, int(args[0]))
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        print(f"child {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"reaped {status}", flush=True)


def gc_forever(root: str) -> None:
    import weightvault

    vault = weightvault.Vault(root)
    print("ready", flush=True)
    while True:
        vault.gc()


if __name__ == "__main__":
    command, root = sys.argv[1], sys.argv[2]
    {"saver": saver, "gc": gc_forever}[command](root)
