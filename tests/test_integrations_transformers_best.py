"""The Trainer's best checkpoint through VaultCallback, against the plain Trainer.

Every test runs the plain Trainer (its own ``checkpoint-N`` folders) as the oracle beside
the callback's run: the same final weights bitwise, the same checkpoints kept (folder
names against vault names), the same ``best_metric`` and best step, and the same
``trainer_state.json`` and RNG states for each kept checkpoint.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("transformers")
import torch
import torch.distributed as dist
from transformers import EarlyStoppingCallback, Trainer, TrainerState, TrainingArguments
from transformers.trainer_utils import rotate_checkpoints

import weightvault
import weightvault.torch as wv

sys.path.insert(0, str(Path(__file__).parent))
import _hf_best_worker as best
import _hf_trainer_worker as hf
from _launch import torchrun
from weightvault.integrations._common import best_name, keep_last
from weightvault.integrations.transformers import VaultCallback, checkout, resume

#: Timings differ between any two runs; the rest of a log entry is the run's.
TIMINGS = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}


def trainer(m: torch.nn.Module, folder: Path, callbacks: list[Any], **overrides: Any) -> Trainer:
    """hf's GPT-2 run, evaluated and saved every 2 steps, keeping its best by eval_loss."""
    options: dict[str, Any] = {**best.BEST, **overrides}
    metrics = best.Scores() if options.pop("scores", False) else None  # a new count per run
    return Trainer(
        model=m, args=hf.args(folder, **options), train_dataset=hf.dataset(),
        eval_dataset=best.evalset(), callbacks=callbacks, compute_metrics=metrics,
        data_collator=best.collate,
    )  # fmt: skip


def run(folder: Path, callbacks: list[Any], **overrides: Any) -> tuple[Trainer, dict[str, Any]]:
    t = trainer(hf.model(0), folder, callbacks, **overrides)
    t.train()
    return t, hf.params(t.model)


def folders(out: Path) -> list[str]:
    """The plain run's checkpoint folders, by step."""
    found = [p.name for p in out.glob("checkpoint-*")]
    return sorted(found, key=lambda n: int(n.rsplit("-", 1)[1]))


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """A trainer_state.json as two equal runs write it: the best named by checkpoint (a
    folder path against a vault URL), timings and the FLOP count (which the callback
    cannot reach) left out."""
    doc = dict(doc)
    where = doc.pop("best_model_checkpoint")
    doc["best"] = best_name(where) or (None if where is None else Path(where).name)
    doc.pop("total_flos")
    doc["log_history"] = [
        {k: v for k, v in entry.items() if k not in TIMINGS} for entry in doc["log_history"]
    ]
    return doc


def same_run(
    plain: Trainer, plain_out: Path, ours: Trainer, vault: weightvault.Vault, tmp: Path
) -> None:
    """The callback's run kept what the plain run kept, named its best alike, and stored
    for each kept checkpoint the Trainer state and RNG states the plain run stored."""
    assert not list(Path(ours.args.output_dir).glob("checkpoint-*"))  # no folder of its own
    kept = folders(plain_out)
    assert [r.name for r in vault.list()] == kept
    assert ours.state.best_metric == plain.state.best_metric
    assert ours.state.best_global_step == plain.state.best_global_step
    assert plain.state.best_model_checkpoint is not None
    mine = best_name(ours.state.best_model_checkpoint)
    assert mine == Path(plain.state.best_model_checkpoint).name
    assert vault.marks() == {"best": mine}
    for name in kept:
        stored = json.loads(vault.open(name).manifest.metadata["trainer_state"])
        theirs = json.loads((plain_out / name / "trainer_state.json").read_text())
        assert comparable(stored) == comparable(theirs), name
        co = checkout(vault, name, tmp / f"co-{name}")
        a = torch.load(plain_out / name / "rng_state.pth", weights_only=False)
        b = torch.load(co / "rng_state.pth", weights_only=False)
        assert a["python"] == b["python"], name
        assert all(str(x) == str(y) for x, y in zip(a["numpy"], b["numpy"], strict=True)), name
        assert torch.equal(a["cpu"], b["cpu"]), name


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The plain Trainer's run for some settings, run once per module."""
    runs: dict[str, tuple[Trainer, dict[str, torch.Tensor], Path]] = {}

    def get(**overrides: Any) -> tuple[Trainer, dict[str, torch.Tensor], Path]:
        key = json.dumps(overrides, sort_keys=True)
        if key not in runs:
            out = tmp_path_factory.mktemp("plain") / "out"
            patience = overrides.pop("early_stopping", None)
            stop = [] if patience is None else [EarlyStoppingCallback(patience)]
            t, params = run(out, stop, **overrides)
            runs[key] = (t, params, out)
        return runs[key]

    return get


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 8), limit=st.integers(-1, 5), best_at=st.none() | st.integers(0, 7))
def test_retention_keeps_what_the_trainers_rotation_keeps(
    count: int, limit: int, best_at: int | None
) -> None:
    """Any number of checkpoints, limit and best: the vault's retention with keep_last
    (the marked best kept besides) leaves the folders the Trainer's rotation leaves."""
    names = [f"checkpoint-{2 * (i + 1)}" for i in range(count)]
    best_one = None if best_at is None or best_at >= count else names[best_at]
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            (Path(tmp) / name).mkdir()
        where = None if best_one is None else str(Path(tmp) / best_one)
        rotate_checkpoints(tmp, save_total_limit=limit, best_model_checkpoint=where)
        theirs = sorted(p.name for p in Path(tmp).iterdir())
    keep = keep_last(names, limit, best_one)
    ours = names if keep is None else names[-keep:] + [best_one] * (best_one is not None)
    assert sorted(set(ours)) == theirs


