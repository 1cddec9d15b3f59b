"""Resuming training: optimizer, scheduler and RNG state by name, bit-exact, in the background."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault.torch as wv  # noqa: E402
from weightvault import KeyMismatchError, ShapeMismatchError, Vault  # noqa: E402
from weightvault._base.errors import TrainingStateError, UnsupportedStateError  # noqa: E402

WORKER = str(Path(__file__).with_name("_resume_worker.py"))


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH")] if p)
    return env


@pytest.mark.parametrize("kind", ["file", "vault"])
def test_resumed_gpt2_in_a_new_process_equals_the_straight_run(kind: str, tmp_path: Path) -> None:
    """6 steps straight == 3 steps, save, load in a new process (other seed, reversed
    optimizer), 3 steps: parameters and optimizer state bitwise equal, with dropout on, a
    tied embedding, a frozen block, AdamW with weight decay and a LambdaLR warm-up. The
    vault's next checkpoint costs 3x the trainable bytes; frozen and tied bytes nothing."""
    sys.path.insert(0, str(Path(WORKER).parent))
    import _resume_worker as w

    model, opt, sched = w.build(seed=0)
    w.train(model, opt, sched, range(w.STEPS))
    w.dump(model, opt, str(tmp_path / "straight.safetensors"))

    model, opt, sched = w.build(seed=0)
    w.train(model, opt, sched, range(w.HALF))
    source = tmp_path / ("ckpt" if kind == "vault" else "ckpt.safetensors")
    if kind == "vault":
        Vault(source).save(model, optimizer=opt, scheduler=sched, rng=True)
    else:
        wv.save(model, source, optimizer=opt, scheduler=sched, rng=True)
    out = tmp_path / "resumed.safetensors"
    subprocess.run(
        [sys.executable, WORKER, str(source), kind, str(out)], env=_env(), check=True, timeout=300
    )

    straight = wv.load_file(tmp_path / "straight.safetensors")
    resumed = wv.load_file(out)
    assert sorted(straight) == sorted(resumed)
    assert any(n.endswith("/exp_avg_sq") for n in straight)
    for name, value in straight.items():
        assert torch.equal(value, resumed[name]), name

    if kind == "vault":
        trainable = sum(p.numel() * p.element_size() for p in wv.trainable(model))
        assert len({id(p) for p in wv.trainable(model)}) == len(wv.trainable(model))
        new = Vault(source).list()[-1].new_bytes
        assert abs(new / (3 * trainable) - 1) <= 0.05, (new, trainable)


# -- small models -------------------------------------------------------------------------


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def step(model: nn.Module, opt: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(5, 4, generator=g)).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_each_optimizer_resumes_bitwise_in_reversed_order(kind: str, tmp_path: Path) -> None:
    make = OPTIMIZERS[kind]
    a = mlp(0)
    opt_a = make(list(a.parameters()))
    for i in range(2):
        step(a, opt_a, i)
    path = tmp_path / "c.safetensors"
    wv.save(a, path, optimizer=opt_a)
    b = mlp(1)
    opt_b = make(list(b.parameters())[::-1])
    report = wv.load(b, path, optimizer=opt_b)
    assert report.optimizer is not None and report.optimizer.ok
    assert sorted(report.optimizer.loaded) == sorted(n for n, _ in a.named_parameters())
    for i in range(2, 4):
        step(a, opt_a, i)
        step(b, opt_b, i)
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n
    by_name_b = {n: p for n, p in b.named_parameters()}
    for n, p in a.named_parameters():
        sa, sb = opt_a.state[p], opt_b.state[by_name_b[n]]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (n, key)


