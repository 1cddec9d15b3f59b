"""weightvault.dcp used the way DCP users use it (issue 18): a reader shared by ranks that
resolve "latest" apart, a reused reader, process-based ``async_save``, a natural resume with
a fresh optimizer, frozen flags the checkpoint does not hold, and a failed save caught by
``except Exception``.

Multi-rank cases spawn gloo ranks on CPU (bodies in ``tests/_dcp_peer_workers.py``).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import _dcp_peer_workers as P  # noqa: E402
import _dcp_workers as W  # noqa: E402
import weightvault  # noqa: E402
import weightvault.dcp as wdcp  # noqa: E402


def test_ranks_read_one_checkpoint_when_latest_moves_during_a_load(tmp_path: Path) -> None:
    """B is committed between the ranks' ``read_metadata``: every rank reads the
    coordinator's choice (all A, or all B), never A's shard on one rank and B's on the other."""
    W.run_ranks(P.latest_race, 2, str(tmp_path))


def test_async_save_with_the_process_checkpointer(tmp_path: Path) -> None:
    """DCP's process checkpointer pickles the storage writer and planner into its own
    process; on 2 FSDP2 ranks the committed checkpoint loads back bitwise."""
    W.run_ranks(P.async_process_save, 2, str(tmp_path / "vault"))
    doc = json.loads((tmp_path / "vault" / "checkpoints" / "async.json").read_text())
    assert doc["dcp"]["ties"] == {"model.lm_head.weight": "model.transformer.wte.weight"}


def test_a_fresh_model_and_optimizer_resume_on_fsdp2(tmp_path: Path) -> None:
    """The natural resume: a fully trainable model and a fresh AdamW, 2 FSDP2 ranks."""
    W.run_ranks(P.resume_fresh, 2, str(tmp_path / "vault"))


# -- one process ---------------------------------------------------------------------------


def _x(value: float) -> dict[str, Any]:
    return {"x": torch.arange(4.0) + value}


def test_a_reused_reader_resolves_latest_at_every_load(tmp_path: Path) -> None:
    dcp.save(_x(0), storage_writer=wdcp.VaultWriter(tmp_path, "a"), no_dist=True)
    reader = wdcp.VaultReader(tmp_path)
    target = _x(-9)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["x"], _x(0)["x"])
    dcp.save(_x(100), storage_writer=wdcp.VaultWriter(tmp_path, "b"), no_dist=True)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["x"], _x(100)["x"])  # before: "a" again
    assert (reader.name, reader.resolved) == ("latest", "b")
    reader.reset("a")  # DCP's checkpoint_id
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["x"], _x(0)["x"])


