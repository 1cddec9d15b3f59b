"""Damaged training state is refused before the framework sees it, and ``verify`` sees it.

A key of a saved optimizer or scheduler state removed, or holding another kind (a 0-d
``step`` tensor become a number, a learning rate become a string), must be a
``FormatError`` naming the checkpoint, the parameter and the key, never torch's own
``KeyError: 'step'`` from ``Adam.__setstate__``; and a load that raises leaves the model,
the optimizer and the scheduler exactly as they were. The oracle for "as they were" is
torch's own ``state_dict()`` of each, taken before the load.

Single files are damaged through the decoded training section and written by the writer
(``save_file``), so they stay sealed as a save seals them; vault checkpoints by editing
the record's header and resealing the record (``tests/_records.py``).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.optim import lr_scheduler  # noqa: E402

import weightvault  # noqa: E402
import weightvault.torch as wv  # noqa: E402
from _records import read as read_record, rewrite as rewrite_record  # noqa: E402
from weightvault import FormatError, Vault  # noqa: E402
from weightvault._file.checkpoint import SafetensorsFile  # noqa: E402
from weightvault._load.steps import save_file  # noqa: E402
from weightvault._torch.expect import _probe, group_needs, plain  # noqa: E402
from weightvault._training import known  # noqa: E402
from weightvault._training.complete import training_state_problems  # noqa: E402
from weightvault._training.expect import kind  # noqa: E402

CASES = ["AdamW", "SGD", "Adafactor", "LambdaLR", "OneCycleLR"]
RECORD = Path("checkpoints") / "000001.json"


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 10)


def build(case: str, seed: int) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    if case == "SGD":
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif case == "Adafactor":
        opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched: Any = None
    if case == "LambdaLR":
        sched = lr_scheduler.LambdaLR(opt, _warmup)
    elif case == "OneCycleLR":
        sched = lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20)
    return model, opt, sched


def train(model: nn.Module, opt: Any, sched: Any, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
        opt.step()
        if sched is not None:
            sched.step()


def snapshot(model: nn.Module, opt: Any, sched: Any) -> Any:
    """The oracle: torch's own view of each object, deep-copied."""
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        copy.deepcopy(opt.state_dict()),
        None if sched is None else copy.deepcopy(sched.state_dict()),
    )


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # nan equals nan here


# -- the damage -----------------------------------------------------------------------------


def targets(case: str, training: dict[str, Any], opt: Any, sched: Any) -> list[tuple[str, ...]]:
    """Every key a damage may hit: each parameter's state keys, each group's
    hyperparameters that torch needs, each key of the scheduler's state."""
    out: list[tuple[str, ...]] = []
    doc = training["optimizer"]
    for name, rec in doc["params"].items():
        out += [("param", name, k) for k in [*rec["tensors"], *rec["values"]]]
    required, _ = group_needs(opt)
    out += [("group", str(gi), k) for gi in range(len(doc["groups"])) for k in required]
    if sched is not None:
        state = training["scheduler"]["state"]
        out += [("scheduler", k) for k in state if state[k] is not None]
    assert out
    return out


def _empties(training: dict[str, Any], target: tuple[str, ...]) -> bool:
    """Whether dropping ``target`` leaves its parameter's record without any state."""
    if target[0] != "param":
        return False
    rec = training["optimizer"]["params"][target[1]]
    return len(rec["tensors"]) + len(rec["values"]) == 1


def _other(value: Any) -> Any:
    """A value of another kind."""
    return 1.5 if isinstance(value, str) else "x"


def damage(training: dict[str, Any], target: tuple[str, ...], how: str) -> dict[str, Any]:
    t = copy.deepcopy(training)
    if target[0] == "param":
        rec = t["optimizer"]["params"][target[1]]
        key = target[2]
        if how == "drop":
            rec["tensors"].pop(key, None)
            rec["values"].pop(key, None)
        elif key in rec["tensors"]:
            del rec["tensors"][key]  # a tensor become a number: the old 'step' of torch 1.x
            rec["values"][key] = 1.0
        else:
            rec["values"][key] = _other(rec["values"][key])
        return t
    place = (
        t["optimizer"]["groups"][int(target[1])]["hyper"]
        if target[0] == "group"
        else t["scheduler"]["state"]
    )
    key = target[-1]
    if how == "drop":
        del place[key]
    else:
        place[key] = _other(place[key])
    return t


