"""Saves and gc running at the same time: nothing committed is lost, no name is taken twice.

The intent protocol is tested deterministically in-process (a save paused at the exact
point where gc must see its intent, or must be seen by it), then for real: two writer
processes and a gc loop on one vault.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _vault_workers import assert_bitwise, build, snapshot  # noqa: E402
from weightvault import Vault, WeightvaultError  # noqa: E402
from weightvault._vault.writing import commit, save as save_steps  # noqa: E402

# These tests poke objects/ by path: packs have their own (test_vault_packs.py).
pytestmark = pytest.mark.usefixtures("loose_saves")

WORKERS = str(Path(__file__).with_name("_vault_workers.py"))


def referenced(root: Path) -> set[str]:
    out: set[str] = set()
    for f in (root / "checkpoints").glob("*.json"):
        out |= set(json.loads(f.read_text())["objects"].values())
    return out


def object_files(root: Path) -> set[str]:
    out = set()
    for _, _, files in os.walk(root / "objects"):
        out |= {f for f in files if not f.startswith(".")}
    return out


def loads_exactly(vault: Vault, name: str, expected: Any, width: int = 64) -> None:
    model = build(-1, backbone_seed=-1, width=width)
    vault.load(model, name, verify=True)
    assert_bitwise(snapshot(model), snapshot(expected))


# -- the intent protocol, deterministically ----------------------------------------------


def test_gc_while_a_save_holds_its_intent_keeps_every_object_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save registered its intent, found no gc and is about to reuse objects: a gc that
    runs now must keep them, although no checkpoint references them."""
    setup = Vault(tmp_path, compaction=None)  # the save protocol alone
    model = build(1, width=64)
    setup.save(model, "old")
    setup.delete("old")  # every object of `model` is now unreferenced...
    held = object_files(tmp_path)

    saver, collector = Vault(tmp_path, compaction=None), Vault(tmp_path, compaction=None)
    freed: list[int] = []
    real_wait = commit.wait_for_gc

    def gc_in_between(store: Any, gc_wait: float) -> None:
        assert len(list((tmp_path / "intents").iterdir())) == 1
        freed.append(collector.gc())
        real_wait(store, gc_wait)

    monkeypatch.setattr(commit, "wait_for_gc", gc_in_between)
    rec = saver.save(model, "new")  # ...except through this save's intent

    assert freed == [0]
    assert object_files(tmp_path) == held == referenced(tmp_path)
    assert rec.new_bytes == 0  # it reused them
    loads_exactly(collector, "new", model)
    assert collector.verify().ok