def test_state_follows_names_into_other_groups_and_hyperparameters_come_back(
    tmp_path: Path,
) -> None:
    a = mlp(0)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    step(a, opt_a, 0)
    opt_a.param_groups[0]["lr"] = 0.05  # as a scheduler would have set it
    wv.save(a, tmp_path / "c.safetensors", optimizer=opt_a)
    b = mlp(0)
    weights = [b[0].weight, b[2].weight]
    biases = [b[2].bias, b[0].bias]
    opt_b = torch.optim.SGD([{"params": biases}, {"params": weights}], lr=1.0, momentum=0.5)
    report = wv.load(b, tmp_path / "c.safetensors", optimizer=opt_b)
    for p_a, p_b in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(opt_a.state[p_a]["momentum_buffer"], opt_b.state[p_b]["momentum_buffer"])
    assert [g["lr"] for g in opt_b.param_groups] == [0.05, 0.05]
    assert [g["momentum"] for g in opt_b.param_groups] == [0.9, 0.9]
    assert report.optimizer is not None and report.optimizer.groups_kept == []


def test_a_group_mixing_saved_groups_keeps_its_own_hyperparameters(tmp_path: Path) -> None:
    a = mlp(0)
    opt_a = torch.optim.SGD(
        [{"params": list(a[0].parameters()), "lr": 0.1}, {"params": list(a[2].parameters())}],
        lr=0.2,
        momentum=0.9,
    )
    step(a, opt_a, 0)
    wv.save(a, tmp_path / "c.safetensors", optimizer=opt_a)
    b = mlp(0)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.3, momentum=0.9)
    report = wv.load(b, tmp_path / "c.safetensors", optimizer=opt_b)
    assert report.optimizer is not None and report.optimizer.groups_kept == [0]
    assert opt_b.param_groups[0]["lr"] == 0.3
    assert len(report.optimizer.loaded) == 4


def test_freeze_and_unfreeze_map_by_name_and_strictness_applies(tmp_path: Path) -> None:
    a = mlp(0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=0.01)
    step(a, opt_a, 0)
    path = tmp_path / "c.safetensors"
    wv.save(a, path, optimizer=opt_a)

    b = mlp(1)
    wv.freeze(b, "0")
    opt_b = torch.optim.AdamW(wv.trainable(b), lr=0.01)
    before = {n: p.detach().clone() for n, p in b.named_parameters()}
    with pytest.raises(KeyMismatchError, match=r"state for 0\.weight, 0\.bias has no parameter"):
        wv.load(b, path, optimizer=opt_b)
    # All or nothing: neither the model nor the optimizer changed.
    for n, p in b.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not opt_b.state
    report = wv.load(b, path, optimizer=opt_b, strict=False)
    assert report.optimizer is not None
    assert report.optimizer.unused == ["0.weight", "0.bias"]
    assert sorted(report.optimizer.loaded) == ["2.bias", "2.weight"]
    assert torch.equal(opt_b.state[b[2].weight]["exp_avg"], opt_a.state[a[2].weight]["exp_avg"])

    # The other way: saved with block 0 frozen, resumed with it unfrozen.
    c = mlp(0)
    wv.freeze(c, "0")
    opt_c = torch.optim.AdamW(wv.trainable(c), lr=0.01)
    step(c, opt_c, 0)
    wv.save(c, path, optimizer=opt_c)
    d = mlp(1)
    opt_d = torch.optim.AdamW(d.parameters(), lr=0.01)
    with pytest.raises(KeyMismatchError, match=r"no record of 0\.weight"):
        wv.load(d, path, optimizer=opt_d)
    report = wv.load(d, path, optimizer=opt_d, strict=False)
    assert report.optimizer is not None
    assert report.optimizer.missing == ["0.weight", "0.bias"]
    assert report.optimizer.without_state == ["0.weight", "0.bias"]
    assert set(opt_d.state) == {d[2].weight, d[2].bias}


def test_frozen_parameters_and_ties_cost_no_optimizer_state(tmp_path: Path) -> None:
    tied = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied[1].weight = tied[0].weight
    wv.freeze(tied, "0")
    wv.unfreeze(tied, "0")
    opt = torch.optim.Adam(tied.parameters(), lr=0.01)
    tied(torch.tensor([1, 2])).sum().backward()
    opt.step()
    report = wv.save(tied, tmp_path / "t.safetensors", optimizer=opt)
    state = [n for n in report.stored if n.startswith("__weightvault__.train/optim/")]
    assert sorted(state) == [
        "__weightvault__.train/optim/0.weight/exp_avg",
        "__weightvault__.train/optim/0.weight/exp_avg_sq",
        "__weightvault__.train/optim/0.weight/step",
    ]
    frozen = mlp(0)
    wv.freeze(frozen, "0")
    opt = torch.optim.Adam(frozen.parameters(), lr=0.01)  # frozen params listed, never stepped
    step(frozen, opt, 0)
    report = wv.save(frozen, tmp_path / "f.safetensors", optimizer=opt)
    assert not [n for n in report.stored if "/optim/0." in n]