@pytest.mark.parametrize(
    ("limit", "lr", "best_step", "background"),
    [(2, 3e-2, 2, False), (2, 3e-2, 2, True), (1, 3e-2, 2, False), (1, 1e-2, 4, False),
     (3, 1e-2, 4, False)],
)  # fmt: skip
def test_the_best_is_kept_loaded_and_named_as_the_trainer_does(
    plain: Any, tmp_path: Path, limit: int, lr: float, best_step: int, background: bool
) -> None:
    """save_total_limit keeps the best and the newest (the best alone at the end with a
    limit of 1), and the run ends with the best's weights, as the plain Trainer's does,
    with saves in the background too."""
    theirs, final, out = plain(save_total_limit=limit, learning_rate=lr)
    assert theirs.state.best_global_step == best_step  # the case this parameter is for
    vault = weightvault.Vault(tmp_path / "vault")
    callback = VaultCallback(vault, background=background)
    ours, params = run(tmp_path / "out", [callback], save_total_limit=limit, learning_rate=lr)
    same_weights(final, params)
    same_run(theirs, out, ours, vault, tmp_path)
    # The best as the vault names it: loads, checks out and ends the run alike.
    fresh = hf.model(7)
    vault.load(fresh, "best")
    same_weights(final, hf.params(fresh))
    co = checkout(vault, ours.state.best_model_checkpoint, tmp_path / "best")
    weights = wv.load_file(co / "model.safetensors")  # the tied head too, as an alias
    same_weights(final, {k: weights[k] for k in final})
    assert vault.verify().ok


def test_save_strategy_best_saves_where_the_trainer_writes_and_keeps_its_first_tie(
    plain: Any, tmp_path: Path
) -> None:
    """save_strategy="best" saves only at a new best, by the Trainer's strict comparison:
    a score equal to the best is no new best, so no save (and no folder)."""
    settings = {"save_strategy": "best", "metric_for_best_model": "score",
                "greater_is_better": True, "scores": True}  # fmt: skip
    theirs, final, out = plain(**settings)
    assert folders(out) == ["checkpoint-2", "checkpoint-4"]  # 1.0, 2.0; the tie at 6 is not
    assert theirs.state.best_global_step == 4
    vault = weightvault.Vault(tmp_path / "vault")
    ours, params = run(tmp_path / "out", [VaultCallback(vault)], **settings)
    same_weights(final, params)
    same_run(theirs, out, ours, vault, tmp_path)


@pytest.mark.parametrize("route", ["resume", "checkout"])
def test_a_resumed_run_keeps_its_best(plain: Any, tmp_path: Path, route: str) -> None:
    """Resumed at step 6, past the best (step 2), into a model of another seed: the run
    keeps best_metric and its best checkpoint, and ends with its weights bitwise."""
    theirs, final, out = plain()
    vault = weightvault.Vault(tmp_path / "vault")
    run(tmp_path / "first", [VaultCallback(vault)])  # its 8, 10 and 12 are replaced
    again = trainer(hf.model(7), tmp_path / "again", [VaultCallback(vault)])
    if route == "resume":
        resume(again, vault, "checkpoint-6")
    else:
        folder = checkout(vault, "checkpoint-6", tmp_path / "co")
        # Valid for the Trainer: it names no folder, and keeps the best's metric and step.
        saved = TrainerState.load_from_json(str(folder / "trainer_state.json"))
        assert saved.best_model_checkpoint is None
        assert (saved.best_metric, saved.best_global_step) == (theirs.state.best_metric, 2)
        again.train(resume_from_checkpoint=str(folder))
    same_weights(final, hf.params(again.model))
    same_run(theirs, out, again, vault, tmp_path)


