"""weightvault.dcp: DCP checkpoints kept in a vault, on several gloo ranks on CPU.

The multi-rank cases spawn ranks (``tests/_dcp_workers.py``) running a tiny GPT-2 whose
head is tied to its embedding, with a frozen block and AdamW state, sharded by FSDP2's
``fully_shard``. Each spawn costs seconds (importing torch per rank), so one module-level
save feeds the load cases; resharding 4 -> 3 -> 4 is in ``tests/test_dcp_ranks.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import _dcp_workers as W  # noqa: E402
import weightvault  # noqa: E402
import weightvault.dcp as wdcp  # noqa: E402
from _dcp_s3 import moto_s3  # noqa: E402
from _records import read as read_record, rewrite as rewrite_record  # noqa: E402
from weightvault import CheckpointExistsError, Vault  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One FSDP2 save on 2 ranks: checkpoints ``s1`` and ``s1-next``, plus the oracle."""
    d = tmp_path_factory.mktemp("dcp")
    root, oracle = str(d / "vault"), str(d / "oracle")
    W.run_ranks(W.save_fsdp, 2, root, oracle, "s1")
    with open(oracle + ".sizes.json") as f:
        sizes = json.load(f)
    return {"root": root, "oracle": oracle, "sizes": sizes, "dir": d}


def test_fsdp2_save_stores_each_tensor_once(saved: dict[str, Any]) -> None:
    """Objects on disk are within 2% of the unique bytes; DCP's own writer is measured beside.

    The unique bytes are the gathered model (the tied embedding once) plus AdamW state.
    """
    s = saved["sizes"]
    assert s["vault_objects"] <= 1.02 * s["unique"], s
    assert s["record_stored"] <= s["unique"]
    # FileSystemWriter writes the tied embedding under both names (and torch.save framing).
    assert s["filesystem_writer"] > s["vault_objects"], s
    doc = json.loads((Path(saved["root"]) / "checkpoints" / "s1.json").read_text())
    assert doc["kind"] == "dcp"
    assert doc["dcp"]["ties"] == {"model.lm_head.weight": "model.transformer.wte.weight"}
    assert "model.lm_head.weight" not in doc["dcp"]["tensors"]
    assert "model.transformer.h.0.attn.c_attn.weight" in doc["dcp"]["frozen"]
    # Frozen parameters have no optimizer state.
    assert not [k for k in doc["dcp"]["tensors"] if k.startswith("optim.state.transformer.h.0.")]
    # FSDP2 on 2 ranks: the embedding is two chunks, one per rank, each listed in the
    # chunk table of the rank that wrote it; the record keeps only the grid.
    wte = doc["dcp"]["tensors"]["model.transformer.wte.weight"]
    assert wte["grid"] == [W.VOCAB // 2, W.EMBD] and "chunks" not in wte
    assert wte["tables"] == {"start": 0, "strides": [1, 0]}
    assert len(doc["dcp"]["tables"]) == 2 and None not in doc["dcp"]["tables"]
    assert doc["dcp"]["values"]["optim.param_groups.0.betas"] == {"$tuple": [0.9, 0.999]}
    assert doc["metadata"] == {"step": "1"}


def test_unchanged_frozen_chunks_cost_nothing(saved: dict[str, Any]) -> None:
    s = saved["sizes"]
    assert 0 < s["next_new"] <= s["next_stored"] - s["frozen_bytes"], s


def test_nothing_in_the_vault_is_pickled(saved: dict[str, Any]) -> None:
    root = Path(saved["root"])
    files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    assert all(f == "vault.json" or f.startswith(("objects/", "checkpoints/")) for f in files)
    for f in files:
        if not f.startswith("objects/"):
            json.loads((root / f).read_text())  # records are JSON, never pickle


SLOW = pytest.mark.skipif(
    not os.environ.get("WEIGHTVAULT_SLOW"),
    reason="slow; resharding onto 3 ranks runs in tests/test_dcp_ranks.py (WEIGHTVAULT_SLOW=1)",
)


@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=SLOW)])
def test_loads_bitwise_on_any_number_of_ranks(saved: dict[str, Any], world: int) -> None:
    """Saved on 2 ranks; loaded on 1, 2 and 3: model and AdamW state equal bit for bit."""
    stats = str(saved["dir"] / f"reads-{world}.json")
    W.run_ranks(W.load_fsdp, world, saved["root"], saved["oracle"], "s1", stats)
    with open(stats) as f:
        reads = json.load(f)
    record = {r.name: r for r in Vault(saved["root"]).list()}["s1"]
    tied = W.VOCAB * W.EMBD * 4  # the head's bytes: the embedding's memory, read once
    assert len(reads) == world
    if world == 1:
        assert reads == [record.logical_bytes - tied]
    else:
        # Each rank reads its shards (and the replicated scalars), not the whole state.
        assert all(r < 0.75 * record.stored_bytes for r in reads), (reads, record)


