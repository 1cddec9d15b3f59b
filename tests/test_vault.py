"""The vault's API, content addressing and integrity checks, on a local folder.

A vault keeps every distinct tensor once across checkpoints (objects named by their blake3
hash) and commits a checkpoint by creating its record exclusively. These tests pin the
public contract: what save returns, names, refusals, every load option, list/delete/gc,
verify, export and retain; that an unchanged (frozen) tensor costs no new bytes; and that
damaged objects or records are reported and never loaded.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault.torch as wvt  # noqa: E402
from _records import read as read_record, rewrite as rewrite_record, seal  # noqa: E402
from _vault_workers import assert_bitwise, build, snapshot  # noqa: E402
from weightvault import (  # noqa: E402
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointRecord,
    FormatError,
    LoadReport,
    Vault,
    VaultVerifyReport,
    WeightvaultError,
)

# These tests poke objects/ by path: packs have their own (test_vault_packs.py).
pytestmark = pytest.mark.usefixtures("loose_saves")

# -- helpers ---------------------------------------------------------------------------


def tree_bytes(root: Path) -> int:
    """What the vault folder really takes: every file's size, found by walking it."""
    return sum(
        os.path.getsize(os.path.join(folder, f))
        for folder, _, files in os.walk(root)
        for f in files
    )


def record(root: Path, name: str) -> dict[str, Any]:
    return json.loads((root / "checkpoints" / f"{name}.json").read_text())  # type: ignore[no-any-return]


def object_path(root: Path, name: str, tensor: str) -> Path:
    """The object file that holds ``tensor`` of checkpoint ``name``."""
    digest = record(root, name)["objects"][tensor]
    return root / "objects" / digest[:2] / digest


def object_files(root: Path) -> set[str]:
    """Digests of every object file (temporary files left out)."""
    out = set()
    for _, _, files in os.walk(root / "objects"):
        out |= {f for f in files if not f.startswith(".")}
    return out


def referenced(root: Path) -> set[str]:
    out: set[str] = set()
    for f in (root / "checkpoints").glob("*.json"):
        out |= set(json.loads(f.read_text())["objects"].values())
    return out


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def head_bytes(model: nn.Module) -> int:
    return nbytes(model.head.parameters())


def fresh(width: int = 64) -> nn.Module:
    """A model of ``build``'s architecture with other values and nothing frozen."""
    model = build(987_654, backbone_seed=987_654, width=width)
    wvt.unfreeze(model)
    return model


# -- opening -----------------------------------------------------------------------------


def test_the_first_save_creates_the_vault_and_it_reopens(tmp_path: Path) -> None:
    root = tmp_path / "runs" / "ft"
    vault = Vault(root)  # a PathLike; opening creates nothing
    assert not root.exists()
    vault.save(build(1, width=64), "first")  # parents created
    text = (root / "vault.json").read_text()
    marker = json.loads(text)
    assert (
        marker["format"] == "weightvault-vault" and marker["version"] == 2
    )  # layout 2: packs (docs/format.md)

    again = Vault(str(root))
    assert [r.name for r in again.list()] == ["first"]
    assert [r.name for r in Vault(f"file://{root}").list()] == ["first"]
    assert (root / "vault.json").read_text() == text  # left as it was


READS: list[tuple[str, Any]] = [
    ("list", lambda v: v.list()),
    ("resolve", lambda v: v.resolve("latest")),
    ("open", lambda v: v.open("latest")),
    ("load", lambda v: v.load(build(1, width=16), "000001")),
    ("verify", lambda v: v.verify()),
    ("export", lambda v: v.export("000001", v.url + ".safetensors")),
    ("gc", lambda v: v.gc()),
    ("delete", lambda v: v.delete("000001")),
    ("retain", lambda v: v.retain(keep_last=1)),
    ("break_gc_lock", lambda v: v.break_gc_lock()),
    ("disk_bytes", lambda v: v.disk_bytes()),
]


