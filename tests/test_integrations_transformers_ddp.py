"""The Hugging Face Trainer under ``torchrun`` (DDP on 2 processes, gloo) with VaultCallback.

Each launch starts the ranks once per module (a launch costs seconds of imports); a launch
that hangs is killed and fails its test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
import torch
import torch.distributed as dist

if not dist.is_available():  # pragma: no cover - every CPU wheel we test has gloo
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import weightvault
import weightvault.torch as wv

sys.path.insert(0, str(Path(__file__).parent))
from _launch import torchrun

WORKER = str(Path(__file__).parent / "_hf_ddp_worker.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch: an uninterrupted run without the callback, one with it, and two whose
    save fails on rank 0."""
    out = tmp_path_factory.mktemp("ddp")
    torchrun(WORKER, "run", str(out))
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def test_every_save_step_is_one_checkpoint_written_once_by_the_main_process(run: Path) -> None:
    """The 6-step run hung before; now it ends, untouched by the callback, with one
    checkpoint per save step, saved by rank 0 alone and no Trainer folder."""
    _equal(wv.load_file(run / "own.safetensors"), wv.load_file(run / "vaulted.safetensors"))
    vault = weightvault.Vault(run / "vault")
    assert [r.name for r in vault.list()] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert json.loads((run / "saves-0.json").read_text()) == [r.name for r in vault.list()]
    assert json.loads((run / "saves-1.json").read_text()) == []
    assert not list((run / "run").glob("checkpoint-*"))
    assert sorted(p.name for p in (run / "own").glob("checkpoint-*")) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-6"
    ]  # fmt: skip
    final = wv.load_file(vault.open("checkpoint-6"))
    for name, value in wv.load_file(run / "vaulted.safetensors").items():
        assert torch.equal(value, final[name]), name


def test_a_new_torchrun_resumes_from_the_vault_bitwise(run: Path) -> None:
    """Resumed at step 2 in a new launch, from a model of another seed, with each rank's
    RNG states restored: the final weights equal the uninterrupted run's."""
    torchrun(WORKER, "resume", str(run), "checkpoint-2")
    _equal(wv.load_file(run / "own.safetensors"), wv.load_file(run / "resumed.safetensors"))


def test_a_failed_save_on_rank_0_raises_a_weightvault_error_on_every_rank(run: Path) -> None:
    """Rank 0's disk fills at step 4: both ranks raise DistributedCheckpointError (an
    Exception naming rank 0's OSError), foreground or background; checkpoint-2 stays."""
    for mode in ("foreground", "background"):
        for rank in (0, 1):
            raised = json.loads((run / f"error-{mode}-{rank}.json").read_text())
            assert raised["type"] == "DistributedCheckpointError", (mode, rank, raised)
            assert raised["weightvault"] is True
            assert "checkpoint-4" in raised["message"] and "No space left" in raised["message"]
            assert list(raised["failures"]) == ["0"], raised
        vault = weightvault.Vault(run / f"vault-{mode}")
        assert [r.name for r in vault.list()] == ["checkpoint-2"]
        assert vault.verify().problems == []


def test_rank_rng_states_are_stored_once_each_and_checked_when_read() -> None:
    """Ranks seeded alike share one stored state; a damaged table fails before any file
    is written, naming the checkpoint."""
    from weightvault.integrations._rank_rng import decode_ranks, encode_ranks, rank_rng

    first = rank_rng()
    torch.rand(3)  # another rank drew once more
    second = rank_rng()
    doc = json.loads(encode_ranks([first, first, second, first]))
    assert doc["ranks"] == [0, 0, 1, 0] and len(doc["states"]) == 2
    states = decode_ranks(json.dumps(doc), "ckpt")
    assert torch.equal(states[2]["cpu"], torch.get_rng_state())
    assert not torch.equal(states[0]["cpu"], states[2]["cpu"])

    doc["states"][1]["cpu"] = doc["states"][1]["cpu"][:-8]
    with pytest.raises(weightvault.TrainingStateError, match="ckpt: its per-rank RNG"):
        decode_ranks(json.dumps(doc), "ckpt")


def test_a_sharded_model_is_saved_by_every_rank_but_not_in_the_background(
    tmp_path: Path,
) -> None:
    """FSDP2 leaves no process holding the model whole: the callback saves it through
    weightvault.dcp on every rank (tests/test_integrations_transformers_fsdp.py), and says
    at once, on every rank, that it cannot do so in the background."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import TrainerControl, TrainerState

    from weightvault.integrations.transformers import VaultCallback

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'rv'}")
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        args = SimpleNamespace()  # not TrainingArguments: it would set up accelerate's state
        background = VaultCallback(tmp_path / "vault", background=True)
        background.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        VaultCallback(tmp_path / "vault").on_train_begin(
            args, TrainerState(), TrainerControl(), model=model
        )
        with pytest.raises(weightvault.UnsupportedValueError, match=r"'0\.weight' is a shard"):
            background.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    finally:
        dist.destroy_process_group()
    assert not (tmp_path / "vault").exists()