def test_one_plain_process_loads_and_exports(saved: dict[str, Any], tmp_path: Path) -> None:
    vault = Vault(saved["root"])
    model = W.gpt2(11)
    for p in model.parameters():
        p.requires_grad_(True)
    report = vault.load(model, "s1", restore_frozen=True)
    assert not report.missing and not report.unexpected
    assert model.lm_head.weight is model.transformer["wte"].weight
    want = load_file(saved["oracle"] + ".safetensors")
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[f"model.{k}"]), k
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == json.loads(Path(saved["oracle"] + ".frozen.json").read_text())

    out = tmp_path / "model.safetensors"
    vault.export("s1", out)
    flat = load_file(str(out))
    assert "lm_head.weight" not in flat  # one copy; the tie is in the manifest
    for k, v in flat.items():
        assert torch.equal(v, want[f"model.{k}"]), k
    back = W.gpt2(12)
    weightvault.torch.load(back, str(out))
    assert back.lm_head.weight is back.transformer["wte"].weight

    assert vault.verify().ok
    assert vault.gc() == 0  # every chunk, optimizer state included, is referenced


def _state(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v for k, v in st.items() if torch.is_tensor(v)})
    return out


def test_retain_drops_a_dcp_checkpoints_optimizer_state_and_keeps_its_weights(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    """``retain(training_state_last=1)`` on an FSDP2 vault (per-rank chunk tables): the
    older checkpoint keeps its weights (load and export bitwise), refuses its optimizer
    state naming itself, and gc frees the optimizer chunks; the newest resumes bitwise."""
    from weightvault._vault.objects.address import object_key

    root = tmp_path / "vault"
    shutil.copytree(saved["root"], root)
    vault = Vault(root)
    with vault.open("s1") as ckpt:
        optim = {d for label, d in ckpt.objects.items() if label.startswith("optim.")}
        model_chunks = {d for label, d in ckpt.objects.items() if label.startswith("model.")}
    with vault.open("s1-next") as ckpt:
        live = set(ckpt.objects.values())
    freed = optim - live - model_chunks
    assert optim and freed
    before = vault.list()[0]

    assert vault.retain(training_state_last=1) == []
    assert [r.weights_only for r in vault.list()] == [True, False]
    after = vault.list()[0]
    assert after.stored_bytes < before.stored_bytes and after.logical_bytes < before.logical_bytes
    doc = json.loads((root / "checkpoints" / "s1.json").read_text())
    kept = [*doc["dcp"]["tensors"], *doc["dcp"]["values"]]
    assert kept and not [k for k in kept if k.startswith("optim.")]

    want = load_file(saved["oracle"] + ".safetensors")
    model = W.gpt2(11)
    vault.load(model, "s1")
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[f"model.{k}"]), k
    vault.export("s1", tmp_path / "s1.safetensors")
    for k, v in load_file(str(tmp_path / "s1.safetensors")).items():
        assert torch.equal(v, want[f"model.{k}"]), k
    fresh = W.gpt2(3)
    with pytest.raises(weightvault.TrainingStateError, match=r"s1\.json holds weights only"):
        wdcp.load(fresh, root, "s1", optimizer=W.optimizer(fresh))
    wdcp.load(fresh, root, "s1")  # the weights alone still load through DCP
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[f"model.{k}"]), k

    assert vault.gc() > 0
    assert not [d for d in freed if vault.store.exists(object_key(d))]
    assert vault.verify().ok
    # The newest kept its optimizer state: it resumes as from the untouched vault.
    a, b = W.gpt2(5), W.gpt2(6)
    opt_a, opt_b = W.optimizer(a), W.optimizer(b)
    wdcp.load(a, root, "s1-next", optimizer=opt_a)
    wdcp.load(b, saved["root"], "s1-next", optimizer=opt_b)
    got, expected = _state(a, opt_a), _state(b, opt_b)
    assert sorted(got) == sorted(expected) and any(k.startswith("optim.") for k in got)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def _as_version_1(root: Path, name: str, to: str) -> None:
    """Checkpoint ``name`` again as ``to``, in the one-JSON record weightvault wrote before
    per-rank chunk tables (every chunk of every tensor inline)."""
    doc = read_record(root / "checkpoints" / f"{name}.json")
    with Vault(root).open(name) as ckpt:
        tensors = {
            fqn: {"dtype": t.dtype, "shape": list(t.shape),
                  "chunks": [[list(c.offsets), list(c.sizes), c.digest] for c in t.chunks]}
            for fqn, t in ckpt.tensors.items()
        }  # fmt: skip
    section = {k: v for k, v in doc["dcp"].items() if k not in ("tables", "table_sizes")}
    doc["dcp"] = {**section, "version": 1, "tensors": tensors}
    rewrite_record(root / "checkpoints" / f"{to}.json", doc)


