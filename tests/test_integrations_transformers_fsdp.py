"""The Hugging Face Trainer with FSDP2 under ``torchrun`` (2 processes, gloo) with
VaultCallback: every rank saves its shards through ``weightvault.dcp``, and a new launch
resumes bitwise.

The ranks start once per launch; a launch that hangs is killed and fails its test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch
import torch.distributed as dist

if not dist.is_available():  # pragma: no cover - every CPU wheel we test has gloo
    pytest.skip("torch.distributed is not available", allow_module_level=True)
try:
    from transformers.distributed import DistributedConfig  # noqa: F401
except ImportError:  # pragma: no cover - transformers before its native FSDP2 loading
    pytest.skip("transformers cannot shard a model as it loads it", allow_module_level=True)
from transformers import GPT2Config, GPT2LMHeadModel

import weightvault
import weightvault.torch as wv

sys.path.insert(0, str(Path(__file__).parent))
from _launch import torchrun

WORKER = str(Path(__file__).parent / "_hf_fsdp_worker.py")
NAMES = ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def _pretrained(folder: Path, seed: int) -> None:
    """A tied two-block GPT-2 with dropout, saved as ``from_pretrained`` reads it."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
    )  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch: a 6-step FSDP2 run without the callback, one with it, and one whose
    save fails on rank 1."""
    out = tmp_path_factory.mktemp("fsdp")
    _pretrained(out / "init-0", 0)
    _pretrained(out / "init-7", 7)
    torchrun(WORKER, "run", str(out), timeout=300)
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def test_an_fsdp2_trainer_saves_each_shard_once_through_dcp(run: Path) -> None:
    """The callback leaves training untouched; each save step is one DCP checkpoint whose
    shards the two ranks wrote, and one plain process loads its weights."""
    _equal(wv.load_file(run / "own.safetensors"), wv.load_file(run / "vaulted.safetensors"))
    vault = weightvault.Vault(run / "vault")
    assert [r.name for r in vault.list()] == NAMES
    doc = json.loads((run / "vault" / "checkpoints" / "checkpoint-4.json").read_text())
    assert doc["kind"] == "dcp" and len(doc["dcp"]["tables"]) == 2
    assert any(k.startswith("optim.state.") for k in doc["dcp"]["tensors"])
    assert json.loads(doc["metadata"]["trainer_state"])["global_step"] == 4
    assert not list((run / "run").glob("checkpoint-*"))  # the Trainer wrote no folder
    final = wv.load_file(vault.open("checkpoint-6"))
    for name, value in wv.load_file(run / "vaulted.safetensors").items():
        assert torch.equal(value, final[name]), name
    assert vault.verify().ok


def test_a_failed_sharded_save_raises_a_weightvault_error_on_every_rank(run: Path) -> None:
    """Rank 1's disk fills at step 4: both ranks raise DistributedCheckpointError (an
    Exception naming rank 1's OSError); checkpoint-2 stays and verifies."""
    for r in (0, 1):
        raised = json.loads((run / f"error-{r}.json").read_text())
        assert raised["type"] == "DistributedCheckpointError" and raised["weightvault"], raised
        assert "No space left" in raised["message"] and list(raised["failures"]) == ["1"]
    vault = weightvault.Vault(run / "vault-failing")
    assert [r.name for r in vault.list()] == NAMES[:1]
    assert vault.verify().ok


def test_a_new_torchrun_resumes_the_fsdp2_trainer_bitwise(run: Path) -> None:
    """Resumed at step 2 in a new launch, into a model loaded from other weights, with
    shards, AdamW state, scheduler and each rank's RNG restored: the final weights equal
    the uninterrupted run's."""
    torchrun(WORKER, "resume", str(run), "checkpoint-2", timeout=300)
    _equal(wv.load_file(run / "own.safetensors"), wv.load_file(run / "resumed.safetensors"))


def test_a_sharded_checkpoint_is_no_trainer_folder_but_its_weights_load(
    run: Path, tmp_path: Path
) -> None:
    """``checkout`` of a sharded checkpoint says to resume it on the ranks; one plain
    process still loads its weights into the whole model."""
    from weightvault.integrations.transformers import checkout

    with pytest.raises(weightvault.TrainingStateError, match="sharded model's checkpoint"):
        checkout(run / "vault", "checkpoint-2", tmp_path / "co")
    assert not (tmp_path / "co").exists()
    whole = GPT2LMHeadModel.from_pretrained(str(run / "init-7"))
    weightvault.Vault(run / "vault").load(whole, "checkpoint-6")
    final = wv.load_file(run / "vaulted.safetensors")
    for name, value in whole.named_parameters():
        assert torch.equal(value, final[name]), name