def test_rules_rename_optimizer_state_too(tmp_path: Path) -> None:
    outer = nn.Module()
    outer.inner = mlp(0)
    opt_a = torch.optim.Adam(outer.parameters(), lr=0.01)
    step(outer.inner, opt_a, 0)
    wv.save(outer, tmp_path / "c.safetensors", optimizer=opt_a)
    b = mlp(1)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.01)
    report = wv.load(b, tmp_path / "c.safetensors", optimizer=opt_b, rules=[("inner.*", "*")])
    assert report.optimizer is not None and report.optimizer.ok
    assert ("inner.0.weight", "0.weight") in report.optimizer.renamed
    assert torch.equal(
        opt_b.state[b[0].weight]["exp_avg"], opt_a.state[outer.inner[0].weight]["exp_avg"]
    )


def test_shape_mismatch_is_strict_and_reported(tmp_path: Path) -> None:
    a = mlp(0)
    opt_a = torch.optim.Adam(a.parameters(), lr=0.01)
    step(a, opt_a, 0)
    wv.save(a, tmp_path / "c.safetensors", optimizer=opt_a)
    b = mlp(1)
    extra = nn.Parameter(torch.zeros(2))
    opt_b = torch.optim.Adam([*b.parameters(), extra], lr=0.01)
    with pytest.raises(weightvault.WeightvaultError, match="does not have"):
        wv.load(b, tmp_path / "c.safetensors", optimizer=opt_b)
    c = mlp(1)
    c[2] = nn.Linear(8, 2)
    opt_c = torch.optim.Adam(c.parameters(), lr=0.01)
    with pytest.raises(ShapeMismatchError):
        wv.load(c, tmp_path / "c.safetensors", optimizer=opt_c)
    assert not opt_c.state
    report = wv.load(c, tmp_path / "c.safetensors", optimizer=opt_c, strict=False)
    assert report.optimizer is not None and not report.optimizer.ok
    assert report.optimizer.mismatched == [("2.weight", [3, 8], [2, 8]), ("2.bias", [3], [2])]
    assert report.optimizer.without_state == ["2.weight", "2.bias"]
    assert report.optimizer.loaded == ["0.weight", "0.bias"]


def test_weights_only_loads_ignore_training_state_and_plain_readers_open_it(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors")
    a = mlp(0)
    opt = torch.optim.Adam(a.parameters(), lr=0.01)
    step(a, opt, 0)
    path = tmp_path / "c.safetensors"
    wv.save(a, path, optimizer=opt, rng=True)
    report = wv.load(mlp(1), path)
    assert report.ok and report.optimizer is None and report.unexpected == []
    assert set(weightvault.inspect(path).tensors) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    with safetensors.safe_open(str(path), "pt") as f:
        assert "__weightvault__.train/rng/torch" in list(f.keys())
    with pytest.raises(TrainingStateError, match="weights only"):
        wv.save(a, path)
        wv.load(a, path, optimizer=opt)


def test_scheduler_state_must_have_a_json_form(tmp_path: Path) -> None:
    class Odd:
        def state_dict(self) -> dict[str, Any]:
            return {"fn": print}

    with pytest.raises(UnsupportedStateError, match="Odd state 'fn' is a builtin_function"):
        wv.save(mlp(0), tmp_path / "c.safetensors", scheduler=Odd())
    assert not (tmp_path / "c.safetensors").exists()
    a = mlp(0)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    wv.save(a, tmp_path / "c.safetensors", optimizer=opt, scheduler=sched)
    other = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(TrainingStateError, match="StepLR scheduler"):
        wv.load(a, tmp_path / "c.safetensors", scheduler=other)


def test_rng_states_come_back(tmp_path: Path) -> None:
    import random

    import numpy as np

    wv.save(mlp(0), tmp_path / "c.safetensors", rng=True)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(7), np.random.rand(7), random.random()
    report = wv.load(mlp(0), tmp_path / "c.safetensors", rng=True)
    assert report.restored == ["rng:python", "rng:numpy", "rng:torch"]
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], again[0])
    assert (expected[1] == again[1]).all() and expected[2] == again[2]


