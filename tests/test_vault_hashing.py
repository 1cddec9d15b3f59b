"""What a vault save reads: every stored byte hashed once, checksums of held objects reused.

A save must find each tensor's object name (blake3) from its current bytes, every time:
no tensor is skipped as unchanged. The xxh3 checksum a load checks is a function of those
same bytes, so for an object the vault already holds it comes from earlier saves or
records instead of a second pass. These tests count the bytes each hash function sees,
and show that reused checksums still catch a damaged object.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import xxhash  # noqa: E402
from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault._vault.writing.save as save_module  # noqa: E402
from _vault_workers import assert_bitwise, build, snapshot  # noqa: E402
from weightvault import Vault  # noqa: E402

# These tests poke objects/ by path: packs have their own (test_vault_packs.py).
pytestmark = pytest.mark.usefixtures("loose_saves")

WIDTH = 64


@dataclass
class Counts:
    """Buffer sizes passed to each hash function, one entry per call."""

    blake3: list[int] = field(default_factory=list)
    xxh3: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        self.blake3.clear()
        self.xxh3.clear()


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counts]:
    """Count every call of the vault's two hashing entry points (saves hash on threads)."""
    out = Counts()
    real_blake3, real_xxh3 = save_module.content_hash, save_module.checksum

    def blake3(data: memoryview | bytes) -> str:
        with out.lock:
            out.blake3.append(memoryview(data).nbytes)
        return real_blake3(data)

    def xxh3(data: memoryview | bytes) -> str:
        with out.lock:
            out.xxh3.append(memoryview(data).nbytes)
        return real_xxh3(data)

    monkeypatch.setattr(save_module, "content_hash", blake3)
    monkeypatch.setattr(save_module, "checksum", xxh3)
    yield out


def stored_sizes(vault: Vault, name: str) -> list[int]:
    with vault.open(name) as ckpt:
        return sorted(info.nbytes for info in ckpt.stored.values())


def object_path(root: Path, name: str, tensor: str) -> Path:
    doc = json.loads((root / "checkpoints" / f"{name}.json").read_text())
    digest = doc["objects"][tensor]
    return root / "objects" / digest[:2] / digest


def head_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.head.parameters())


def test_each_stored_tensor_is_hashed_once_and_only_new_bytes_are_checksummed(
    tmp_path: Path, counts: Counts
) -> None:
    vault = Vault(tmp_path)
    first = vault.save(build(1, width=WIDTH))
    # The first save holds nothing yet: one blake3 and one xxh3 pass per stored tensor.
    assert sorted(counts.blake3) == stored_sizes(vault, first.name)
    assert sorted(counts.xxh3) == stored_sizes(vault, first.name)

    counts.reset()
    model = build(2, width=WIDTH)  # same frozen backbone, another head
    second = vault.save(model)
    # Every tensor is hashed again, exactly once: nothing is skipped as "unchanged".
    assert sorted(counts.blake3) == stored_sizes(vault, second.name)
    assert sum(counts.blake3) == second.stored_bytes
    # At most the new head is checksummed (a tensor the plan fingerprinted whole has its
    # xxh3 already); the backbone's checksums are reused. Either way the load checks them.
    assert second.new_bytes == head_bytes(model)
    assert sum(counts.xxh3) <= second.new_bytes
    vault.load(build(3, width=WIDTH), second.name)  # verify=True: every checksum checked

    counts.reset()
    third = vault.save(model)  # nothing changed at all
    assert sum(counts.blake3) == third.stored_bytes
    assert third.new_bytes == 0 and counts.xxh3 == []


def test_a_new_vault_object_takes_checksums_from_the_records(
    tmp_path: Path, counts: Counts
) -> None:
    """A resumed run (a new Vault, as in a new process) reads them, it does not rehash."""
    Vault(tmp_path).save(build(1, width=WIDTH))
    counts.reset()
    model = build(2, width=WIDTH)
    rec = Vault(tmp_path).save(model)
    assert sum(counts.blake3) == rec.stored_bytes
    assert sum(counts.xxh3) == rec.new_bytes == head_bytes(model)


