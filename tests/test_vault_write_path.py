"""How a vault save writes its objects: durability in one batch, one compression per object.

The oracles are the bytes on disk and the raw bytes a load gives back: a save must leave
every object in place and whole (no temporary file behind), whichever way durability was
obtained, and choosing between a delta and a full object on a sample must never change
what loads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import weightvault._base.atomic as atomic  # noqa: E402
import weightvault._vault.objects.encoding as delta_module  # noqa: E402
from weightvault import Vault  # noqa: E402
from weightvault._vault.objects.codec import CODECS  # noqa: E402
from weightvault._vault.objects.encoding import delta_wins  # noqa: E402
from weightvault._vault.store.backend import LocalStore  # noqa: E402

# These tests poke objects/ by path: packs have their own (test_vault_packs.py).
pytestmark = pytest.mark.usefixtures("loose_saves")


def model(n: int = 24, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(32, 32) for _ in range(n)))


def nudge(m: nn.Module, scale: float = 1e-4) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * scale)


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_a_save_syncs_its_objects_in_one_batch_not_one_fsync_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not atomic.syncfs(str(tmp_path)):
        pytest.skip("syncfs(2) is not available here")
    monkeypatch.setattr(atomic, "_others_dirty", lambda own: 0)  # a quiet machine
    calls: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    m = model()
    vault = Vault(tmp_path / "v", compaction=None)  # the save's own writes
    vault.save(m)
    objects = len(list((tmp_path / "v" / "objects").rglob("*")))
    assert objects > 40  # 48 tensors, several folders
    # The record and the vault marker are fsynced (the intent only needs to be seen);
    # the objects are not, one by one: a syncfs made them durable.
    assert len(calls) < 8
    assert temp_files(tmp_path / "v") == []
    fresh = model(seed=1)
    vault.load(fresh)
    assert all(
        torch.equal(a, b)
        for a, b in zip(m.state_dict().values(), fresh.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("why", ["no syncfs", "another job has much to write"])
def test_without_syncfs_each_object_is_fsynced_and_the_save_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    if why == "no syncfs":
        monkeypatch.setattr(atomic, "syncfs", lambda root: False)
    else:
        # syncfs would also wait for the other job's gigabyte: never called then.
        monkeypatch.setattr(atomic, "_others_dirty", lambda own: 1 << 30)
        monkeypatch.setattr(atomic, "syncfs", lambda root: pytest.fail("syncfs called"))
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    m = model()
    Vault(tmp_path / "v", compaction=None).save(m)  # the save's own writes
    assert len(synced) >= 48  # every object file, and their folders
    assert temp_files(tmp_path / "v") == []
    fresh = model(seed=1)
    Vault(tmp_path / "v").load(fresh)
    assert torch.equal(fresh[0].weight, m[0].weight)


def test_a_failed_publish_leaves_no_object_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(str(tmp_path / "s"))
    staged = {
        f"objects/ab/{i:064x}": store.stage(f"objects/ab/{i:064x}", b"x" * 100) for i in range(5)
    }
    assert len(temp_files(tmp_path)) == 5

    def boom(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr("weightvault._vault.store.backend.sync_paths", boom)
    with pytest.raises(OSError, match="disk gone"):
        store.publish(staged)
    assert temp_files(tmp_path) == []
    assert not any(store.exists(k) for k in staged)


def test_a_failed_save_removes_what_it_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vault = Vault(tmp_path / "v", compaction=None)  # the save's own writes
    vault.save(model())
    calls = {"n": 0}
    real = delta_module.Encoder.encode_parts

    def failing(self: Any, digest: str, data: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 10:
            raise RuntimeError("encoder died")
        return real(self, digest, data)

    monkeypatch.setattr(delta_module.Encoder, "encode_parts", failing)
    m = model()
    nudge(m)
    with pytest.raises(RuntimeError, match="encoder died"):
        vault.save(m)
    assert temp_files(tmp_path / "v") == []
    assert len(vault.list()) == 1


def test_the_sample_picks_the_delta_only_when_it_compresses_smaller() -> None:
    codec = CODECS["blosc2"]
    rng = np.random.default_rng(0)
    old = (rng.standard_normal(1 << 18) * 0.02).astype(np.float32)
    close = old + (rng.standard_normal(old.size) * 1e-6).astype(np.float32)
    unrelated = (rng.standard_normal(old.size) * 0.02).astype(np.float32)
    for new, expected in ((close, True), (unrelated, False)):
        raw = memoryview(new.tobytes())
        assert delta_wins(codec, raw, memoryview(old.tobytes()), 4) is expected


def test_a_save_only_hashes_and_writes_raw_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The synchronous part of a save compresses nothing and reads no frame back: it
    hashes, writes raw objects and commits (issue 27); the compactor does the rest."""
    import weightvault._vault.objects.frame as frame_module

    vault = Vault(tmp_path / "v", compaction=None)
    m = model()
    vault.save(m)
    vault.compact()  # the first checkpoint's objects are frames now

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a save encoded or parsed a frame")

    monkeypatch.setattr(frame_module, "encode_frame", refuse)
    monkeypatch.setattr(frame_module, "parse_frame", refuse)
    monkeypatch.setattr(frame_module, "compress_block", refuse)
    nudge(m)
    rec = vault.save(m)
    assert rec.written_bytes == rec.new_bytes > 0
    monkeypatch.undo()
    fresh = model(seed=1)
    vault.load(fresh)
    assert all(
        torch.equal(a, b)
        for a, b in zip(m.state_dict().values(), fresh.state_dict().values(), strict=True)
    )