def expected_words(target: tuple[str, ...]) -> list[str]:
    """What the error must name besides the checkpoint."""
    place = {"param": f"parameter {target[1]!r}", "group": f"group {target[1]}"}
    return [place[target[0]], repr(target[2])] if target[0] in place else [repr(target[1])]


def reported(target: tuple[str, ...], problems: list[str]) -> bool:
    words = expected_words(target)
    return any(all(w in p for w in words) for p in problems)


def verify_knows(case: str, target: tuple[str, ...], training: dict[str, Any]) -> bool:
    """Whether a check without torch can see this damage: every parameter key, and the
    group and scheduler keys the hand table lists (a key only newer torch releases
    write, such as ``_is_initial``, is left out of it on purpose)."""
    if target[0] == "param":
        return True
    if target[0] == "group":
        return target[2] in (known.group_keys("pt", training["optimizer"]["class"]) or {})
    return target[1] in (known.scheduler_keys("pt", training["scheduler"]["class"]) or {})


# -- the containers -------------------------------------------------------------------------


def write_file(path: Path, found: Any, training: dict[str, Any]) -> Path:
    sources, skipped, _ = found
    save_file(path, (sources, skipped, training), "pt", None, True, False)
    return path


def write_vault(good: Path, path: Path, training: dict[str, Any]) -> Path:
    """A copy of vault ``good`` whose checkpoint's record holds ``training``, resealed."""
    shutil.copytree(good, path)
    record = path / RECORD
    doc = read_record(record)
    header = json.loads(doc["header"])
    manifest = json.loads(header["__metadata__"]["weightvault"])
    manifest["training"] = training
    header["__metadata__"]["weightvault"] = json.dumps(manifest, separators=(",", ":"))
    doc["header"] = json.dumps(header, separators=(",", ":"))
    fresh = record.with_suffix(".tmp")
    rewrite_record(fresh, doc)
    os.replace(fresh, record)
    return path


def problems_of(kind_: str, path: Path) -> list[str]:
    if kind_ == "file":
        with SafetensorsFile(path) as ckpt:
            return training_state_problems(ckpt)
    with Vault(path).open("000001") as ckpt:
        return training_state_problems(ckpt)


def load(kind_: str, path: Path, model: nn.Module, opt: Any, sched: Any) -> Any:
    if kind_ == "file":
        return wv.load(model, path, optimizer=opt, scheduler=sched)
    return Vault(path).load(model, "000001", optimizer=opt, scheduler=sched)


class Saved:
    """One case's checkpoint, saved whole once: its sources, training section and vault."""

    def __init__(self, case: str, root: Path) -> None:
        self.case = case
        self.model, self.opt, self.sched = build(case, seed=0)
        train(self.model, self.opt, self.sched, steps=3, seed=1)
        self.found = wv.checkpoint_sources(self.model, optimizer=self.opt, scheduler=self.sched)
        self.training: dict[str, Any] = self.found[2]
        self.vault = root / "good-vault"
        Vault(self.vault).save(self.model, optimizer=self.opt, scheduler=self.sched)
        self.file = write_file(root / "good.safetensors", self.found, self.training)

    def live(self) -> tuple[nn.Module, Any, Any]:
        """Objects to resume into: another seed, already one step in (so a half-load shows)."""
        model, opt, sched = build(self.case, seed=7)
        train(model, opt, sched, steps=1, seed=8)
        return model, opt, sched

    def damaged(self, kind_: str, path: Path, training: dict[str, Any]) -> Path:
        if kind_ == "file":
            return write_file(path.with_suffix(".safetensors"), self.found, training)
        return write_vault(self.vault, path, training)