def test_reused_checksums_are_those_of_the_bytes(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    vault.save(build(1, width=WIDTH))
    Vault(tmp_path).save(build(2, width=WIDTH))
    vault.save(build(3, width=WIDTH))
    for rec in vault.list():
        with vault.open(rec.name) as ckpt:
            for stored in ckpt.objects:
                data = ckpt.raw(stored)  # the object's raw bytes, decompressed
                assert ckpt.manifest.sums[stored] == xxhash.xxh3_64(data).hexdigest()
    assert vault.verify().ok


def test_an_object_no_record_names_is_checksummed_again(tmp_path: Path, counts: Counts) -> None:
    """Its checkpoint deleted (gc not run yet), a held object has no record to read."""
    Vault(tmp_path).save(build(1, width=WIDTH))
    Vault(tmp_path).delete("000001")
    counts.reset()
    model = build(1, width=WIDTH)
    rec = Vault(tmp_path).save(model)
    assert rec.new_bytes == 0
    assert sum(counts.xxh3) == rec.stored_bytes
    fresh = build(9, backbone_seed=9, width=WIDTH)
    Vault(tmp_path).load(fresh, rec.name)
    assert_bitwise(snapshot(fresh), snapshot(model))


def test_an_unreadable_record_is_skipped_when_looking_up_checksums(tmp_path: Path) -> None:
    Vault(tmp_path).save(build(1, width=WIDTH))
    (tmp_path / "checkpoints" / "broken.json").write_text("{not json")
    model = build(2, width=WIDTH)
    rec = Vault(tmp_path).save(model)
    fresh = build(9, backbone_seed=9, width=WIDTH)
    Vault(tmp_path).load(fresh, rec.name)
    assert_bitwise(snapshot(fresh), snapshot(model))


def test_a_damaged_object_with_a_reused_checksum_is_caught(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compression=None)  # a raw object, so the flip is a wrong value
    vault.save(build(1, width=WIDTH))
    rec = vault.save(build(2, width=WIDTH))  # reuses the backbone's checksums
    vault.wait()  # the damage lands once the background compactor no longer reads it
    path = object_path(tmp_path, rec.name, "backbone.0.weight")
    data = bytearray(path.read_bytes())
    data[7] ^= 0x10
    path.write_bytes(bytes(data))

    model = build(9, backbone_seed=9, width=WIDTH)
    before = snapshot(model)
    with pytest.raises(weightvault.ChecksumError, match=r"backbone\.0\.weight"):
        vault.load(model, rec.name)
    assert_bitwise(snapshot(model), before)  # untouched
    report = vault.verify()
    assert not report.ok
    assert any(
        p.startswith(f"{rec.name}: tensor 'backbone.0.weight'") and "corrupt" in p
        for p in report.problems
    )


def test_a_failed_object_write_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vault = Vault(tmp_path, compaction=None)  # the save's own writes only
    vault.save(build(1, width=WIDTH))
    real_stage = vault.store.stage
    staged = []

    def stage(key: str, data: bytes | memoryview) -> str:
        # Objects are staged (written unsynced) and published together: the second fails.
        if len(staged) == 1:
            raise OSError("disk full")
        staged.append(key)
        return real_stage(key, data)

    monkeypatch.setattr(vault.store, "stage", stage)
    with pytest.raises(OSError, match="disk full"):
        vault.save(build(2, width=WIDTH))
    assert [r.name for r in vault.list()] == ["000001"]
    assert not list((tmp_path / "intents").iterdir())
    # Nothing staged was published, and no temporary file is left behind.
    assert not any((tmp_path / key).exists() for key in staged)
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_a_failing_progress_callback_stops_the_save(tmp_path: Path) -> None:
    vault = Vault(tmp_path)

    def progress(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        vault.save(build(1, width=WIDTH), progress=progress)
    assert list(tmp_path.iterdir()) == []  # stopped while hashing: nothing was written