def test_early_stopping_patience_continues_across_a_resume(plain: Any, tmp_path: Path) -> None:
    """EarlyStoppingCallback(3) after the best at step 2 stops the run at step 8. Its
    counter is stored with each checkpoint as the Trainer stores it, even listed after
    VaultCallback, so a run resumed at step 6 (counter 2) with
    restore_callback_states_from_checkpoint stops at step 8, as the Trainer's own does."""

    def stopping() -> EarlyStoppingCallback:
        return EarlyStoppingCallback(early_stopping_patience=3)

    theirs, final, out = plain(early_stopping=3)
    assert theirs.state.global_step == 8 < best.BEST["max_steps"]
    vault = weightvault.Vault(tmp_path / "vault")
    ours, params = run(tmp_path / "out", [VaultCallback(vault), stopping()])
    same_weights(final, params)
    same_run(theirs, out, ours, vault, tmp_path)
    counter = json.loads(vault.open("checkpoint-6").manifest.metadata["trainer_state"])
    assert counter["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"] == {
        "early_stopping_patience_counter": 2
    }
    # The Trainer restores callbacks' states when asked to, from its folder as from ours.
    restore = {"restore_callback_states_from_checkpoint": True}
    own = trainer(hf.model(7), tmp_path / "own", [stopping()], **restore)
    own.train(resume_from_checkpoint=str(out / "checkpoint-6"))
    again = trainer(hf.model(7), tmp_path / "again", [VaultCallback(vault), stopping()], **restore)
    resume(again, vault, "checkpoint-6")
    assert again.state.global_step == own.state.global_step == 8
    same_weights(hf.params(own.model), hf.params(again.model))
    same_weights(final, hf.params(again.model))
    same_run(theirs, out, again, vault, tmp_path)


def test_load_best_without_evaluations_is_refused_naming_the_setting(tmp_path: Path) -> None:
    """The Trainer refuses it with save_strategy="steps"; with save_strategy="best" it
    would never save, and the callback refuses it before training, writing nothing."""
    with pytest.raises(ValueError, match="load_best_model_at_end requires the save and eval"):
        hf.args(tmp_path / "out", load_best_model_at_end=True, eval_strategy="no")
    for load, setting in ((True, "load_best_model_at_end=True"), (False, 'save_strategy="best"')):
        settings = {"eval_strategy": "no", "save_strategy": "best", "load_best_model_at_end": load}
        t = trainer(hf.model(0), tmp_path / "out", [VaultCallback(tmp_path / "vault")], **settings)
        assert isinstance(t.args, TrainingArguments)  # the Trainer takes it, and never saves
        with pytest.raises(ValueError, match=f'{setting} needs evaluations.*eval_strategy="steps"'):
            t.train()
        assert not (tmp_path / "vault").exists()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_ddp_keeps_and_loads_the_best_as_the_plain_trainer(tmp_path: Path) -> None:
    """2 processes (gloo): rank 0 writes each checkpoint once, the best is kept and
    marked, and every rank ends with its weights, as the plain Trainer's ranks do."""
    torchrun(str(Path(__file__).parent / "_hf_best_worker.py"), str(tmp_path), timeout=240)
    plain_run = json.loads((tmp_path / "plain.json").read_text())
    ours = json.loads((tmp_path / "vaulted.json").read_text())
    assert plain_run["folders"] == ["checkpoint-2", "checkpoint-6"]  # the best and the newest
    assert ours["names"] == plain_run["folders"] and ours["folders"] == []
    assert ours["best"] == plain_run["best"] and ours["metric"] == plain_run["metric"]
    assert ours["marks"] == {"best": "checkpoint-2"}
    for r in (0, 1):
        same_weights(
            wv.load_file(tmp_path / f"plain-{r}.safetensors"),
            wv.load_file(tmp_path / f"vaulted-{r}.safetensors"),
        )
    final = wv.load_file(tmp_path / "plain-0.safetensors")
    stored = wv.load_file(weightvault.Vault(tmp_path / "vault").open("best"))
    same_weights(final, {k: stored[k] for k in final})  # and the tied head, an alias
