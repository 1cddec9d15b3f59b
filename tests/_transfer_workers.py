"""A fine-tune vault for the push/pull tests, and the body of a pushing process.

The tests import :func:`finetune` (a small frozen-backbone run whose checkpoints hold
optimizer state) and :func:`check_loads`; a worker process runs this file as a script
(``python tests/_transfer_workers.py push SRC DST``), imports no framework, prints
``pushing`` once it starts and ``done`` once the push returned. It writes in batches of
64 KiB, so a SIGKILL at a random moment lands between, or inside, many batches.
"""

from __future__ import annotations

import sys
from typing import Any


def train(width: int = 64, seed: int = 0) -> tuple[Any, Any]:
    """A model with a frozen first layer and an AdamW on the rest."""
    import torch
    from torch import nn

    import weightvault.torch as wvt

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    wvt.freeze(model, "0")
    opt = torch.optim.AdamW(wvt.trainable(model), lr=1e-3)
    return model, opt


def step(model: Any, opt: Any) -> None:
    import torch

    model(torch.randn(8, model[0].in_features)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state(model: Any, opt: Any) -> dict[str, Any]:
    """Every tensor of the model and the optimizer's state, cloned, by one flat name."""
    import torch

    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"opt/{i}/{k}"] = v.clone()
    return out


def finetune(vault: Any, saves: int, width: int = 64, seed: int = 0) -> dict[str, dict[str, Any]]:
    """``saves`` checkpoints of a short fine-tune, each with its optimizer state, compacted
    into deltas; returns ``{name: state}`` of each."""
    model, opt = train(width, seed)
    out = {}
    for _ in range(saves):
        step(model, opt)
        record = vault.save(model, optimizer=opt, metadata={"seed": str(seed)})
        out[record.name] = state(model, opt)
    vault.wait()
    vault.compact()
    return out


def check_loads(vault: Any, expected: dict[str, dict[str, Any]], width: int = 64) -> None:
    """Every checkpoint of ``expected`` loads from ``vault`` bitwise, optimizer included."""
    import torch

    for name, want in expected.items():
        model, opt = train(width, seed=12345)
        step(model, opt)  # the optimizer has state to be filled
        vault.load(model, name, optimizer=opt)
        got = state(model, opt)
        assert list(got) == list(want), name
        for key, value in want.items():
            a = got[key].contiguous().reshape(-1).view(torch.uint8)
            b = value.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(a, b), f"{name}: {key} differs"


def main(argv: list[str]) -> None:
    command, src, dst = argv
    assert command == "push"
    import weightvault
    from weightvault._vault.travel import transfer

    transfer.BATCH_BYTES = 64 << 10
    print("pushing", flush=True)
    report = weightvault.Vault(src).push(dst)
    print("done", report.objects_sent, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
