"""Lightning ``strategy="ddp"`` under ``torchrun`` (2 processes, gloo) with VaultCheckpointIO.

The ranks start once per launch (a launch costs seconds of imports); a launch that hangs
is killed and fails its test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
import torch
import torch.distributed as dist

if not dist.is_available():  # pragma: no cover - every CPU wheel we test has gloo
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import weightvault
import weightvault.torch as wv

sys.path.insert(0, str(Path(__file__).parent))
from _launch import torchrun

WORKER = str(Path(__file__).parent / "_lightning_ddp_worker.py")
NAMES = ["epoch_0-step_2", "epoch_1-step_4", "epoch_2-step_6"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch: fits with Lightning's own files and with the vault, then a failing one."""
    root = tmp_path_factory.mktemp("ddp")
    torchrun(WORKER, "run", str(root))
    return root


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def test_ddp_fits_into_the_vault_once_per_checkpoint_untouched(run: Path) -> None:
    """Rank 0 alone writes each checkpoint, no .ckpt file appears, and the fit ends
    bitwise equal to the one with Lightning's own checkpoint files."""
    _equal(wv.load_file(run / "own.safetensors"), wv.load_file(run / "vaulted.safetensors"))
    assert [r.name for r in weightvault.Vault(run / "vault").list()] == NAMES
    assert json.loads((run / "saves-0.json").read_text()) == NAMES
    assert json.loads((run / "saves-1.json").read_text()) == []
    assert not list((run / "vaulted").rglob("*.ckpt"))


def test_a_new_torchrun_resumes_from_the_vault_like_from_lightnings_own_file(run: Path) -> None:
    """Both resume at epoch 0 in a new launch, in models of another seed: the vault's
    resume ends bitwise equal to Lightning's own."""
    torchrun(WORKER, "resume", str(run))
    _equal(
        wv.load_file(run / "resumed-own.safetensors"),
        wv.load_file(run / "resumed-vault.safetensors"),
    )
    # Both started training from the checkpoint's weights, not from their own seed.
    with weightvault.Vault(run / "vault").open(NAMES[0]) as ckpt:
        saved = {k.removeprefix("state_dict/"): v for k, v in wv.load_file(ckpt).items()}
    for which in ("own", "vault"):
        start = wv.load_file(run / f"start-{which}.safetensors")
        _equal(start, {k: saved[k] for k in start})


def test_a_failed_save_raises_the_same_weightvault_error_on_every_rank(run: Path) -> None:
    """Rank 0's disk fills at the second checkpoint. Lightning calls the plugin on rank 0
    alone, and rank 1 waits at Lightning's barrier until rank 0 exits; then both have
    raised DistributedCheckpointError (an Exception) naming rank 0's failure, never a
    hang, and the first checkpoint stays loadable."""
    for r in (0, 1):
        raised = json.loads((run / f"error-{r}.json").read_text())
        assert raised["type"] == "DistributedCheckpointError" and raised["weightvault"], raised
        assert "epoch_1-step_4" in raised["message"] and "No space left" in raised["message"]
        assert list(raised["failures"]) == ["0"] and "OSError" in raised["failures"]["0"]
    # Rank 1 stopped on torch's broken barrier, which the weightvault error is raised from.
    assert "RuntimeError" in json.loads((run / "error-1.json").read_text())["cause"]
    vault = weightvault.Vault(run / "vault-failing")
    assert [r.name for r in vault.list()] == NAMES[:1]
    assert vault.verify().problems == []
    with vault.open(NAMES[0]) as ckpt:
        assert wv.load_file(ckpt)  # the earlier checkpoint still loads