def test_a_record_of_one_json_still_loads(saved: dict[str, Any]) -> None:
    """Saved on 2 ranks, rewritten as the single-JSON record of before: one plain process
    loads it, and DCP reshards it onto one rank, bitwise."""
    root = Path(saved["root"])
    _as_version_1(root, "s1", "s1-v1")
    want = load_file(saved["oracle"] + ".safetensors")
    plain = W.gpt2(11)
    Vault(root).load(plain, "s1-v1")
    fresh = W.gpt2(12)
    fresh_opt = W.optimizer(fresh)
    wdcp.load(fresh, root, "s1-v1", optimizer=fresh_opt)
    for model in (plain, fresh):
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[f"model.{k}"]), k
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, osd = get_state_dict(fresh, fresh_opt)
    for fqn, st in osd["state"].items():
        for k, t in st.items():
            assert torch.equal(t, want[f"optim.{fqn}.{k}"]), (fqn, k)
    Vault(root).delete("s1-v1")


def test_ddp_replicas_are_written_by_one_rank(tmp_path: Path) -> None:
    W.run_ranks(W.ddp_roundtrip, 2, str(tmp_path / "vault"))


def test_a_rank_failing_mid_save_commits_nothing(tmp_path: Path) -> None:
    W.run_ranks(W.crash_mid_save, 2, str(tmp_path / "vault"))
    vault = Vault(tmp_path / "vault")
    assert [r.name for r in vault.list()] == ["good"]
    assert vault.verify().ok


def test_a_rank_killed_mid_save_commits_nothing_and_the_earlier_checkpoint_loads(
    tmp_path: Path,
) -> None:
    """SIGKILL of one rank while it writes objects: the job dies, no record is committed,
    the earlier checkpoint loads bitwise in one plain process, and gc keeps every object
    that checkpoint needs."""
    import torch.multiprocessing as mp

    root, oracle = tmp_path / "vault", str(tmp_path / "oracle")
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        W.run_ranks(W.killed_mid_save, 2, str(root), oracle)
    vault = Vault(root)
    assert [r.name for r in vault.list()] == ["good"]
    assert vault.verify().ok
    vault.gc()  # the dead rank's intent is fresh: nothing "good" needs may go
    model = W.gpt2(5)
    vault.load(model, "latest")
    want = load_file(oracle + ".safetensors")
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[f"model.{k}"]), k


# -- one process, no process group ----------------------------------------------------------


def _trained(seed: int) -> tuple[Any, Any]:
    model = W.gpt2(seed)
    opt = W.optimizer(model)
    W.train_step(model, opt, seed)
    return model, opt


def test_single_process_roundtrip_and_reuse(tmp_path: Path) -> None:
    model, opt = _trained(1)
    r1 = wdcp.save(model, tmp_path, optimizer=opt)
    assert r1.name == "000001"
    r2 = wdcp.save(model, tmp_path, optimizer=opt)
    assert r2.new_bytes == 0  # nothing changed: every chunk is already there
    with pytest.raises(CheckpointExistsError, match="000001"):
        wdcp.save(model, tmp_path, "000001")
    fresh, fresh_opt = _trained(2)
    stats = wdcp.load(fresh, tmp_path, "000001", optimizer=fresh_opt)
    # Every name is read once, except the tied head: its memory is the embedding's.
    assert stats.skipped_bytes == model.lm_head.weight.numel() * 4
    assert stats.bytes_read + stats.skipped_bytes == r1.logical_bytes
    assert fresh.lm_head.weight is fresh.transformer["wte"].weight
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i, st in want["state"].items():
        for n, t in st.items():
            assert torch.equal(got["state"][i][n], t), (i, n)