def test_vault_writer_and_reader_pickle_as_the_vaults_url(tmp_path: Path) -> None:
    """What DCP's process checkpointer does to the storage writer: pickle, rebuild, save."""
    vault = weightvault.Vault(tmp_path, gc_wait=12.5)
    copy = pickle.loads(pickle.dumps(vault))
    assert (copy.url, copy.gc_wait) == (vault.url, 12.5)
    writer = pickle.loads(pickle.dumps(wdcp.VaultWriter(vault, "w")))
    model, _ = _trained(1)
    state = {"model": model.state_dict()}
    dcp.save(state, storage_writer=writer, planner=wdcp.VaultSavePlanner(), no_dist=True)
    assert writer.record is not None and writer.record.name == "w"
    reader = pickle.loads(pickle.dumps(wdcp.VaultReader(vault, "w")))
    fresh = W.gpt2(9)
    target = {"model": fresh.state_dict()}
    dcp.load(target, storage_reader=reader, no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(target["model"][k], v), k


def _trained(seed: int) -> tuple[Any, Any]:
    model = W.gpt2(seed)
    opt = W.optimizer(model)
    W.train_step(model, opt, seed)
    return model, opt


def _trainable(model: Any) -> Any:
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def _state_of(opt: Any, p: Any) -> dict[str, Any]:
    return dict(opt.state.get(p, {}))


@pytest.mark.parametrize("strict", [True, False])
def test_a_fresh_optimizer_resumes_and_nothing_is_made_up(tmp_path: Path, strict: bool) -> None:
    """A script that builds the model (all trainable) and AdamW, then loads: block 0, frozen
    in the checkpoint, is frozen again and has no optimizer state; before, a strict load
    said "Missing key ... step" and a lenient one gave it step 1 and zero moments."""
    model, opt = _trained(1)
    wdcp.save(model, tmp_path, "a", optimizer=opt)
    fresh = _trainable(W.gpt2(2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    wdcp.load(fresh, tmp_path, "a", optimizer=fresh_opt, strict=strict)
    got = {n: p.requires_grad for n, p in fresh.named_parameters()}
    assert got == {n: p.requires_grad for n, p in model.named_parameters()}
    block0 = [p for n, p in fresh.named_parameters() if n.startswith("transformer.h.0.")]
    assert block0 and not any(_state_of(fresh_opt, p) for p in block0)
    saved = dict(zip(model.parameters(), fresh.parameters(), strict=True))
    for p, q in saved.items():
        for k, t in _state_of(opt, p).items():
            assert torch.equal(_state_of(fresh_opt, q)[k], t), k


def test_restore_frozen_false_keeps_the_models_flags_and_invents_no_state(
    tmp_path: Path,
) -> None:
    model, opt = _trained(1)
    wdcp.save(model, tmp_path, "a", optimizer=opt)
    fresh = _trainable(W.gpt2(2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    wdcp.load(fresh, tmp_path, "a", optimizer=fresh_opt, restore_frozen=False)
    assert all(p.requires_grad for p in fresh.parameters())
    block0 = fresh.transformer["h"][0].parameters()
    assert not any(_state_of(fresh_opt, p) for p in block0)  # AdamW starts it on its step


def test_a_parameter_the_checkpoint_lacks_keeps_its_flag(tmp_path: Path) -> None:
    """A frozen new head stays frozen when a backbone is loaded with strict=False."""
    backbone = torch.nn.ModuleDict({"body": torch.nn.Linear(4, 4)})
    wdcp.save(backbone, tmp_path, "pretrained")
    model = torch.nn.ModuleDict({"body": torch.nn.Linear(4, 4), "head": torch.nn.Linear(4, 2)})
    model["body"].weight.requires_grad_(False)
    model["head"].requires_grad_(False)
    wdcp.load(model, tmp_path, "pretrained", strict=False)
    assert torch.equal(model["body"].weight, backbone["body"].weight)
    assert model["body"].weight.requires_grad  # the checkpoint holds it: its flag
    assert not model["head"].weight.requires_grad and not model["head"].bias.requires_grad


def _trained_then_frozen() -> tuple[Any, Any, Any]:
    model = _trainable(W.gpt2(1))
    opt = W.optimizer(model)
    W.train_step(model, opt, 1)
    block = model.transformer["h"][1]
    block.requires_grad_(False)  # trained, then frozen: AdamW keeps its state
    W.train_step(model, opt, 2)
    return model, opt, block.mlp["c_fc"].weight


def _fresh_like(model: Any) -> tuple[Any, Any]:
    fresh = _trainable(W.gpt2(7))
    fresh.transformer["h"][1].requires_grad_(False)
    return fresh, W.optimizer(fresh)


def test_a_trained_then_frozen_parameter_keeps_its_state_through_dcp(tmp_path: Path) -> None:
    """DCP's own set_optimizer_state_dict drops it (pytorch #192202); our record holds it."""
    model, opt, p = _trained_then_frozen()
    wdcp.save(model, tmp_path, "tf", optimizer=opt)
    for restore in (True, False):
        fresh, fresh_opt = _fresh_like(model)
        wdcp.load(fresh, tmp_path, "tf", optimizer=fresh_opt, restore_frozen=restore)
        q = fresh.transformer["h"][1].mlp["c_fc"].weight
        assert not q.requires_grad
        got = _state_of(fresh_opt, q)
        assert sorted(got) == ["exp_avg", "exp_avg_sq", "step"]
        for k, t in opt.state[p].items():
            assert torch.equal(got[k], t), k


def test_a_trained_then_frozen_parameter_keeps_its_state_through_the_vault(
    tmp_path: Path,
) -> None:
    model, opt, p = _trained_then_frozen()
    vault = weightvault.Vault(tmp_path)
    vault.save(model, "tf", optimizer=opt)
    fresh, fresh_opt = _fresh_like(model)
    vault.load(fresh, "tf", optimizer=fresh_opt)
    got = _state_of(fresh_opt, fresh.transformer["h"][1].mlp["c_fc"].weight)
    for k, t in opt.state[p].items():
        assert torch.equal(got[k], t), k


# -- failures are Exceptions ---------------------------------------------------------------


def test_a_failed_save_is_an_exception_naming_the_rank(tmp_path: Path) -> None:
    vault = weightvault.Vault(tmp_path)

    def stage(key: str, data: Any) -> str:  # every object write (Store.stage)
        raise OSError(28, "No space left on device")

    vault.store.stage = stage  # type: ignore[method-assign]
    model, opt = _trained(1)
    with pytest.raises(Exception) as e:  # what a training loop catches
        wdcp.save(model, vault, "full", optimizer=opt)
    err = e.value
    assert isinstance(err, weightvault.DistributedCheckpointError)
    assert isinstance(err.__cause__, CheckpointException)
    assert "rank 0: OSError" in str(err) and "No space left" in str(err)
    assert isinstance(err.failures[0], OSError)
    assert "full" in str(err) and str(tmp_path) in str(err)
    assert vault.list() == []  # nothing committed


def test_a_failed_load_is_an_exception(tmp_path: Path) -> None:
    model, opt = _trained(1)
    rec = wdcp.save(model, tmp_path, optimizer=opt)
    for obj in (tmp_path / "objects").rglob("*"):
        if obj.is_file():
            obj.unlink()
    fresh, fresh_opt = _trained(2)
    with pytest.raises(weightvault.DistributedCheckpointError, match="vault is damaged") as e:
        wdcp.load(fresh, tmp_path, rec.name, optimizer=fresh_opt)
    assert isinstance(e.value.failures[0], weightvault.FormatError)