def test_gc_stale_intents_do_not_protect_forever(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    vault.save(build(1, width=32), "old")
    vault.delete("old")
    (tmp_path / "intents").mkdir(exist_ok=True)
    intent = tmp_path / "intents" / "dead.json"
    intent.write_text(json.dumps({"created": 0, "objects": sorted(object_files(tmp_path))}))
    assert vault.gc() == 0  # a fresh intent: maybe a save in flight
    then = time.time() - 7200
    os.utime(intent, (then, then))
    assert vault.gc() > 0
    assert object_files(tmp_path) == set() and not intent.exists()


@pytest.mark.parametrize("objects", ["reused", "new"])
def test_gc_racing_a_commit_keeps_the_committed_objects(
    tmp_path: Path, objects: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save passed its gc check before gc started and wrote its objects before gc listed
    them; it commits (and drops its intent) while gc is between reading the checkpoints and
    reading the intents."""
    model = build(1, width=64)
    if objects == "reused":
        setup = Vault(tmp_path)
        setup.save(model, "old")
        setup.delete("old")  # the objects exist, referenced by nothing yet

    saver, collector = Vault(tmp_path), Vault(tmp_path)
    ready, go = threading.Event(), threading.Event()
    result: list[Any] = []
    real_commit = save_steps.commit_record

    def pause_then_commit(store: Any, doc: dict[str, Any], name: str | None) -> str:
        ready.set()  # objects written, intent still registered
        assert go.wait(30)
        return real_commit(store, doc, name)

    monkeypatch.setattr(save_steps, "commit_record", pause_then_commit)
    thread = threading.Thread(target=lambda: result.append(saver.save(model, "new")))
    real_list = collector.store.list

    def list_intents_after_the_commit(prefix: str) -> Any:
        if prefix == "intents":
            go.set()
            thread.join(30)
        return real_list(prefix)

    collector.store.list = list_intents_after_the_commit  # type: ignore[method-assign]
    thread.start()
    assert ready.wait(30)
    collector.gc()
    thread.join(30)

    assert [r.name for r in result] == ["new"]
    assert result[0].new_bytes == (0 if objects == "reused" else result[0].stored_bytes)
    report = Vault(tmp_path).verify()
    assert report.ok, report.problems
    loads_exactly(Vault(tmp_path), "new", model)


def test_a_save_waits_for_a_running_gc_and_gives_up_after_gc_wait(tmp_path: Path) -> None:
    vault = Vault(tmp_path, gc_wait=0.3, compaction=None)  # the save's own intent
    vault.save(build(0, width=16))
    marker = tmp_path / "gc" / "running.json"
    marker.parent.mkdir(exist_ok=True)
    marker.write_text(json.dumps({"created": time.time()}))

    start = time.monotonic()
    with pytest.raises(WeightvaultError, match=r"running\.json"):
        vault.save(build(1, width=16))
    assert time.monotonic() - start >= 0.3
    assert [r.name for r in vault.list()] == ["000001"]
    assert not list((tmp_path / "intents").iterdir())  # the intent went with it

    # The same save succeeds once the gc finishes.
    patient = Vault(tmp_path, gc_wait=30)
    threading.Timer(0.3, marker.unlink).start()
    start = time.monotonic()
    model = build(1, width=16)
    rec = patient.save(model)
    assert time.monotonic() - start >= 0.25
    assert rec.name == "000002"
    loads_exactly(patient, "000002", model, width=16)


# -- real processes ----------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH")] if p)
    return env


def test_two_writers_and_a_gc_loop_lose_nothing(tmp_path: Path) -> None:
    root, go, stop = tmp_path / "vault", tmp_path / "go", tmp_path / "stop"
    Vault(root, create=True)  # the gc loop may start before the first save
    saves, width = 10, 512  # backbone ~3 MiB frozen per writer + 1 MiB head: ~4 MiB a model
    commands = [
        ["writer", str(root), "1", str(saves), str(width), str(go)],
        ["writer", str(root), "2", str(saves), str(width), str(go)],
        ["gc-loop", str(root), str(go), str(stop)],
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, WORKERS, *c],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for c in commands
    ]
    outputs: list[str] = []
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            assert line == "ready", p.communicate(timeout=30)
        go.touch()  # all three start together
        for p in procs[:2]:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outputs.append(out)
        stop.touch()
        out, err = procs[2].communicate(timeout=60)
        assert procs[2].returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    gc_runs = int(out.split()[1])
    assert gc_runs >= 1

    printed = [line.split()[1] for o in outputs for line in o.splitlines()]
    assert len(printed) == 2 * saves and len(set(printed)) == 2 * saves

    vault = Vault(root)
    records = vault.list()
    assert sorted(r.name for r in records) == sorted(printed)
    pairs = sorted((int(r.metadata["writer"]), int(r.metadata["i"])) for r in records)
    assert pairs == [(w, i) for w in (1, 2) for i in range(saves)]
    for r in records:
        w, i = int(r.metadata["writer"]), int(r.metadata["i"])
        expected = build(100 * w + i, backbone_seed=w, width=width, depth=3)
        model = build(-1, backbone_seed=-1, width=width, depth=3)
        vault.load(model, r.name, verify=True)
        assert_bitwise(snapshot(model), snapshot(expected))
    report = vault.verify()
    assert report.ok, report.problems
    assert report.checkpoints == 2 * saves
    assert not list((root / "intents").iterdir())
    assert not list((root / "gc").iterdir())

    vault.gc()
    assert object_files(root) == referenced(root)
    assert vault.verify().ok