# -- background saves --------------------------------------------------------------------


def test_background_vault_save_holds_the_values_at_the_call(tmp_path: Path) -> None:
    vault = Vault(tmp_path / "v")
    a = mlp(0)
    wv.freeze(a, "0")
    opt = torch.optim.AdamW(wv.trainable(a), lr=0.01)
    step(a, opt, 0)
    at_call = {n: p.detach().clone() for n, p in a.named_parameters()}
    state_at_call = opt.state[a[2].weight]["exp_avg"].clone()
    first = vault.save(a, optimizer=opt, background=True)
    step(a, opt, 1)  # at once, while the save may still be writing
    with torch.no_grad():
        a[2].bias.add_(1.0)
    second = vault.save(a, optimizer=opt, background=True)  # waits for the first
    assert first.done()
    assert first.wait().name == "000001" and second.wait().name == "000002"
    b = mlp(1)
    opt_b = torch.optim.AdamW(b[2].parameters(), lr=0.01)
    vault.load(b, "000001", optimizer=opt_b)
    for n, p in b.named_parameters():
        assert torch.equal(p, at_call[n]), n
    assert torch.equal(opt_b.state[b[2].weight]["exp_avg"], state_at_call)
    vault.load(b, "latest")
    assert torch.equal(b[2].bias, a[2].bias)


def test_background_errors_are_re_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vault = Vault(tmp_path / "v")

    def broken(*args: Any, **kwargs: Any) -> bool:
        raise OSError("disk full")

    monkeypatch.setattr(vault.store, "put", broken)
    handle = vault.save(mlp(0), background=True)
    with pytest.raises(OSError, match="disk full"):
        handle.wait()
    dropped = vault.save(mlp(0), background=True)
    while not dropped.done():
        pass
    monkeypatch.undo()
    with pytest.raises(OSError, match="disk full"):  # never waited on: the next save says so
        vault.save(mlp(0))
    assert vault.save(mlp(0)).name == "000001"


def test_background_file_save(tmp_path: Path) -> None:
    a = mlp(0)
    opt = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    step(a, opt, 0)
    at_call = {n: p.detach().clone() for n, p in a.named_parameters()}
    handle = wv.save(a, tmp_path / "c.safetensors", optimizer=opt, background=True)
    step(a, opt, 1)
    assert handle.wait().stored[:4] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    b = mlp(1)
    wv.load(b, tmp_path / "c.safetensors")
    for n, p in b.named_parameters():
        assert torch.equal(p, at_call[n]), n