# -- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_whole_checkpoints_load_and_have_no_problems(case: str, tmp_path: Path) -> None:
    """The checks refuse nothing whole: what the save wrote loads into fresh objects, which
    then hold the saved state (torch's own state_dict the oracle)."""
    saved = Saved(case, tmp_path)
    for kind_, path in (("file", saved.file), ("vault", saved.vault)):
        assert problems_of(kind_, path) == []
        model, opt, sched = saved.live()
        load(kind_, path, model, opt, sched)
        assert same(opt.state_dict(), saved.opt.state_dict())
        if sched is not None:
            assert same(sched.state_dict(), saved.sched.state_dict())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind_", ["file", "vault"])
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_damaged_training_state_is_a_format_error_and_changes_nothing(
    case: str, kind_: str, tmp_path: Path, data: st.DataObject
) -> None:
    saved = _saved(case, tmp_path)
    how = data.draw(st.sampled_from(["drop", "retype"]))
    hits = targets(case, saved.training, saved.opt, saved.sched)
    if how == "drop":  # a record left without state reads as never stepped (test below)
        hits = [t for t in hits if not _empties(saved.training, t)]
    target = data.draw(st.sampled_from(hits))
    path = saved.damaged(kind_, _fresh(tmp_path), damage(saved.training, target, how))

    model, opt, sched = saved.live()
    before = snapshot(model, opt, sched)
    with pytest.raises(FormatError) as caught:
        load(kind_, path, model, opt, sched)
    message = str(caught.value)
    where = str(path) if kind_ == "file" else str(path / RECORD)
    assert where in message, message
    for word in expected_words(target):
        assert word in message, (word, message)
    assert same(before, snapshot(model, opt, sched)), f"{target} {how}: the load changed things"
    if verify_knows(case, target, saved.training):
        problems = problems_of(kind_, path)
        assert reported(target, problems), (target, how, problems)


_SAVED: dict[tuple[str, str], Saved] = {}
_COUNT = itertools.count()


def _saved(case: str, tmp_path: Path) -> Saved:
    """One whole checkpoint per case and test, shared by that test's examples."""
    if (case, str(tmp_path)) not in _SAVED:
        (tmp_path / case).mkdir()
        _SAVED[case, str(tmp_path)] = Saved(case, tmp_path / case)
    return _SAVED[case, str(tmp_path)]


def _fresh(tmp_path: Path) -> Path:
    return tmp_path / f"damaged-{next(_COUNT)}"


def test_a_missing_step_is_no_longer_torchs_key_error(tmp_path: Path) -> None:
    """The case as it was met: a record's 'step' key flipped, an Adam-family optimizer."""
    saved = Saved("AdamW", tmp_path)
    training = copy.deepcopy(saved.training)
    rec = training["optimizer"]["params"]["0.weight"]
    rec["tensors"]["stfp"] = rec["tensors"].pop("step")
    path = write_file(tmp_path / "flipped.safetensors", saved.found, training)
    model, opt, sched = saved.live()
    before = snapshot(model, opt, sched)
    with pytest.raises(FormatError, match=r"parameter '0\.weight': key 'step' is missing") as e:
        wv.load(model, path, optimizer=opt)
    assert "stfp" in str(e.value) and str(path) in str(e.value)
    assert same(before, snapshot(model, opt, sched))
    assert any("'0.weight'" in p and "'step'" in p for p in problems_of("file", path))


def test_a_record_left_without_state_loads_as_a_parameter_that_never_stepped(
    tmp_path: Path,
) -> None:
    """SGD keeps one key per parameter; without it, a record is what a parameter that
    never had a gradient leaves (a pooler no loss reaches), so it cannot be told from
    damage: the load gives that parameter no state, and the report says so."""
    saved = Saved("SGD", tmp_path)
    training = damage(saved.training, ("param", "0.weight", "momentum_buffer"), "drop")
    path = write_file(tmp_path / "emptied.safetensors", saved.found, training)
    model, opt, _ = saved.live()
    report = wv.load(model, path, optimizer=opt)
    assert report.optimizer.without_state == ["0.weight"]
    assert sorted(opt.state_dict()["state"]) == [1, 2, 3]
    assert problems_of("file", path) == []


