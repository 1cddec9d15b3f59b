"""The three problems in ../shared/seeds, at full size, as PyTorch models."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault.torch as wv  # noqa: E402


class FourShared(nn.Module):
    """Seed 000: four Dense(2048) layers sharing one weight and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(2048, 2048)
        self.l2 = self.l1
        self.l3 = self.l1
        self.l4 = self.l1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l4(self.l3(self.l2(self.l1(x))))


class Only(nn.Module):
    def __init__(self, attr: str) -> None:
        super().__init__()
        setattr(self, attr, nn.Linear(2048, 2048))


def test_four_shared_layers_cost_one_layer(tmp_path):
    """Seed 000: the file is the size of one layer, and every name is still recorded."""
    model = FourShared()
    path = tmp_path / "four.safetensors"
    report = wv.save(model, path)
    one_layer = (2048 * 2048 + 2048) * 4
    assert report.stored_bytes == one_layer
    assert os.path.getsize(path) <= one_layer + 8192  # a header page at most
    torch_save = tmp_path / "four.pt"
    torch.save(model.state_dict(), torch_save)
    info = weightvault.inspect(path)
    assert sorted(info.names) == sorted(model.state_dict())
    assert info.aliases == {f"l{i}.{p}": f"l1.{p}" for i in (2, 3, 4) for p in ("weight", "bias")}
    assert info.logical_bytes == 4 * one_layer


@pytest.mark.parametrize("attr", ["l1", "l3"])
def test_subset_model_loads_shared_file(tmp_path, attr):
    """A model holding any one of the four tied layers loads the file, strictly."""
    model = FourShared()
    path = tmp_path / "four.safetensors"
    wv.save(model, path)
    sub = Only(attr)
    report = wv.load(sub, path)
    assert report.missing == [] and report.unexpected == []
    assert report.loaded == [f"{attr}.weight", f"{attr}.bias"]
    assert torch.equal(getattr(sub, attr).weight, model.l1.weight)
    x = torch.randn(2, 2048)
    assert torch.equal(getattr(sub, attr)(x), model.l1(x))


def test_renamed_attribute_fails_helpfully_then_loads_with_rule(tmp_path):
    """Seed 000's first example: l1 saved, a model with l2 loads it through a rule."""
    src = Only("l1")
    path = tmp_path / "l1.safetensors"
    wv.save(src, path)
    dst = Only("l2")
    before = dst.l2.weight.clone()
    with pytest.raises(weightvault.KeyMismatchError) as info:
        wv.load(dst, path)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.missing == ["l2.weight", "l2.bias"]
    assert err.unexpected == ["l1.weight", "l1.bias"]
    assert err.suggestions == {"l2.weight": "l1.weight", "l2.bias": "l1.bias"}
    assert err.rule == ("l1.*", "l2.*")
    message = str(err)
    assert "l1.safetensors" in message and "did you mean 'l1.weight'" in message
    assert "rules=[('l1.*', 'l2.*')]" in message
    assert torch.equal(dst.l2.weight, before), "a failed load must not touch the model"

    report = wv.load(dst, path, rules=[err.rule])
    assert report.renamed == [("l1.weight", "l2.weight"), ("l1.bias", "l2.bias")]
    assert torch.equal(dst.l2.weight, src.l1.weight)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, bias=False)
        with torch.no_grad():
            self.conv.weight.copy_(torch.tensor([[1.0, 2, 3]] * 3).reshape(1, 1, 3, 3))


def _step(model: Conv, optimizer: torch.optim.Optimizer) -> tuple[float, float]:
    x = torch.tensor([[1.0, 2, 3]] * 3).reshape(1, 1, 3, 3)
    before = model.conv(x).sum()
    optimizer.zero_grad()
    before.backward() if before.requires_grad else None
    optimizer.step()
    after = model.conv(x).sum()
    return float(before), float(after)


def test_frozen_conv_kernel_never_moves(tmp_path):
    """Seed 004: frozen gives 42 before and after an SGD step; unfrozen gives 41.58."""
    frozen = Conv()
    opt = torch.optim.SGD(frozen.parameters(), lr=0.01)
    assert wv.freeze(frozen, "conv.weight", optimizer=opt) == ["conv.weight"]
    assert _step(frozen, opt) == (42.0, 42.0)
    assert frozen.conv.weight.grad is None
    assert opt.param_groups[0]["params"] == []

    free = Conv()
    opt = torch.optim.SGD(free.parameters(), lr=0.01)
    before, after = _step(free, opt)
    assert before == 42.0 and after == pytest.approx(41.58, abs=1e-5)

    path = tmp_path / "conv.safetensors"
    assert wv.save(frozen, path).frozen == ["conv.weight"]
    fresh = Conv()
    report = wv.load(fresh, path, restore_frozen=True)
    assert report.frozen == ["conv.weight"]
    assert not fresh.conv.weight.requires_grad
    opt = torch.optim.SGD(wv.trainable(fresh) or [torch.zeros(1, requires_grad=True)], lr=0.01)
    assert _step(fresh, opt) == (42.0, 42.0)
