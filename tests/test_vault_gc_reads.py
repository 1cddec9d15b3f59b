"""What a gc and a loop's retention read, and who waits for a gc (docs/benchmarks.md,
section 27).

A gc after 300 saves of the lm run took 0.64 s: two thirds of it built every record's
tensors and manifest (what a load needs) to learn which objects it names, and a save of
the same process waited for it, warning about a gc "on another machine". The oracles: a
load's own reading of each record (:func:`open_record`), the objects on disk, and the
tensors, which load bitwise after every gc.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import weightvault  # noqa: E402
from _vault_workers import assert_bitwise  # noqa: E402
from weightvault import FormatError, Vault  # noqa: E402
from weightvault._vault.records.checkpoint import open_record  # noqa: E402
from weightvault._vault.records.names import record_names  # noqa: E402
from weightvault._vault.records.reading import read_doc  # noqa: E402
from weightvault._vault.upkeep import gc as gc_module, live as live_module  # noqa: E402

#: No thread is waited on longer than this (seconds).
BOUND = 60


class Tied(nn.Module):
    """Tied weights, a frozen layer, a view-like buffer: every kind of record entry."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(64, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("mask", torch.ones(16))
        self.body.weight.requires_grad_(False)


def _run(vault: Vault, saves: int) -> tuple[Tied, torch.optim.Optimizer]:
    model = Tied(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(saves):
        x = torch.randint(0, 64, (4, 8))
        model.head(model.body(model.emb(x))).sum().backward()
        opt.step()
        opt.zero_grad()
        vault.save(model, optimizer=opt, rng=True)
    vault.wait()
    return model, opt


def _objects(root: Path) -> set[str]:
    return {p.name for p in (root / "objects").rglob("*") if p.is_file()}


def test_gc_names_the_objects_a_load_reads_without_building_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vault = Vault(tmp_path, training_state_last=1)
    model, _ = _run(vault, 4)
    for name in record_names(vault.store):
        doc = read_doc(vault.store, name)
        want = set(open_record(vault.store, name, doc).objects.values())
        assert live_module.named_objects(vault.store, name, doc) == want

    def refuse(*_: Any) -> Any:
        raise AssertionError("gc built a record as a load does")

    monkeypatch.setattr(live_module, "open_record", refuse)
    vault.save({k: v + 1 for k, v in model.state_dict().items()})  # older state dropped
    vault.gc()
    monkeypatch.undo()
    live = {d for r in vault.list() for d in vault.open(r.name).objects.values()}
    assert live <= _objects(tmp_path)
    fresh = Tied(1)
    vault.load(fresh, vault.list()[-2].name)
    assert_bitwise(dict(fresh.state_dict()), dict(model.state_dict()))
    assert vault.verify().ok


@pytest.mark.parametrize(
    "damage",
    ["an object missing", "an object too many", "a name that is no digest", "a header not JSON"],
)
def test_gc_refuses_a_record_that_does_not_say_which_objects_it_needs(
    tmp_path: Path, damage: str
) -> None:
    vault = Vault(tmp_path)
    _run(vault, 2)
    vault.delete("000001")  # its objects are garbage now: a gc would free them
    path = tmp_path / "checkpoints" / "000002.json"
    doc = json.loads(path.read_text())
    name = next(iter(doc["objects"]))
    if damage == "an object missing":
        del doc["objects"][name]
    elif damage == "an object too many":
        doc["objects"]["extra"] = doc["objects"][name]
    elif damage == "a name that is no digest":
        doc["objects"][name] = "../../vault.json"
    else:
        doc["header"] = doc["header"][:-2]
    path.write_text(json.dumps(doc))
    before = _objects(tmp_path)
    with pytest.raises(FormatError, match=r"000002.*gc deleted nothing"):
        vault.gc()
    assert _objects(tmp_path) == before


def test_a_save_does_not_wait_for_a_gc_of_its_own_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The vault's own background gc (``training_state_last``) held every save of the
    loop until it finished; another process's gc is still waited for."""
    vault = Vault(tmp_path, gc_wait=3, compaction=None)
    model, opt = _run(vault, 2)
    inside, release = threading.Event(), threading.Event()
    real = live_module.with_bases

    def held(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        release.wait(BOUND)
        return real(*args, **kwargs)

    monkeypatch.setattr(live_module, "with_bases", held)
    errors: list[BaseException] = []

    def run_gc() -> None:
        try:
            vault.gc()
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    gc_thread = threading.Thread(target=run_gc)
    gc_thread.start()
    try:
        assert inside.wait(BOUND)
        assert list((tmp_path / "gc").glob("*.json"))  # its marker is there, fresh
        caplog.set_level(logging.WARNING, logger="weightvault")
        started = time.monotonic()
        record = vault.save(model, optimizer=opt)
        assert time.monotonic() - started < 2  # not gc_wait=3, nor a VaultBusyError
        assert "waiting for the gc" not in caplog.text
    finally:
        release.set()
        gc_thread.join(BOUND)
    assert not gc_thread.is_alive() and not errors
    fresh = Tied(1)
    vault.load(fresh, record.name)
    assert_bitwise(dict(fresh.state_dict()), dict(model.state_dict()))
    assert vault.verify().ok

    # The same marker, from another live process of this host: waited for, then refused.
    marker = next((tmp_path / "gc").glob("*.json"), None)
    assert marker is None  # the gc finished and took its marker away
    parent = os.getppid()
    other = {
        "created": time.time(),
        "pid": parent,
        "host": __import__("socket").gethostname(),
        "started": gc_module.process_start(parent),
    }
    (tmp_path / "gc" / "other.json").write_text(json.dumps(other))
    started = time.monotonic()
    with pytest.raises(weightvault.VaultBusyError, match=r"other\.json"):
        Vault(tmp_path, gc_wait=0.3).save(model)
    assert time.monotonic() - started >= 0.3


def test_a_retain_after_every_save_reads_only_the_new_records_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The integrations call ``retain(training_state_last=N)`` after every save: it read
    every record whole, twice, each time (37-68 ms a save after 300 checkpoints)."""
    from weightvault._vault.records import order as records_module
    from weightvault._vault.upkeep import retain as retain_module

    whole: list[str] = []

    def counted(module: Any) -> Any:
        real = module.read_doc

        def read(store: Any, name: str) -> Any:
            whole.append(name)
            return real(store, name)

        return read

    monkeypatch.setattr(retain_module, "read_doc", counted(retain_module))
    monkeypatch.setattr(records_module, "read_doc", counted(records_module))
    vault = Vault(tmp_path, compaction=None)
    model = Tied(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    reads = []
    for _ in range(12):
        x = torch.randint(0, 64, (4, 8))
        model.head(model.body(model.emb(x))).sum().backward()
        opt.step()
        opt.zero_grad()
        vault.save(model, optimizer=opt)
        whole.clear()
        vault.retain(training_state_last=2)
        reads.append(len(whole))
    assert max(reads[3:]) <= 2, reads  # the record that just lost its state, at most
    # Another Vault's save (another process, say): its older checkpoint is still trimmed.
    Vault(tmp_path, compaction=None).save(model, optimizer=opt)
    vault.retain(training_state_last=2)
    assert [r.weights_only for r in vault.list()] == [True] * 11 + [False, False]
    fresh = Tied(1)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    vault.load(fresh, vault.list()[-2].name, optimizer=fresh_opt)
    assert_bitwise(dict(fresh.state_dict()), dict(model.state_dict()))
