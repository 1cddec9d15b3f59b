"""The Hugging Face Trainer checkpoints into a vault and resumes from it, bitwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch

import weightvault
import weightvault.torch as wv

sys.path.insert(0, str(Path(__file__).parent))
import _hf_trainer_worker as hf
from weightvault.integrations.transformers import VaultCallback, checkout, resume

WORKER = str(Path(__file__).parent / "_hf_trainer_worker.py")


def _env() -> dict[str, str]:
    # Same thread count as this process: a reduction split over other threads rounds
    # differently, and the comparison is bitwise.
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH")] if p)
    # Another test may have changed this process's torch threads (set_num_threads
    # persists): the worker takes the count this process has now.
    env["WEIGHTVAULT_TEST_THREADS"] = str(torch.get_num_threads())
    return env


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The run without the callback (the Trainer writes its own folders)."""
    tmp = tmp_path_factory.mktemp("straight")
    m = hf.model(0)
    hf.trainer(m, tmp / "out", []).train()
    assert sorted(p.name for p in (tmp / "out").iterdir()) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-6"
    ]  # fmt: skip
    return hf.params(m)


@pytest.fixture(scope="module")
def vaulted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], int]:
    tmp = tmp_path_factory.mktemp("vaulted")
    vault = weightvault.Vault(tmp / "vault")
    m = hf.model(0)
    hf.trainer(m, tmp / "out", [VaultCallback(vault)]).train()
    assert not list((tmp / "out").glob("checkpoint-*"))
    trainable = sum(p.numel() * p.element_size() for p in wv.trainable(m))
    return tmp / "vault", hf.params(m), trainable


def test_training_with_the_callback_is_untouched_and_writes_no_folder(
    straight: dict[str, torch.Tensor], vaulted: tuple[Path, dict[str, torch.Tensor], int]
) -> None:
    _, params, _ = vaulted
    assert sorted(params) == sorted(straight)
    for name, value in straight.items():
        assert torch.equal(value, params[name]), name


def test_checkpoints_are_named_by_step_and_cost_only_what_trains(
    vaulted: tuple[Path, dict[str, torch.Tensor], int],
) -> None:
    folder, _, trainable = vaulted
    records = {r.name: r for r in weightvault.Vault(folder).list()}
    assert sorted(records) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert records["checkpoint-4"].metadata["global_step"] == "4"
    # Weights, exp_avg and exp_avg_sq of the trainable parameters; the frozen blocks and
    # the tied head are already in the vault.
    ratio = records["checkpoint-4"].new_bytes / (3 * trainable)
    assert 0.95 <= ratio <= 1.10, ratio


@pytest.mark.parametrize("route", ["resume", "checkout"])
def test_a_new_process_resumes_from_the_vault_bitwise(
    route: str,
    straight: dict[str, torch.Tensor],
    vaulted: tuple[Path, dict[str, torch.Tensor], int],
    tmp_path: Path,
) -> None:
    """Resumed from checkpoint-2 into a model built from another seed; ends bitwise equal."""
    folder, _, _ = vaulted
    name = "checkpoint-2" if route == "resume" else "checkpoint-2:folder"
    out = tmp_path / "resumed.safetensors"
    subprocess.run(
        [sys.executable, WORKER, str(folder), name, "7", str(out)],
        env=_env(), check=True, timeout=300,
    )  # fmt: skip
    resumed = wv.load_file(out)
    assert sorted(resumed) == sorted(straight)
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key


def test_a_peft_lora_model_stores_its_base_once_and_resumes(
    tmp_path: Path,
) -> None:
    """LoRA on the same GPT-2: checkpoints after the first cost only the adapters and
    their AdamW state; a resume through ``checkout`` ends bitwise equal."""
    peft = pytest.importorskip("peft")

    def lora(seed: int) -> torch.nn.Module:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1)
        return peft.get_peft_model(hf.model(seed, frozen=0), config)

    vault = weightvault.Vault(tmp_path / "vault")
    m = lora(0)
    hf.trainer(m, tmp_path / "out", [VaultCallback(vault)]).train()
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    records = vault.list()
    assert [r.name for r in records] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    adapters = sum(p.numel() * p.element_size() for p in wv.trainable(m))
    base = sum(p.numel() * p.element_size() for p in m.parameters() if not p.requires_grad)
    assert adapters < base / 20
    assert records[0].new_bytes > base
    for r in records[1:]:
        ratio = r.new_bytes / (3 * adapters)
        assert 0.95 <= ratio <= 1.25, (r.name, ratio)

    # The Trainer resumes a PeftModel from model.safetensors with the full state dict.
    straight = hf.params(m)
    again = lora(7)
    t = hf.trainer(again, tmp_path / "again", [])
    t.train(resume_from_checkpoint=str(checkout(vault, "checkpoint-2", tmp_path / "co")))
    resumed = hf.params(again)
    for key, value in straight.items():
        assert torch.equal(value, resumed[key]), key