def test_vault_export_keeps_the_training_state(tmp_path: Path) -> None:
    """An exported checkpoint resumes like the vault one: the optimizer comes back."""
    a = mlp(0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=0.01)
    step(a, opt_a, 0)
    vault = Vault(tmp_path / "v")
    vault.save(a, "one", optimizer=opt_a)
    path = tmp_path / "exported.safetensors"
    vault.export("one", path)
    b = mlp(1)
    opt_b = torch.optim.AdamW(list(b.parameters())[::-1], lr=0.01)
    report = wv.load(b, path, optimizer=opt_b)
    assert report.optimizer is not None and report.optimizer.ok
    step(a, opt_a, 1)
    step(b, opt_b, 1)
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_background_snapshots_reuse_the_previous_buffers_without_mixing_values(
    tmp_path: Path,
) -> None:
    """The second and third background saves copy into the first's buffers (no fresh
    memory to touch), and every checkpoint still holds the values at its own call."""
    vault = Vault(tmp_path / "v")
    a = mlp(0)
    opt = torch.optim.AdamW(a.parameters(), lr=0.01)
    expected = []
    for i in range(3):
        step(a, opt, i)
        expected.append(
            (
                {n: p.detach().clone() for n, p in a.named_parameters()},
                opt.state[a[2].weight]["exp_avg"].clone(),
            )
        )
        handle = vault.save(a, optimizer=opt, background=True)
        if i == 0:
            handle.wait()
            spare = {k: list(v) for k, v in vault._snapshots._spare.items()}
            assert spare, "the first save's buffers are kept for the next one"
        elif i == 1:
            # Every buffer the second snapshot needed came from the first one.
            assert all(not v for v in vault._snapshots._spare.values())
            lent = {id(b) for _, b in vault._snapshots._lent}
            assert lent == {id(b) for v in spare.values() for b in v}
        step(a, opt, 10 + i)  # at once: the snapshot, not the live tensors, is saved
    vault._settle()
    for i, (params, exp_avg) in enumerate(expected):
        b = mlp(1)
        opt_b = torch.optim.AdamW(b.parameters(), lr=0.01)
        vault.load(b, f"00000{i + 1}", optimizer=opt_b)
        for n, p in b.named_parameters():
            assert torch.equal(p, params[n]), (i, n)
        assert torch.equal(opt_b.state[b[2].weight]["exp_avg"], exp_avg), i


def test_inspect_counts_no_training_state_as_model_bytes(tmp_path: Path) -> None:
    # An AdamW checkpoint's moments are stored but are no model name: bytes_saved is what
    # sharing left out of the model, never negative because of the optimizer.
    import weightvault

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    path = tmp_path / "run.safetensors"
    wv.save(model, path, optimizer=opt)
    info = weightvault.inspect(path)
    assert info.training_bytes > 0
    assert info.bytes_saved == 4 * 4 * 4  # the tied weight, once


def test_large_and_small_optimizer_tensors_resume_bitwise_and_damage_changes_nothing(
    tmp_path: Path,
) -> None:
    """Moments of 1 MiB are read on the reader threads, smaller ones meanwhile on the
    calling thread: both come back bitwise, and a damaged small one fails the load
    before the model or the optimizer changes (the threads' reads are waited for)."""
    import json

    from weightvault._torch.state import _THREADED

    def make(seed: int) -> tuple[nn.Module, Any]:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 8))
        o = torch.optim.AdamW(m.parameters(), lr=0.01)
        m(torch.randn(4, 512)).square().mean().backward()
        o.step()
        o.zero_grad()
        return m, o

    assert 512 * 512 * 4 >= _THREADED > 512 * 8 * 4  # both paths are taken
    a, opt_a = make(0)
    path = tmp_path / "c.safetensors"
    wv.save(a, path, optimizer=opt_a)
    b, opt_b = make(1)
    wv.load(b, path, optimizer=opt_b)
    assert_same_state(opt_a, a, opt_b, b)

    c, opt_c = make(2)
    before = {k: v.clone() for k, v in c.state_dict().items()}
    moments = {
        id(p): {k: torch.as_tensor(v).clone() for k, v in s.items()} for p, s in opt_c.state.items()
    }
    data = bytearray(path.read_bytes())
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    small = next(k for k in header if "1.bias" in k and "exp_avg" in k)
    at = 8 + int.from_bytes(data[:8], "little") + header[small]["data_offsets"][0]
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(weightvault.ChecksumError, match=r"1\.bias"):
        wv.load(c, path, optimizer=opt_c, verify=True)
    for k, v in c.state_dict().items():
        assert torch.equal(v, before[k]), k
    for p, s in opt_c.state.items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), moments[id(p)][k]), k


def assert_same_state(opt_a: Any, a: nn.Module, opt_b: Any, b: nn.Module) -> None:
    by_name_b = dict(b.named_parameters())
    for n, p in a.named_parameters():
        sa, sb = opt_a.state[p], opt_b.state[by_name_b[n]]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (n, key)