def test_a_base_another_writer_stored_anew_is_read_back_not_trusted(tmp_path: Path) -> None:
    root = tmp_path / "v"
    vault = Vault(root)
    m = nn.Linear(256, 256)
    vault.save(m)
    nudge(m)
    with torch.no_grad():  # bf16's precision: a whole weight that compresses
        m.weight.copy_(m.weight.to(torch.bfloat16).float())
    vault.save(m)
    nudge(m)
    # Settled: the second save's weight is now a compressed frame this vault's compactor
    # wrote, and no compactor thread reads it any more.
    vault.compact()
    # Another writer stores that weight again, raw, as a vault without compression
    # would: same name, another size. This vault's memory of it is stale. It writes as
    # writers do: a temporary file renamed over the object.
    with vault.open("latest") as ckpt:
        stored = next(n for n in ckpt.objects if n.endswith("weight"))
        weight = ckpt.objects[stored]
        raw = bytes(ckpt.raw(stored))
    path = root / "objects" / weight[:2] / weight
    assert path.stat().st_size < len(raw)  # a compressed frame: the rewrite changes its size
    temporary = path.with_name(f".{weight}.another-writer.tmp")
    temporary.write_bytes(raw)
    os.replace(temporary, path)
    vault.save(m)
    vault.wait()  # the compactor reads that object from its bytes, never from memory
    fresh = nn.Linear(256, 256)
    vault.load(fresh)
    assert torch.equal(fresh.weight, m.weight)
    report = vault.verify()
    assert report.ok, report.problems


def test_training_state_last_keeps_the_disk_at_one_optimizer_state(tmp_path: Path) -> None:
    def disk(root: Path) -> int:
        return sum(p.stat().st_size for p in (root / "objects").rglob("*") if p.is_file())

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    vault = Vault(tmp_path / "v", compression=None, training_state_last=1)
    sizes = []
    for _ in range(4):
        m(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        vault.save(m, optimizer=opt)
        vault.wait()  # the compactor's thread frees what the save dropped
        sizes.append(disk(tmp_path / "v"))
    weights = sum(p.numel() * 4 for p in m.parameters())
    # Each save adds one set of weights; the moments of only the newest stay.
    assert sizes[3] - sizes[2] == pytest.approx(weights, rel=0.02)
    assert sizes[3] == pytest.approx(4 * weights + 2 * weights, rel=0.02)
    assert vault.open("000003").manifest.training is None
    fresh = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    vault.load(fresh, optimizer=fresh_opt)
    for p, q in zip(m.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])


@pytest.mark.parametrize("compaction", ["background", None])
def test_training_state_last_frees_off_the_saves_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compaction: str | None
) -> None:
    """A gc reads every record (0.75 s of each save after 150 saves of the lm run), so
    with a background compactor it runs on that thread, after the save returned."""
    import threading

    import weightvault._vault.upkeep.pacing as vault_module

    threads: list[str] = []
    real = vault_module.collect

    def traced(store: Any) -> int:
        threads.append(threading.current_thread().name)
        return real(store)

    monkeypatch.setattr(vault_module, "collect", traced)
    m = model(4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    vault = Vault(tmp_path / "v", training_state_last=1, compaction=compaction)
    for k in range(3):
        m(torch.randn(2, 32)).sum().backward()
        opt.step()
        vault.save(m, optimizer=opt)
        if compaction is None:  # no compactor: in the save, after each that dropped
            assert len(threads) == k
    vault.wait()
    want = "weightvault-compact" if compaction else threading.current_thread().name
    assert threads and set(threads) == {want}
    assert [r.weights_only for r in vault.list()] == [True, True, False]
    assert vault.verify().ok


def test_a_paced_gc_is_put_off_only_after_a_slow_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import weightvault._vault.upkeep.pacing as vault_module

    vault = Vault(tmp_path / "v")
    vault.save({"w": torch.ones(4)})
    runs: list[int] = []
    monkeypatch.setattr(vault_module, "collect", lambda store: runs.append(1) or 7)
    assert vault.gc(pace=0.1) == 7 and vault.gc(pace=0.1) == 7  # quick gcs always run
    assert len(runs) == 2
    vault._last_gc = (5.0, vault_module.time.monotonic())  # one that took 5 s just ended
    assert vault.gc(pace=0.1) == 0 and len(runs) == 2  # put off: within 50 s of it
    assert vault.gc() == 7 and len(runs) == 3  # an explicit gc always runs
    vault._last_gc = (5.0, vault_module.time.monotonic() - 60)
    assert vault.gc(pace=0.1) == 7 and len(runs) == 4


def test_a_vault_removed_and_made_again_under_a_live_vault_object_saves(tmp_path: Path) -> None:
    import shutil

    vault = Vault(tmp_path / "v")
    m = model(4)
    vault.save(m)
    vault.wait()  # nothing writes under the folder while it is removed
    shutil.rmtree(tmp_path / "v")  # the folders the store knew are gone
    nudge(m)
    vault.save(m)
    fresh = model(4, seed=1)
    Vault(tmp_path / "v").load(fresh)
    assert torch.equal(fresh[0].weight, m[0].weight)