def test_the_trainer_example_runs(tmp_path: Path) -> None:
    """examples/trainer_callback.py: no folders, later checkpoints cost 3x what trains,
    and the resumed run is bitwise equal."""
    script = Path(__file__).resolve().parents[1] / "examples" / "trainer_callback.py"
    result = subprocess.run(
        [sys.executable, str(script), "--vault", "v"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_env(), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Trainer folders written: []" in result.stdout
    assert "checkpoint-8   new bytes" in result.stdout and "(3.00x" in result.stdout
    assert "parameters bitwise identical: True" in result.stdout


def test_save_total_limit_is_vault_retention_and_background_saves_match(
    straight: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    vault = weightvault.Vault(tmp_path / "vault")
    m = hf.model(0)
    callback = VaultCallback(vault, background=True)
    hf.trainer(m, tmp_path / "out", [callback], save_total_limit=2).train()
    assert [r.name for r in vault.list()] == ["checkpoint-4", "checkpoint-6"]
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    # As the Trainer's folder deletion does, the deleted checkpoint's bytes are gone.
    assert vault.gc() == 0 and vault.verify().ok
    params = hf.params(m)
    for name, value in straight.items():
        assert torch.equal(value, params[name]), name
    # The background checkpoint holds the values at its step: it equals the final weights.
    final = wv.load_file(vault.open("checkpoint-6"))
    for name, value in params.items():
        assert torch.equal(value, final[name]), name


@pytest.mark.parametrize("kind", [str, Path])
def test_the_vault_may_be_given_as_a_path(kind: type, tmp_path: Path) -> None:
    """``VaultCallback``, ``checkout`` and ``resume`` take ``"runs/vault"`` as a ``Vault``."""
    folder = tmp_path / "runs" / "vault"
    m = hf.model(0)
    hf.trainer(m, tmp_path / "out", [VaultCallback(kind(folder))], max_steps=4).train()
    assert [r.name for r in weightvault.Vault(folder).list()] == ["checkpoint-2", "checkpoint-4"]
    trained = hf.params(m)

    weights = wv.load_file(checkout(kind(folder), "latest", tmp_path / "co") / "model.safetensors")
    for name, value in trained.items():
        assert torch.equal(value, weights[name]), name

    again = hf.model(7)
    resume(hf.trainer(again, tmp_path / "again", [], max_steps=4), kind(folder), "checkpoint-2")
    for name, value in trained.items():
        assert torch.equal(value, hf.params(again)[name]), name


def test_training_state_last_keeps_every_weight_and_the_newest_resumable(
    straight: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """``training_state_last=2``: checkpoint-2 keeps its weights but not its training state
    (its checkout names it), and a resume from checkpoint-4 ends bitwise equal."""
    vault = weightvault.Vault(tmp_path / "vault")
    m = hf.model(0)
    hf.trainer(m, tmp_path / "out", [VaultCallback(vault, training_state_last=2)]).train()
    records = vault.list()
    assert [(r.name, r.weights_only) for r in records] == [
        ("checkpoint-2", True), ("checkpoint-4", False), ("checkpoint-6", False)
    ]  # fmt: skip
    final = wv.load_file(vault.open("checkpoint-6"))
    with vault.open("checkpoint-2") as ckpt:
        early = wv.load_file(ckpt)
        assert sorted(early) == sorted(final)  # every weight, and only weights
    with pytest.raises(weightvault.TrainingStateError, match=r"checkpoint-2\.json holds weights"):
        checkout(vault, "checkpoint-2", tmp_path / "co")
    assert not (tmp_path / "co").exists()
    # The callback freed what the dropped state held: nothing is left for a gc.
    assert vault.gc() == 0 and vault.verify().ok
    fresh = hf.model(7)
    vault.load(fresh, "checkpoint-2")  # the weights-only checkpoint still loads
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, early[name]), name

    again = hf.model(7)
    resume(hf.trainer(again, tmp_path / "again", []), vault, "checkpoint-4")
    for name, value in straight.items():
        assert torch.equal(value, hf.params(again)[name]), name

    with pytest.raises(ValueError, match="training_state_last must be at least 1"):
        VaultCallback(vault, training_state_last=0)