def test_plain_dcp_calls_with_the_vault_as_storage(tmp_path: Path) -> None:
    """DCP's own save/load with only the storage swapped (DCP's default planners)."""
    model, _ = _trained(1)
    state = {"model": model.state_dict(), "extra": {"epoch": 3, "tag": "x"}}
    dcp.save(state, storage_writer=wdcp.VaultWriter(tmp_path, "plain"), no_dist=True)
    fresh = W.gpt2(4)
    target = {"model": fresh.state_dict(), "extra": {"epoch": 0, "tag": ""}}
    dcp.load(target, storage_reader=wdcp.VaultReader(tmp_path, "plain"), no_dist=True)
    assert target["extra"] == {"epoch": 3, "tag": "x"}
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    # Without the vault's planner the tie is two names, yet its bytes are one object.
    objects = Vault(tmp_path).store.list("objects")
    assert sum(b.size for b in objects) < sum(
        v.numel() * v.element_size() for v in model.state_dict().values()
    )


def test_values_that_need_pickle_are_refused(tmp_path: Path) -> None:
    state = {"w": torch.ones(2), "obj": {"when": object()}}
    with pytest.raises(CheckpointException, match="without pickle") as e:
        dcp.save(state, storage_writer=wdcp.VaultWriter(tmp_path, "x"), no_dist=True)
    # DCP wraps each rank's error; the rank's own is ours, with both bases.
    (err, _), *_ = e.value.failures.values()
    assert isinstance(err, wdcp.UnstorableValueError)
    assert err.__class__ is weightvault.UnsupportedStateError  # one refusal, one class
    assert isinstance(err, (weightvault.WeightvaultError, TypeError))
    assert "obj" in str(err) and "when" in str(err)  # where the value was found
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_async_save_with_the_vault_writer(tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        model, _ = _trained(1)
        state = {"model": model.state_dict()}
        fut = dcp.async_save(
            state,
            storage_writer=wdcp.VaultWriter(tmp_path / "v", "async"),
            planner=wdcp.VaultSavePlanner(model_prefix="model."),
        )
        fut.result()
        # DCP's stager copies the state first; the copy keeps the tie as one memory.
        doc = json.loads((tmp_path / "v" / "checkpoints" / "async.json").read_text())
        assert doc["dcp"]["ties"] == {"model.lm_head.weight": "model.transformer.wte.weight"}
        fresh = W.gpt2(3)
        Vault(tmp_path / "v").load(fresh, "async")
        assert fresh.lm_head.weight is fresh.transformer["wte"].weight
        for k, v in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v), k
    finally:
        dist.destroy_process_group()


def _chunk_digests(root: Path, name: str) -> set[str]:
    doc = json.loads((root / "checkpoints" / f"{name}.json").read_text())
    return {c[2] for t in doc["dcp"]["tensors"].values() for c in t["chunks"]}