@pytest.mark.parametrize("key", ["foreach", "decoupled_weight_decay", "amsgrad", "fused"])
def test_group_keys_torch_fills_in_itself_may_be_missing(key: str, tmp_path: Path) -> None:
    """A group saved by an older torch lacks the keys added since; AdamW's __setstate__
    fills them in, so such a checkpoint loads as torch would load it."""
    saved = Saved("AdamW", tmp_path)
    training = copy.deepcopy(saved.training)
    for group in training["optimizer"]["groups"]:
        del group["hyper"][key]
    path = write_file(tmp_path / "older.safetensors", saved.found, training)
    model, opt, _ = saved.live()
    wv.load(model, path, optimizer=opt)
    assert same(opt.state_dict()["state"], saved.opt.state_dict()["state"])
    assert problems_of("file", path) == []


@pytest.mark.parametrize("case", ["LambdaLR", "OneCycleLR"])
def test_every_key_of_the_live_scheduler_is_needed(case: str, tmp_path: Path) -> None:
    """Each key of the live scheduler's state_dict, dropped, is refused on load (torch's
    load_state_dict would keep the live value, or raise KeyError for LambdaLR's
    lr_lambdas after the optimizer was loaded)."""
    saved = Saved(case, tmp_path)
    for i, key in enumerate(saved.training["scheduler"]["state"]):
        training = damage(saved.training, ("scheduler", key), "drop")
        path = write_file(tmp_path / f"s{i}.safetensors", saved.found, training)
        model, opt, sched = saved.live()
        before = snapshot(model, opt, sched)
        with pytest.raises(FormatError, match=f"state key {key!r} is missing"):
            wv.load(model, path, optimizer=opt, scheduler=sched)
        assert same(before, snapshot(model, opt, sched))


def test_a_sequential_schedulers_inner_state_is_checked(tmp_path: Path) -> None:
    model, opt, _ = build("AdamW", seed=0)
    sched = lr_scheduler.SequentialLR(
        opt, [lr_scheduler.LinearLR(opt), lr_scheduler.StepLR(opt, 2)], milestones=[2]
    )
    train(model, opt, sched, steps=3, seed=1)
    found = wv.checkpoint_sources(model, optimizer=opt, scheduler=sched)
    training = copy.deepcopy(found[2])
    inner = training["scheduler"]["state"]["_schedulers"][1]
    inner["gamma"] = "x"
    path = write_file(tmp_path / "seq.safetensors", found, training)
    model2, opt2, _ = build("AdamW", seed=3)
    sched2 = lr_scheduler.SequentialLR(
        opt2, [lr_scheduler.LinearLR(opt2), lr_scheduler.StepLR(opt2, 2)], milestones=[2]
    )
    before = snapshot(model2, opt2, sched2)
    with pytest.raises(FormatError, match=r"'_schedulers'\[1\]\['gamma'\] is a str"):
        wv.load(model2, path, optimizer=opt2, scheduler=sched2)
    assert same(before, snapshot(model2, opt2, sched2))


_HYPERS: dict[str, list[dict[str, Any]]] = {
    "Adam": [{}, {"amsgrad": True}],
    "AdamW": [{}, {"amsgrad": True}],
    "SGD": [{"lr": 0.1}, {"lr": 0.1, "momentum": 0.9}],
    "Adafactor": [{}],
    "RMSprop": [{}, {"momentum": 0.5, "centered": True}],
    "Adagrad": [{}],
}


@pytest.mark.parametrize("cls", sorted(known.OPTIMIZERS))
def test_the_hand_table_agrees_with_torch(cls: str) -> None:
    """The table ``verify`` reads (no torch there) is what torch itself derives: its group
    keys are keys torch needs, of the kinds torch holds; its per-parameter state is the
    state one step of the class keeps, for parameters of 1, 2 and 3 dimensions."""
    assert sorted(_HYPERS) == sorted(known.OPTIMIZERS)
    ctor = getattr(torch.optim, cls)
    for hyper in _HYPERS[cls]:
        opt = ctor([nn.Parameter(torch.ones(2))], **hyper)
        required, reference = group_needs(opt)
        table = known.group_keys("pt", cls)
        assert table is not None and set(table) <= set(required), (cls, required)
        assert {k: kind(plain(reference[k])) for k in table} == table
        group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        for ndim in (1, 2, 3):
            probed = _probe(ctor, group, ndim, torch.float32, torch.device("cpu"))
            listed = known.param_state("pt", cls, group, ndim)
            assert probed is not None and listed is not None
            assert sorted(probed) == sorted(listed), (cls, hyper, ndim)
            # The state a real step leaves on another shape fits both descriptions.
            p = nn.Parameter(torch.ones((5, 4, 3)[:ndim]))
            stepped = ctor([{"params": [p], **group}])
            p.grad = torch.full_like(p, 0.5)
            stepped.step()
            for key, want in probed.items():
                got = tuple(stepped.state[p][key].shape)
                assert want.fits(got, None, p.shape) and listed[key].fits(got, None, p.shape)


