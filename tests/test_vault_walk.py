"""Walking a run's checkpoints: ``Vault.walk`` loads each into one model, copying only
the tensors whose object changed, with the checks and the all-or-nothing of ``load``."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault.torch as wv  # noqa: E402
from weightvault._vault.objects.address import object_key  # noqa: E402
from weightvault._vault.walk import unchanged_between  # noqa: E402


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    wv.freeze(m, "0", "1")  # the backbone; only the head trains
    return m


def fine_tune(vault: weightvault.Vault, m: nn.Module, n: int) -> list[str]:
    opt = torch.optim.AdamW(wv.trainable(m), lr=1e-2)
    names = []
    for _ in range(n):
        m(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        names.append(vault.save(m).name)
    return names


@pytest.fixture
def run(tmp_path: Path) -> tuple[weightvault.Vault, list[str]]:
    vault = weightvault.Vault(tmp_path / "v", compression=None)
    names = fine_tune(vault, model(), 5)
    vault.wait()  # the compactor took the packs apart: one file per object
    return vault, names


def state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def loaded(vault: weightvault.Vault, name: str) -> dict[str, torch.Tensor]:
    fresh = model(seed=1)
    vault.load(fresh, name)
    return state(fresh)


def test_walk_equals_a_load_of_each_checkpoint_bitwise(run):
    vault, names = run
    walker = model(seed=2)
    seen = []
    for name, report in vault.walk(walker):
        expected = loaded(vault, name)
        for key, value in walker.state_dict().items():
            assert torch.equal(value, expected[key]), (name, key)
        assert report.missing == [] and sorted(report.loaded) == sorted(expected)
        seen.append(name)
    assert seen == names  # all of them, oldest first


def test_walk_copies_only_the_tensors_whose_object_changed(run):
    vault, names = run
    walker = model(seed=2)
    params = dict(walker.named_parameters())
    counted = []
    before = {n: p._version for n, p in params.items()}
    for _ in vault.walk(walker):
        now = {n: p._version for n, p in params.items()}
        counted.append({n for n in params if now[n] != before[n]})  # copies bump it
        before = now
    assert counted[0] == set(params)  # the first checkpoint copies everything
    for a, b, copied in zip(names[:-1], names[1:], counted[1:], strict=True):
        with vault.open(a) as x, vault.open(b) as y:
            changed = {s for s in y.objects if x.objects[s] != y.objects[s]}
            assert sorted(unchanged_between(x, y)) == sorted(set(y.objects) - changed)
        assert copied == changed == {"2.weight", "2.bias"}  # the head, never the backbone


def test_walk_takes_names_in_order_with_best_and_latest(run):
    vault, names = run
    vault.mark(names[1])
    walker = model(seed=2)
    order = ["latest", "best", names[0], names[0]]
    got = [name for name, _ in vault.walk(walker, order)]
    assert got == [names[-1], names[1], names[0], names[0]]
    assert all(torch.equal(v, loaded(vault, names[0])[k]) for k, v in walker.state_dict().items())
    with pytest.raises(weightvault.CheckpointNotFoundError):
        vault.walk(walker, ["nope"])  # every name resolved before the first load


def damage(vault: weightvault.Vault, name: str, tensor: str) -> None:
    """Flip a byte of ``tensor``'s object in checkpoint ``name`` (a new file put in place:
    nothing another thread reads is rewritten)."""
    with vault.open(name) as ckpt:
        path = Path(vault.url) / object_key(ckpt.objects[tensor])
    data = bytearray(path.read_bytes())
    data[7] ^= 0xFF
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)


def test_a_damaged_object_midway_leaves_the_last_good_checkpoint(run):
    vault, names = run
    damage(vault, names[3], "2.weight")
    walker = model(seed=2)
    walked = []
    with pytest.raises(weightvault.ChecksumError, match=r"2\.weight") as e:
        for name, _ in vault.walk(walker):
            walked.append(name)
    assert walked == names[:3]
    assert any(repr(names[3]) in note and repr(names[2]) in note for note in e.value.__notes__)
    expected = loaded(vault, names[2])
    for key, value in walker.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_options_are_those_of_load(run):
    vault, names = run
    walker = model(seed=2)
    for p in walker.parameters():
        p.requires_grad_(True)
    for _ in vault.walk(walker, names[:2], restore_frozen=True):
        pass
    assert not walker[0].weight.requires_grad and walker[2].weight.requires_grad
    other = nn.Sequential(*model(seed=2), nn.Linear(8, 2))  # a layer more
    before = state(other)
    with pytest.raises(weightvault.KeyMismatchError):
        next(vault.walk(other))
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    _, report = next(vault.walk(other, strict=False))
    assert sorted(report.missing) == ["3.bias", "3.weight"]


def test_a_changed_layout_copies_everything(tmp_path):
    vault = weightvault.Vault(tmp_path / "v", compression=None)
    w = torch.arange(16.0)
    vault.save({"a": w, "b": torch.ones(3)})
    vault.save({"a": w, "b": torch.ones(4)})  # b's shape changed
    with vault.open("000001") as x, vault.open("000002") as y:
        assert unchanged_between(x, y) == frozenset()
    vault.save({"a": w, "b": torch.ones(4), "c": w})  # a copy: another layout
    with vault.open("000002") as x, vault.open("000003") as y:
        assert unchanged_between(x, y) == frozenset()


def test_numpy_arrays_walk_in_place(tmp_path):
    vault = weightvault.Vault(tmp_path / "v", compression=None)
    frozen = np.arange(64, dtype=np.float32)
    for step in range(3):
        vault.save({"frozen": frozen, "head": np.full(4, step, np.float32)})
    arrays = {"frozen": np.zeros(64, np.float32), "head": np.zeros(4, np.float32)}
    for i, (name, _) in enumerate(vault.walk(arrays)):
        assert np.array_equal(arrays["head"], np.full(4, i, np.float32)), name
        arrays["frozen"].flags.writeable = False  # a second copy into it would fail
    assert np.array_equal(arrays["frozen"], frozen)


def test_keras_walk_equals_loads(tmp_path):
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "torch":
        pytest.skip("the walk's in-place skip is measured on the torch backend")

    def build() -> keras.Model:
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(2)])
        m.layers[0].trainable = False
        return m

    src = build()
    vault = weightvault.Vault(tmp_path / "v", compression=None)
    for step in range(3):
        kernel = src.layers[1].kernel
        kernel.assign(kernel.numpy() + step)
        vault.save(src)
    walker = build()
    first = walker.layers[0].kernel.value
    versions = []
    for name, _ in vault.walk(walker):
        fresh = build()
        vault.load(fresh, name)
        for a, b in zip(walker.weights, fresh.weights, strict=True):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        versions.append(first._version)
    assert versions[1:] == [versions[0]] * 2  # the frozen kernel was copied once