def test_a_dcp_checkpoint_loads_while_a_gc_holds_its_chunks_in_trash(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A running gc moved the chunks into its trash and has not re-read the records yet
    (the state gc.collect is in between its two reads). Every read finds them there, as it
    does a plain checkpoint's objects (Vault.load, wdcp.load, plain dcp.load, Vault.export),
    and verify agrees; before, the loads said "the vault is damaged"."""
    from weightvault._vault.upkeep import gc as _gc

    model, opt = _trained(1)
    rec = wdcp.save(model, tmp_path, optimizer=opt)
    marker = tmp_path / "gc" / "running.json"
    marker.parent.mkdir()
    pid = os.getpid()
    owner = {"pid": pid, "host": socket.gethostname(), "started": _gc.process_start(pid)}
    marker.write_text(json.dumps({"created": time.time(), **owner}))
    digests = _chunk_digests(tmp_path, rec.name)
    for digest in digests:
        trash = tmp_path / "trash" / "running" / digest
        trash.parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "objects" / digest[:2] / digest).rename(trash)
    assert not any(p.is_file() for p in (tmp_path / "objects").rglob("*"))

    vault = Vault(tmp_path)
    plain = W.gpt2(5)
    vault.load(plain, rec.name)  # one process: DcpCheckpoint
    for k, v in model.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k
    fresh, fresh_opt = _trained(2)
    wdcp.load(fresh, vault, rec.name, optimizer=fresh_opt)  # DCP: ranged reads
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    target = {"model": W.gpt2(6).state_dict()}
    dcp.load(target, storage_reader=wdcp.VaultReader(vault, rec.name), no_dist=True)  # plain DCP
    for k, v in model.state_dict().items():
        assert torch.equal(target["model"][k], v), k
    out = tmp_path_factory.mktemp("export") / "model.safetensors"
    vault.export(rec.name, out)
    flat = load_file(str(out))
    for k, v in flat.items():
        assert torch.equal(v, model.state_dict()[k]), k
    with vault.open(rec.name) as ckpt:
        assert ckpt.missing() == {}
    assert vault.verify().ok

    marker.unlink()  # that gc died: the next one puts its trash back and frees nothing
    assert vault.gc() == 0
    assert {p.name for p in (tmp_path / "objects").rglob("*") if p.is_file()} >= digests
    assert not any(p.is_file() for p in (tmp_path / "trash").rglob("*"))


def _old_tags(value: Any) -> Any:
    """``value`` with tuples tagged as weightvault.dcp wrote them before the one codec."""
    if isinstance(value, list):
        return [_old_tags(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"$tuple"}:
            return {"__tuple__": _old_tags(value["$tuple"])}
        return {k: _old_tags(v) for k, v in value.items()}
    return value


def test_a_record_with_the_old_tuple_tag_still_loads(tmp_path: Path) -> None:
    model, opt = _trained(1)
    rec = wdcp.save(model, tmp_path, optimizer=opt)
    path = tmp_path / "checkpoints" / f"{rec.name}.json"
    doc = read_record(path)
    old = _old_tags(doc["dcp"]["values"])
    assert old != doc["dcp"]["values"] and "__tuple__" in json.dumps(old)  # AdamW's betas
    doc["dcp"]["values"] = old
    rewrite_record(path, doc)

    fresh, fresh_opt = _trained(2)
    wdcp.load(fresh, tmp_path, rec.name, optimizer=fresh_opt)
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert want["param_groups"] == got["param_groups"]  # betas a tuple again, not a list
    assert isinstance(got["param_groups"][0]["betas"], tuple)
    for i, st in want["state"].items():
        for n, t in st.items():
            assert torch.equal(got["state"][i][n], t), (i, n)


def test_dcp_takes_a_path_and_reads_no_vault_where_there_is_none(tmp_path: Path) -> None:
    model, _ = _trained(1)
    with pytest.raises(weightvault.VaultNotFoundError, match="check the path"):
        wdcp.load(model, tmp_path / "typo")
    with pytest.raises(CheckpointException, match="no vault here"):  # DCP wraps it
        dcp.load({"model": model.state_dict()},
                 storage_reader=wdcp.VaultReader(str(tmp_path / "typo")), no_dist=True)  # fmt: skip
    assert list(tmp_path.iterdir()) == []


# -- S3 (moto on loopback) -----------------------------------------------------------------


@pytest.fixture
def s3_root(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[tuple[str, dict[str, Any]]]:
    with moto_s3(monkeypatch, tmp_path) as got:
        yield got


def test_s3_vault_roundtrip_with_ranged_reads(s3_root: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_root
    vault = Vault(url, **options)
    model, opt = _trained(1)
    rec = wdcp.save(model, vault, "s3", optimizer=opt)
    fresh, fresh_opt = _trained(2)
    stats = wdcp.load(fresh, vault, "s3", optimizer=fresh_opt)
    assert stats.bytes_read + stats.skipped_bytes == rec.logical_bytes
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    plain = W.gpt2(5)
    vault.load(plain, "s3")
    assert plain.lm_head.weight is plain.transformer["wte"].weight
    assert torch.equal(plain.lm_head.weight, model.lm_head.weight)
    assert vault.verify().ok


def test_import_weightvault_stays_torch_free() -> None:
    import subprocess
    import sys

    code = (
        "import sys, weightvault, weightvault._vault.records.dcp; assert 'torch' not in sys.modules"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