@pytest.mark.parametrize("case", ["LambdaLR", "OneCycleLR"])
def test_the_scheduler_table_agrees_with_torch(case: str) -> None:
    sched = build(case, seed=0)[2]
    state, table = plain(sched.state_dict()), known.scheduler_keys("pt", case)
    assert table is not None and {k: kind(state[k]) for k in table} == table


def test_an_unknown_optimizer_is_checked_by_its_parameters_agreeing(tmp_path: Path) -> None:
    """An optimizer class the table does not know is checked by its own consistency: a
    parameter lacking a key that its peers (same group, as many dimensions) hold."""
    model, _, _ = build("AdamW", seed=0)
    opt = torch.optim.NAdam(model.parameters())
    train(model, opt, None, steps=1, seed=1)
    found = wv.checkpoint_sources(model, optimizer=opt)
    training = copy.deepcopy(found[2])
    del training["optimizer"]["params"]["2.weight"]["tensors"]["mu_product"]
    path = write_file(tmp_path / "nadam.safetensors", found, training)
    problems = problems_of("file", path)
    assert len(problems) == 1 and "'2.weight'" in problems[0] and "'mu_product'" in problems[0]
    assert problems_of("file", write_file(tmp_path / "ok.safetensors", found, found[2])) == []
    model2, opt2, _ = build("AdamW", seed=2)
    opt2 = torch.optim.NAdam(model2.parameters())
    with pytest.raises(FormatError, match="'mu_product' is missing"):
        wv.load(model2, path, optimizer=opt2)


def test_a_checkpoint_without_training_state_has_no_problems(tmp_path: Path) -> None:
    wv.save(build("AdamW", seed=0)[0], tmp_path / "w.safetensors")
    with weightvault.formats.open_any(tmp_path / "w.safetensors") as ckpt:
        assert training_state_problems(ckpt) == []


@pytest.mark.parametrize("how", ["drop", "retype"])
def test_a_keras_learning_rate_damaged_is_a_format_error(how: str, tmp_path: Path) -> None:
    """Keras already refuses a slot set that differs; a learning rate it could not restore
    (missing, or a string) used to be skipped in silence and is refused now, before the
    optimizer is built or anything is assigned."""
    keras = pytest.importorskip("keras")
    import numpy as np

    import weightvault.keras as wvk

    def build_keras(seed: int) -> Any:
        keras.utils.set_random_seed(seed)
        inp = keras.Input((4,))
        return keras.Model(inp, keras.layers.Dense(1)(keras.layers.Dense(8)(inp)))

    x, y = np.ones((8, 4), "float32"), np.zeros((8, 1), "float32")
    model, opt = build_keras(0), keras.optimizers.AdamW(1e-3)
    model.compile(optimizer=opt, loss="mse")
    model.train_on_batch(x, y)
    found = wvk.checkpoint_sources(model, optimizer=opt)
    training = damage(found[2], ("group", "0", "learning_rate"), how)
    save_file(path := tmp_path / "k.st", (*found[:2], training), "keras", None, True, False)

    model2, opt2 = build_keras(1), keras.optimizers.AdamW(5e-4)
    model2.compile(optimizer=opt2, loss="mse")
    model2.train_on_batch(x, y)
    values = lambda: [np.array(v) for v in [*model2.weights, *opt2.variables]]  # noqa: E731
    before = values()
    with pytest.raises(FormatError, match="'learning_rate'") as e:
        wvk.load(model2, path, optimizer=opt2)
    assert str(path) in str(e.value)
    assert all(map(np.array_equal, before, values())) and len(before) == len(values())
    problems = problems_of("file", path)
    assert len(problems) == 1 and "group 0 hyperparameter 'learning_rate'" in problems[0]
