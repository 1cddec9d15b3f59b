"""A background vault save copies trainable parameters and optimizer state in its own
thread, and every optimizer step waits for that copy (weightvault/_torch/staging.py).

Each test holds the save's copies back with an event, so the race it is about happens
for certain; every wait on a thread is bounded.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from weightvault import Vault  # noqa: E402
from weightvault._base.errors import TrainingStateError  # noqa: E402
from weightvault._torch import staging  # noqa: E402

BOUND = 30.0  # seconds any thread of a test may take before the test fails


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def backward(model: nn.Module, opt: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(6, 4, generator=g)).pow(2).sum().backward()


def held_back(vault: Vault, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event the vault's next staging waits for before it copies anything."""
    go = threading.Event()
    stage = vault._snapshots.stage

    def gated() -> None:
        assert go.wait(BOUND), "the test never let the staging run"
        stage()

    monkeypatch.setattr(vault._snapshots, "stage", gated)
    return go


def in_thread(fn: Any) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_step_waits_for_the_copy_and_the_checkpoint_holds_the_values_at_the_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vault = Vault(tmp_path / "v")
    model = net(0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    backward(model, opt, 0)
    opt.step()
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {id(p): opt.state[p]["exp_avg"].clone() for p in model.parameters()}
    go = held_back(vault, monkeypatch)
    handle = vault.save(model, optimizer=opt, background=True)
    assert not handle.done()  # nothing was copied yet: the call returned first
    # The next step's forward and backward run meanwhile, and change the batch norm's
    # running statistics (a buffer, so copied before the call returned).
    backward(model, opt, 1)
    stepped = in_thread(opt.step)
    stepped.join(0.3)
    assert stepped.is_alive(), "the optimizer stepped before the save copied its weights"
    go.set()
    stepped.join(BOUND)
    assert not stepped.is_alive()
    assert handle.wait(BOUND).name == "000001"
    assert not torch.equal(model[0].weight, at_call["0.weight"])  # the step did run

    other = net(1)
    opt_b = torch.optim.AdamW(other.parameters(), lr=0.1)
    vault.load(other, "000001", optimizer=opt_b)
    for k, v in other.state_dict().items():
        assert torch.equal(v, at_call[k]), k
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(opt_b.state[q]["exp_avg"], moments[id(p)])


def test_any_optimizer_waits_even_for_a_save_of_the_model_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vault = Vault(tmp_path / "v")
    model = net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    go = held_back(vault, monkeypatch)
    handle = vault.save(model, background=True)
    backward(model, opt, 2)
    stepped = in_thread(opt.step)
    stepped.join(0.3)
    assert stepped.is_alive()
    go.set()
    stepped.join(BOUND)
    handle.wait(BOUND)
    other = net(1)
    vault.load(other, "latest")
    for k, v in other.state_dict().items():
        assert torch.equal(v, at_call[k]), k


def test_a_failed_copy_fails_the_save_and_releases_the_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vault = Vault(tmp_path / "v")
    model = net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    backward(model, opt, 0)
    opt.step()
    pool = vault._snapshots
    later = pool.later
    calls = 0

    def broken(key: Any, empty: Any, fill: Any) -> Any:
        nonlocal calls
        calls += 1

        def fail(buffer: Any) -> None:
            raise MemoryError("no room for the copy")

        return later(key, empty, fail if calls == 3 else fill)

    monkeypatch.setattr(pool, "later", broken)
    handle = vault.save(model, optimizer=opt, background=True)
    with pytest.raises(MemoryError, match="no room"):
        handle.wait(BOUND)
    assert calls > 3
    monkeypatch.undo()
    backward(model, opt, 1)
    stepped = in_thread(opt.step)
    stepped.join(BOUND)
    assert not stepped.is_alive(), "a step waited on a save that had failed"
    assert vault.save(model, optimizer=opt, background=True).wait(BOUND).name == "000001"


def test_a_save_refused_before_its_thread_leaves_nothing_for_a_step_to_wait_on(
    tmp_path: Path,
) -> None:
    vault = Vault(tmp_path / "v")
    model = net(0)
    stranger = nn.Linear(2, 2)
    opt = torch.optim.AdamW([*model.parameters(), *stranger.parameters()], lr=0.1)
    backward(model, opt, 0)
    opt.step()
    with pytest.raises(TrainingStateError, match="does not have"):
        vault.save(model, optimizer=opt, background=True)
    assert vault._snapshots.staged(0)
    assert not vault._snapshots._lent and not vault._snapshots._queue
    with pytest.raises(TypeError, match="metadata must map str to str"):
        vault.save(model, metadata={"a": 1}, background=True)  # type: ignore[dict-item]
    assert vault._snapshots.staged(0)
    stepped = in_thread(opt.step)
    stepped.join(BOUND)
    assert not stepped.is_alive()
    assert vault.save(model, background=True).wait(BOUND).name == "000001"


@pytest.mark.parametrize("wait", ["handle.copied", "staging.wait_staged"])
def test_what_an_in_place_change_outside_a_step_waits_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait: str
) -> None:
    vault = Vault(tmp_path / "v")
    model = net(0)
    at_call = model[3].bias.detach().clone()
    go = held_back(vault, monkeypatch)
    handle = vault.save(model, background=True)
    assert not handle.copied(0.05)
    waited = in_thread(handle.copied if wait == "handle.copied" else staging.wait_staged)
    waited.join(0.3)
    assert waited.is_alive()
    go.set()
    waited.join(BOUND)
    assert not waited.is_alive() and handle.copied(0)
    with torch.no_grad():
        model[3].bias.add_(1.0)
    handle.wait(BOUND)
    other = net(1)
    vault.load(other, "latest")
    assert torch.equal(other[3].bias, at_call)


def test_a_save_whose_thread_cannot_start_leaves_nothing_for_a_step_to_wait_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Refusing:
        def submit(self, *args: Any) -> None:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    vault = Vault(tmp_path / "v")
    model = net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    backward(model, opt, 0)
    opt.step()
    monkeypatch.setattr(vault._saves, "_saver", lambda: Refusing())
    with pytest.raises(RuntimeError, match="interpreter shutdown"):
        vault.save(model, optimizer=opt, background=True)
    assert vault._snapshots.staged(0) and not vault._snapshots._queue
    stepped = in_thread(opt.step)
    stepped.join(BOUND)
    assert not stepped.is_alive()