@pytest.mark.parametrize("read", [r for _, r in READS], ids=[n for n, _ in READS])
def test_reading_a_path_with_no_vault_creates_nothing(tmp_path: Path, read: Any) -> None:
    root = tmp_path / "typo"
    with pytest.raises(weightvault.VaultNotFoundError) as e:
        read(Vault(root))
    message = str(e.value)
    assert str(root) in message and "check the path" in message and "save" in message
    assert isinstance(e.value, FileNotFoundError)
    assert list(tmp_path.iterdir()) == []  # no folder, no marker, no exported file


def test_an_empty_folder_is_no_vault_until_the_first_save(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    with pytest.raises(weightvault.VaultNotFoundError):
        vault.list()
    assert list(tmp_path.iterdir()) == []
    vault.save(build(1, width=16))
    assert [r.name for r in vault.list()] == ["000001"]  # the same Vault now finds it


def test_create_makes_the_vault_at_once(tmp_path: Path) -> None:
    root = tmp_path / "new"
    vault = Vault(root, create=True)
    assert sorted(p.name for p in root.iterdir()) == ["vault.json"]
    marker = (root / "vault.json").read_bytes()
    assert vault.list() == [] and vault.verify().ok and vault.gc() == 0
    Vault(root, create=True)  # an existing vault is left as it is
    assert (root / "vault.json").read_bytes() == marker


def test_a_file_is_not_a_vault(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"not a folder")
    with pytest.raises(FormatError, match=r"model\.safetensors: this is a file"):
        Vault(path)
    with pytest.raises(FormatError, match="this is a file"):
        Vault(tmp_path / "model.safetensors", create=True)
    assert path.read_bytes() == b"not a folder" and os.listdir(tmp_path) == [path.name]


@pytest.mark.parametrize("content", [b'{"format": "something-else", "version": 1}', b"\x00nope"])
def test_vault_refuses_a_folder_that_is_not_a_vault(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "vault.json").write_bytes(content)
    with pytest.raises(FormatError, match=r"vault\.json"):
        Vault(tmp_path)
    with pytest.raises(FormatError, match=r"vault\.json"):
        Vault(tmp_path, create=True)
    assert os.listdir(tmp_path) == ["vault.json"]  # nothing added
    assert (tmp_path / "vault.json").read_bytes() == content


# -- saving ------------------------------------------------------------------------------


def test_save_returns_the_committed_record(tmp_path: Path) -> None:
    vault = Vault(tmp_path / "v")
    model = build(1, width=64)
    logical = nbytes(model.state_dict().values())

    before = time.time()
    rec = vault.save(model, metadata={"step": "100", "lr": "3e-4"})
    after = time.time()

    assert isinstance(rec, CheckpointRecord)
    assert rec.name == "000001"
    assert before <= rec.created <= after
    assert rec.logical_bytes == logical
    assert rec.new_bytes == logical  # an empty vault: everything is new
    assert rec.metadata == {"step": "100", "lr": "3e-4"}
    assert vault.list() == [rec]

    again = vault.save(model)
    assert again.new_bytes == 0 and again.logical_bytes == logical
    assert again.metadata == {}
    # A successful save (and its compaction) leaves no intent and no gc marker behind.
    vault.wait()
    assert not list((tmp_path / "v" / "intents").iterdir())
    assert not (tmp_path / "v" / "gc").exists() or not list((tmp_path / "v" / "gc").iterdir())


def test_default_names_increase_and_list_is_oldest_first(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    names = [vault.save(build(i, width=16)).name for i in range(3)]
    names.append(vault.save(build(3, width=16), "keep").name)
    names += [vault.save(build(i, width=16)).name for i in range(4, 6)]

    assert names == ["000001", "000002", "000003", "keep", "000004", "000005"]
    listed = vault.list()
    assert [r.name for r in listed] == names
    assert [r.created for r in listed] == sorted(r.created for r in listed)
    assert [r.metadata for r in listed] == [{}] * 6


def test_default_names_are_never_reused(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    vault.save(build(1, width=16))
    second = vault.save(build(2, width=16)).name
    vault.delete(second)
    third = vault.save(build(3, width=16)).name
    assert third > second


def test_an_existing_name_is_refused_and_the_checkpoint_kept(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    original = build(1, width=64)
    vault.save(original, "keep")
    before = object_files(tmp_path)

    with pytest.raises(CheckpointExistsError, match="keep") as info:
        vault.save(build(2, width=64), "keep")
    assert isinstance(info.value, FileExistsError)
    assert isinstance(info.value, WeightvaultError)

    assert object_files(tmp_path) == before  # refused before writing anything
    assert [r.name for r in vault.list()] == ["keep"]
    model = fresh()
    vault.load(model, "keep")
    assert_bitwise(snapshot(model), snapshot(original))


def test_a_name_taken_between_check_and_commit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exclusive create is the commit: another writer's record is never overwritten."""
    vault = Vault(tmp_path, compression=None)  # raw objects: bytes are counted
    original = build(1, width=64)
    vault.save(original, "keep")
    # Another writer created "keep" after our existence check: make that check miss it.
    real_exists = vault.store.exists
    monkeypatch.setattr(
        vault.store,
        "exists",
        lambda key: False if key.startswith("checkpoints/") else real_exists(key),
    )

    intruder = build(2, width=64)
    with pytest.raises(CheckpointExistsError, match="another writer"):
        vault.save(intruder, "keep")

    model = fresh()
    vault.load(model, "keep")
    assert_bitwise(snapshot(model), snapshot(original))
    vault.wait()
    assert not list((tmp_path / "intents").iterdir())
    # The refused save's head objects were written and are now unreferenced: gc frees them.
    assert vault.gc() == head_bytes(intruder)
    assert object_files(tmp_path) == referenced(tmp_path)


def test_auto_names_retry_when_another_writer_takes_the_next_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vault = Vault(tmp_path)
    first = build(1, width=64)
    vault.save(first)
    from weightvault._vault.writing import commit

    real = commit.next_name
    calls: list[str] = []

    def stale_next_name(store: Any) -> str:
        # The first pick is a name another writer committed meanwhile.
        calls.append("x")
        return "000001" if len(calls) == 1 else real(store)

    monkeypatch.setattr(commit, "next_name", stale_next_name)
    rec = vault.save(build(2, width=64))
    assert rec.name == "000002" and len(calls) == 2
    model = fresh()
    vault.load(model, "000001")
    assert_bitwise(snapshot(model), snapshot(first))


@pytest.mark.parametrize("name", ["latest", "", "../escape", "a/b", ".hidden", "x" * 129, "a b"])
def test_bad_names_are_refused(tmp_path: Path, name: str) -> None:
    vault = Vault(tmp_path)
    with pytest.raises(ValueError, match="not allowed"):
        vault.save(build(1, width=16), name)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_save_refuses_what_no_adapter_knows(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="does not know how to save"):
        Vault(tmp_path).save(object())


# -- loading -----------------------------------------------------------------------------


def test_load_defaults_to_latest_and_loads_any_checkpoint_exactly(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    saved = []
    for seed in range(3):
        model = build(seed, width=64)
        vault.save(model)
        saved.append(snapshot(model))

    model = fresh()
    report = vault.load(model)
    assert isinstance(report, LoadReport)
    assert report.ok and report.missing == [] and report.unexpected == []
    assert sorted(report.loaded) == sorted(saved[-1])
    assert_bitwise(snapshot(model), saved[-1])
    for i, name in enumerate(["000001", "000002", "000003"]):
        vault.load(model, name)
        assert_bitwise(snapshot(model), saved[i])


def test_load_restore_frozen_brings_the_flags_back(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    vault.save(build(1, width=32))
    backbone = [n for n, _ in build(1, width=32).backbone.named_parameters()]

    model = fresh(32)
    vault.load(model)  # flags are left alone without restore_frozen
    assert all(p.requires_grad for p in model.parameters())

    report = vault.load(model, restore_frozen=True)
    assert sorted(report.frozen) == sorted(f"backbone.{n}" for n in backbone)
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == [
        f"backbone.{n}" for n in backbone
    ]
    assert all(p.requires_grad for p in model.head.parameters())


def test_load_strict_and_rules(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    saved = build(1, width=32)
    # A dict of tensors under a prefix the model lacks (not a wrapper's: those are stripped).
    vault.save({f"net.{k}": v for k, v in saved.state_dict().items()}, "compiled")
    vault.save(saved, "plain")

    model = fresh(32)
    with pytest.raises(weightvault.KeyMismatchError):
        vault.load(model, "compiled")
    assert_bitwise(snapshot(model), snapshot(fresh(32)))  # all or nothing

    report = vault.load(model, "compiled", rules=[("net.*", "*")])
    assert len(report.renamed) == len(saved.state_dict())
    assert_bitwise(snapshot(model), snapshot(saved))

    bigger = nn.Sequential()
    bigger.add_module("backbone", fresh(32).backbone)
    bigger.add_module("head", fresh(32).head)
    bigger.add_module("extra", nn.Linear(2, 2))
    with pytest.raises(weightvault.KeyMismatchError):
        vault.load(bigger, "plain")
    report = vault.load(bigger, "plain", strict=False)
    assert sorted(report.missing) == ["extra.bias", "extra.weight"]
    assert torch.equal(bigger.head.weight, saved.head.weight)


def test_load_tie_and_cast(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    tied = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    tied[1].weight = tied[0].weight
    rec = vault.save(tied, "tied")
    assert rec.logical_bytes == 2 * 8 * 8 * 4 and rec.new_bytes == 8 * 8 * 4  # stored once

    apart = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    report = vault.load(apart, "tied")
    assert apart[0].weight is not apart[1].weight and report.untied
    report = vault.load(apart, "tied", tie=True)
    assert apart[0].weight is apart[1].weight and report.tied
    assert torch.equal(apart[0].weight, tied[0].weight)

    wide = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)).double()
    with pytest.raises(weightvault.ShapeMismatchError):
        vault.load(wide, "tied")
    vault.load(wide, "tied", cast=True)
    assert torch.equal(wide[0].weight, tied[0].weight.double())


def test_load_takes_every_option_of_torch_load(tmp_path: Path) -> None:
    """Each keyword of weightvault.torch.load, passed at its default, reaches the adapter."""
    vault = Vault(tmp_path)
    saved = build(1, width=32)
    vault.save(saved)
    params = inspect.signature(wvt.load).parameters
    options = {n: p.default for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert {"strict", "rules", "tie", "restore_frozen", "verify", "cast", "mmap"} <= set(options)
    model = fresh(32)
    vault.load(model, "latest", **options)
    assert_bitwise(snapshot(model), snapshot(saved))

    mapped = fresh(32)
    vault.load(mapped, mmap=True)
    assert_bitwise(snapshot(mapped), snapshot(saved))
    with torch.no_grad():
        mapped.head.weight.add_(1.0)  # copy-on-write: the object is never changed
    assert vault.verify().ok


def test_unknown_names_raise_and_list_the_known_ones(tmp_path: Path) -> None:
    vault = Vault(tmp_path, create=True)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoints"):
        vault.load(fresh(16))
    vault.save(build(1, width=16), "alpha")
    vault.save(build(2, width=16), "beta")

    calls = [
        lambda: vault.load(fresh(16), "gamma"),
        lambda: vault.delete("gamma"),
        lambda: vault.export("gamma", tmp_path / "out.safetensors"),
        lambda: vault.open("gamma"),
    ]
    for call in calls:
        with pytest.raises(CheckpointNotFoundError) as info:
            call()
        assert isinstance(info.value, LookupError)
        assert "gamma" in str(info.value)
        assert "alpha" in str(info.value) and "beta" in str(info.value)
    assert not (tmp_path / "out.safetensors").exists()


# -- list, delete, gc, verify, export, retain ------------------------------------------


def test_delete_then_gc_frees_exactly_the_unshared_bytes(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compression=None)  # raw objects: bytes are counted
    models = [build(seed, width=256) for seed in range(4)]
    saved = [snapshot(m) for m in models]
    for m in models:
        vault.save(m)
    assert vault.disk_bytes() == tree_bytes(tmp_path)
    disk_before, tree_before = vault.disk_bytes(), tree_bytes(tmp_path)
    record_size = (tmp_path / "checkpoints" / "000002.json").stat().st_size

    vault.delete("000002")
    assert [r.name for r in vault.list()] == ["000001", "000003", "000004"]
    with pytest.raises(CheckpointNotFoundError):
        vault.load(fresh(256), "000002")
    # Objects stay until gc; a tiny tombstone keeps the number from being handed out again.
    tombstone = (tmp_path / "deleted" / "000002.json").stat().st_size
    assert tombstone < 100
    assert vault.disk_bytes() == disk_before - record_size + tombstone

    freed = vault.gc()
    assert freed == head_bytes(models[1])  # the backbone is shared with the others
    assert vault.disk_bytes() == disk_before - record_size + tombstone - freed
    assert tree_bytes(tmp_path) == tree_before - record_size + tombstone - freed
    assert object_files(tmp_path) == referenced(tmp_path)
    assert vault.gc() == 0
    assert not list((tmp_path / "gc").iterdir())  # the gc marker is gone

    for name, i in [("000001", 0), ("000003", 2), ("000004", 3)]:
        model = fresh(256)
        vault.load(model, name)
        assert_bitwise(snapshot(model), saved[i])
    assert vault.verify().ok

    # Deleting every checkpoint lets gc free every object.
    for r in vault.list():
        vault.delete(r.name)
    assert vault.gc() > 0
    assert object_files(tmp_path) == set()
    tombstones = sum(f.stat().st_size for f in (tmp_path / "deleted").iterdir())
    assert vault.disk_bytes() == (tmp_path / "vault.json").stat().st_size + tombstones


def test_verify_reports_ok_with_counts(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    for seed in range(3):
        vault.save(build(seed, width=32))
    report = vault.verify()
    assert isinstance(report, VaultVerifyReport)
    assert report.ok and report.problems == []
    assert report.checkpoints == 3
    assert report.objects == len(object_files(tmp_path)) == 4 + 3 * 2  # backbone + 3 heads


def test_export_writes_a_standalone_safetensors_file(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    vault = Vault(tmp_path / "v")
    model = build(5, width=64)
    model.add_module("tied", nn.Linear(64, 64, bias=False))
    model.tied.weight = model.head.weight  # an alias, stored once
    vault.save(model, metadata={"step": "7"})
    vault.save(build(6, width=64))

    out = tmp_path / "export.safetensors"
    size = vault.export("000001", out)
    assert size == out.stat().st_size

    plain = safetensors_torch.load_file(str(out))
    expected = snapshot(model)
    assert set(plain) <= set(expected) and "head.weight" in plain
    for name, value in plain.items():
        assert torch.equal(value, expected[name]), name

    # weightvault reads it back whole: aliases, metadata, frozen flags and checksums.
    assert weightvault.verify(out).ok
    full = wvt.load_file(out)
    assert_bitwise(full, expected)
    assert full["tied.weight"] is full["head.weight"]
    assert weightvault.inspect(out).metadata == {"step": "7"}
    other = fresh(64)
    other.add_module("tied", nn.Linear(64, 64, bias=False))
    report = wvt.load(other, out, restore_frozen=True, tie=True)
    assert other.tied.weight is other.head.weight
    assert not other.backbone[0].weight.requires_grad and report.frozen


def test_retain_keeps_the_last_and_every_nth(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    for seed in range(7):
        vault.save(build(seed, width=16))
    assert vault.retain() == []
    assert len(vault.list()) == 7

    deleted = vault.retain(keep_last=2, keep_every=3)
    assert deleted == ["000001", "000002", "000004", "000005"]
    assert [r.name for r in vault.list()] == ["000003", "000006", "000007"]
    assert vault.gc() > 0
    assert vault.verify().ok

    assert vault.retain(keep_last=1) == ["000003", "000006"]
    assert [r.name for r in vault.list()] == ["000007"]
    model = fresh(16)
    vault.load(model)
    assert_bitwise(snapshot(model), snapshot(build(6, width=16)))


# -- content addressing ------------------------------------------------------------------


def test_frozen_backbone_costs_nothing_after_the_first_checkpoint(tmp_path: Path) -> None:
    """AdamW steps on the head between saves: each later save adds exactly the head."""
    torch.manual_seed(0)
    width, saves = 512, 5
    model = nn.Sequential()
    model.add_module(
        "backbone",
        nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU()),
    )
    model.add_module("head", nn.Linear(width, 64))
    frozen_names = wvt.freeze(model, "backbone")
    opt = torch.optim.AdamW(wvt.trainable(model), lr=1e-3, weight_decay=0.1)
    full = nbytes(model.state_dict().values())
    trainable = nbytes(wvt.trainable(model))
    assert trainable == head_bytes(model) and trainable < full / 10

    vault = Vault(tmp_path, compression=None)  # raw objects: bytes are counted
    records, saved = [], []
    for _ in range(saves):
        before = snapshot(model)
        for _ in range(2):
            x = torch.randn(16, width)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        after = snapshot(model)
        changed = [n for n in after if not torch.equal(after[n], before[n])]
        assert sorted(changed) == ["head.bias", "head.weight"]  # the premise of the test
        records.append(vault.save(model, metadata={"step": str(len(records))}))
        saved.append(after)

    assert records[0].new_bytes == full
    for rec in records[1:]:
        assert rec.new_bytes == trainable
        assert rec.logical_bytes == full
    expected = full + (saves - 1) * trainable
    assert abs(vault.disk_bytes() - expected) <= 0.05 * expected
    assert vault.disk_bytes() == tree_bytes(tmp_path)

    for rec, values in zip(records, saved, strict=True):
        other = nn.Sequential()
        other.add_module(
            "backbone",
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU()),
        )
        other.add_module("head", nn.Linear(width, 64))
        report = vault.load(other, rec.name, restore_frozen=True)
        assert_bitwise(snapshot(other), values)
        assert sorted(report.frozen) == sorted(frozen_names)
        assert [n for n, p in other.named_parameters() if not p.requires_grad] == frozen_names


def test_gpt2_with_frozen_blocks_stores_only_what_training_changed(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        n_positions=32,
        vocab_size=500,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    # Every block but the last; the embeddings (tied to lm_head) keep training.
    frozen = wvt.freeze(model, "transformer.h.0")
    assert frozen and all(n.startswith("transformer.h.0.") for n in frozen)
    opt = torch.optim.AdamW(wvt.trainable(model), lr=1e-3)
    trainable = {id(p): p for p in wvt.trainable(model)}

    vault = Vault(tmp_path)
    records, saved = [], []
    ids = torch.randint(0, 500, (2, 16))
    for _ in range(3):
        before = {id(p): p.detach().clone() for p in trainable.values()}
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        changed = sum(
            p.numel() * p.element_size()
            for k, p in trainable.items()
            if not torch.equal(p, before[k])
        )
        records.append((vault.save(model), changed))
        saved.append(snapshot(model))

    trainable_bytes = nbytes(trainable.values())
    for rec, changed in records[1:]:
        # Every trainable tensor moved (the tied wte/lm_head counted once); nothing else.
        assert rec.new_bytes == changed == trainable_bytes
    first = records[0][0]
    # Tied lm_head, and equal copies (LayerNorm ones, zero biases), are stored once.
    assert first.new_bytes == first.stored_bytes <= first.logical_bytes - 500 * 64 * 4

    for (rec, _), values in zip(records, saved, strict=True):
        other = transformers.GPT2LMHeadModel(config)
        report = vault.load(other, rec.name, restore_frozen=True)
        assert other.lm_head.weight is other.transformer.wte.weight
        assert_bitwise(snapshot(other), values)
        assert sorted(report.frozen) == sorted(frozen)
    assert vault.verify().ok


# -- integrity ---------------------------------------------------------------------------


def _damage(path: Path, kind: str) -> None:
    if kind == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    elif kind == "truncate":
        path.write_bytes(path.read_bytes()[:-4])
    else:
        path.unlink()


PROBLEM = {"flip": "corrupt", "truncate": "truncated", "delete": "missing"}


@pytest.fixture
def two_checkpoints(tmp_path: Path) -> tuple[Vault, Path]:
    vault = Vault(tmp_path)
    vault.save(build(1, width=64))
    vault.save(build(2, width=64))
    vault.wait()  # compacted: the tests' damage lands on the objects as they stay
    return vault, tmp_path


@pytest.mark.parametrize("kind", ["flip", "truncate", "delete"])
def test_a_damaged_object_is_reported_and_never_loaded(
    two_checkpoints: tuple[Vault, Path], kind: str
) -> None:
    vault, root = two_checkpoints
    _damage(object_path(root, "000002", "head.weight"), kind)

    report = vault.verify()
    assert not report.ok
    assert len(report.problems) == 1
    problem = report.problems[0]
    assert problem.startswith("000002: tensor 'head.weight'") and PROBLEM[kind] in problem

    model = fresh()
    before = snapshot(model)
    with pytest.raises(WeightvaultError, match=r"head\.weight"):
        vault.load(model, "000002")
    assert_bitwise(snapshot(model), before)  # untouched
    # The other checkpoint does not use that object and still loads.
    vault.load(model, "000001")
    assert_bitwise(snapshot(model), snapshot(build(1, width=64)))


def test_damage_to_shared_and_private_objects_is_reported_per_checkpoint(
    two_checkpoints: tuple[Vault, Path],
) -> None:
    vault, root = two_checkpoints
    _damage(object_path(root, "000001", "backbone.0.weight"), "flip")  # shared by both
    _damage(object_path(root, "000001", "head.bias"), "truncate")
    _damage(object_path(root, "000002", "head.weight"), "delete")

    report = vault.verify()
    assert not report.ok
    assert sorted(p.split(": object")[0] for p in report.problems) == [
        "000001: tensor 'backbone.0.weight'",
        "000001: tensor 'head.bias'",
        "000002: tensor 'backbone.0.weight'",
        "000002: tensor 'head.weight'",
    ]
    by_tensor = {p.split(": object")[0]: p for p in report.problems}
    assert "corrupt" in by_tensor["000001: tensor 'backbone.0.weight'"]
    assert "corrupt" in by_tensor["000002: tensor 'backbone.0.weight'"]
    assert "truncated" in by_tensor["000001: tensor 'head.bias'"]
    assert "missing" in by_tensor["000002: tensor 'head.weight'"]

    for name in ["000001", "000002"]:
        model = fresh()
        before = snapshot(model)
        with pytest.raises(WeightvaultError) as info:
            vault.load(model, name)
        assert "backbone.0.weight" in str(info.value) or "head." in str(info.value)
        assert_bitwise(snapshot(model), before)
    with pytest.raises(WeightvaultError):
        vault.export("000001", root / "out.safetensors")


def test_a_flipped_byte_in_a_shared_object_names_the_tensor_on_load(
    two_checkpoints: tuple[Vault, Path],
) -> None:
    vault, root = two_checkpoints
    _damage(object_path(root, "000001", "backbone.2.bias"), "flip")
    model = fresh()
    before = snapshot(model)
    with pytest.raises(weightvault.ChecksumError, match=r"backbone\.2\.bias") as info:
        vault.load(model, "000002")
    assert info.value.names == ["backbone.2.bias"]
    assert_bitwise(snapshot(model), before)


@pytest.mark.parametrize(
    "content",
    [
        b'{"version": 1, "created": 1',  # cut short
        b"[1, 2, 3]",
        "fields missing",
    ],
)
def test_a_corrupt_record_is_reported_and_refused(
    two_checkpoints: tuple[Vault, Path], content: bytes | str
) -> None:
    vault, root = two_checkpoints
    objects = object_files(root)
    path = root / "checkpoints" / "000001.json"
    if content == "fields missing":
        doc = read_record(path)
        del doc["header"], doc["created"]
        content = seal(json.dumps(doc)).encode()  # sealed: the fields' check is reached
    assert isinstance(content, bytes)
    path.write_bytes(content)

    report = vault.verify()
    assert not report.ok
    assert len(report.problems) == 1 and report.problems[0].startswith("000001: record")

    model = fresh()
    before = snapshot(model)
    with pytest.raises(FormatError, match="000001"):
        vault.load(model, "000001")
    assert_bitwise(snapshot(model), before)
    vault.load(model, "000002")  # the other one is unaffected
    assert_bitwise(snapshot(model), snapshot(build(2, width=64)))

    # gc cannot tell what the unreadable record referenced: it must not free anything.
    with contextlib.suppress(FormatError):
        vault.gc()
    assert object_files(root) == objects


def test_a_record_with_a_bad_object_digest_is_refused(two_checkpoints: tuple[Vault, Path]) -> None:
    vault, root = two_checkpoints
    path = root / "checkpoints" / "000002.json"
    doc = read_record(path)
    doc["objects"]["head.weight"] = "../../vault.json"
    rewrite_record(path, doc)
    assert not vault.verify().ok
    with pytest.raises(FormatError, match="objects"):
        vault.load(fresh(), "000002")


def test_gc_refuses_to_guess_when_a_record_lacks_its_objects(tmp_path: Path) -> None:
    """A record gc cannot read might need any object: gc deletes nothing and says why."""
    vault = Vault(tmp_path)
    vault.save(build(0))
    vault.save(build(1))
    record = tmp_path / "checkpoints" / "000002.json"
    doc = read_record(record)
    del doc["objects"]
    rewrite_record(record, doc)
    before = object_files(tmp_path)
    with pytest.raises(weightvault.FormatError, match=r"gc deleted nothing.*'000002'"):
        vault.gc()
    assert object_files(tmp_path) == before


def test_a_dead_gc_marker_stops_blocking_saves(tmp_path: Path) -> None:
    """A gc killed mid-run leaves its marker; saves wait only until its heartbeat is stale."""
    from weightvault._vault.upkeep import gc as _gc

    vault = Vault(tmp_path, gc_wait=5)
    (tmp_path / "gc").mkdir()
    marker = tmp_path / "gc" / "dead.json"
    marker.write_text("{}")
    old = time.time() - _gc.GC_STALE_SECONDS - 1
    os.utime(marker, (old, old))
    started = time.monotonic()
    vault.save(build(0))
    assert time.monotonic() - started < 2

    os.utime(marker, None)  # a live gc: the save waits, then gives up with a clear error
    with pytest.raises(weightvault.WeightvaultError, match="a gc has been running"):
        Vault(tmp_path, gc_wait=0.2).save(build(1))


def test_gc_removes_long_dead_temporary_files_everywhere(tmp_path: Path) -> None:
    from weightvault._vault.upkeep import gc as _gc

    vault = Vault(tmp_path)
    vault.save(build(0))
    leftovers = [tmp_path / "checkpoints" / ".x.tmp", tmp_path / "objects" / ".y.tmp"]
    fresh_tmp = tmp_path / "intents" / ".z.tmp"
    fresh_tmp.parent.mkdir(exist_ok=True)
    old = time.time() - _gc.STALE_SECONDS - 1
    for f in leftovers:
        f.write_bytes(b"partial")
        os.utime(f, (old, old))
    fresh_tmp.write_bytes(b"")  # a save writing its intent right now
    assert vault.gc() == len(b"partial")  # object bytes; the record temp is bookkeeping
    assert not any(f.exists() for f in leftovers) and fresh_tmp.exists()
    assert vault.verify().ok
