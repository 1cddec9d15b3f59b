"""A save killed at any moment never leaves a half checkpoint, and gc cleans up after it.

Real processes saving into a vault are killed with SIGKILL at random moments; after each
kill every listed checkpoint must load (with verify) to exactly what was saved, and the
vault must verify. A deterministic twin stops a save before each of its store operations
in turn. Finally gc frees what the dead saves left, once their intents are stale.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import weightvault._vault.upkeep.gc as gc_module  # noqa: E402
from _vault_workers import assert_bitwise, build, snapshot  # noqa: E402
from weightvault import Vault  # noqa: E402

# These tests poke objects/ by path: packs have their own (test_vault_packs.py).
pytestmark = pytest.mark.usefixtures("loose_saves")

WORKERS = str(Path(__file__).with_name("_vault_workers.py"))
WIDTH = 512  # backbone 2 MiB (shared), head 1 MiB per checkpoint


def worker_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH")] if p)
    return env


def object_files(root: Path) -> dict[str, int]:
    out = {}
    for folder, _, files in os.walk(root / "objects"):
        for f in files:
            out[f] = os.path.getsize(os.path.join(folder, f))
    return out


def referenced(root: Path) -> set[str]:
    out: set[str] = set()
    for f in (root / "checkpoints").glob("*.json"):
        out |= set(json.loads(f.read_text())["objects"].values())
    return out


def age(folder: Path, seconds: float) -> int:
    """Make every file under ``folder`` look ``seconds`` old; return how many."""
    then = time.time() - seconds
    count = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            os.utime(os.path.join(dirpath, f), (then, then))
            count += 1
    return count


def check_vault(root: Path, width: int, seen: dict[str, int]) -> list[str]:
    """Everything listed loads, verified, to what was saved; returns the new names."""
    vault = Vault(root)
    records = vault.list()
    names = [r.name for r in records]
    assert len(set(names)) == len(names)
    assert sorted(p.name for p in (root / "checkpoints").glob("*.json")) == sorted(
        f"{n}.json" for n in names
    )
    new = []
    for rec in records:
        seed = int(rec.metadata["seed"])
        if rec.name in seen:
            assert seen[rec.name] == seed  # a committed checkpoint never changes
            continue
        model = build(-1, backbone_seed=-1, width=width)
        report = vault.load(model, rec.name, verify=True, restore_frozen=True)
        assert report.ok
        assert_bitwise(snapshot(model), snapshot(build(seed, width=width)))
        assert not model.backbone[0].weight.requires_grad
        seen[rec.name] = seed
        new.append(rec.name)
    report = vault.verify()
    assert report.ok, report.problems
    return new


def test_saves_killed_with_sigkill_leave_only_whole_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "vault"
    # Made now: on a loaded machine the first child may die before its save creates it.
    Vault(root, create=True)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    stderr = open(tmp_path / "worker.err", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, WORKERS, "crash-server", str(root), str(WIDTH)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=worker_env(),
    )
    watchdog = threading.Timer(150, proc.kill)
    watchdog.start()
    assert proc.stdin is not None and proc.stdout is not None

    def line() -> str:
        got = proc.stdout.readline() if proc.stdout else ""
        if not got:
            stderr.seek(0)
            pytest.fail(f"worker died (random seed {seed}): {stderr.read()}")
        return got.strip()

    seen: dict[str, int] = {}
    interrupted = left_behind = child = 0
    try:
        assert line() == "ready"
        # Six rounds, or more on a loaded machine until three saves have committed: each
        # round without a commit lets the next child live longer before its SIGKILL.
        dry = 0
        for rnd in range(16):
            if rnd >= 6 and len(seen) >= 3:
                break
            first = 10_000 * (rnd + 1)
            proc.stdin.write(f"go {first}\n")
            proc.stdin.flush()
            kind, pid = line().split()
            assert kind == "child"
            child = int(pid)
            time.sleep(rng.uniform(0.02, 0.25) + 0.25 * dry)
            os.kill(child, signal.SIGKILL)
            kind, status = line().split()
            assert kind == "reaped"
            child = 0  # reaped: its pid may be reused, never signal it again
            assert os.WIFSIGNALED(int(status)) and os.WTERMSIG(int(status)) == signal.SIGKILL

            new = check_vault(root, WIDTH, seen)
            dry = 0 if new else dry + 1
            # Saves run one after another: the committed ones are a prefix of the seeds.
            assert sorted(seen[n] for n in new) == list(range(first, first + len(new)))
            folder = root / "intents"  # absent if no child got as far as an intent
            intents = len(list(folder.iterdir())) if folder.exists() else 0
            interrupted += intents > left_behind  # killed between intent and its removal
            left_behind = intents
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        watchdog.cancel()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)  # never leave a saver running
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
    assert len(seen) >= 3, f"too few saves committed (random seed {seed})"

    # gc now: the dead saves' intents are fresh, so their objects are kept, and every
    # checkpoint still loads.
    vault = Vault(root)
    vault.gc()
    assert not (set(referenced(root)) - set(object_files(root)))
    recheck: dict[str, int] = {}
    check_vault(root, WIDTH, recheck)
    assert recheck == seen

    # An hour later the dead saves' intents and temporary files are stale: gc frees
    # every object no checkpoint references, and nothing else.
    age(root / "intents", 2 * gc_module.STALE_SECONDS)
    age(root / "objects", 2 * gc_module.STALE_SECONDS)
    before = vault.disk_bytes()
    intents = sum(p.stat().st_size for p in (root / "intents").iterdir())
    freed = vault.gc()
    assert vault.disk_bytes() == before - freed - intents
    objects = object_files(root)
    assert set(objects) == referenced(root), f"random seed {seed}, interrupted {interrupted}"
    assert not list((root / "intents").iterdir())
    recheck = {}
    check_vault(root, WIDTH, recheck)
    assert recheck == seen
    print(f"random seed {seed}: {len(seen)} checkpoints, {interrupted} kills mid-save")


# -- the deterministic twin: a save that stops before its k-th store operation ----------


class Killed(BaseException):
    """The process died: nothing after this runs, not even ``finally`` blocks' I/O."""


class DyingStore:
    """Wraps a store; from its ``die_at``-th operation on, every operation fails."""

    OPS = (
        "put", "get", "get_many", "view", "exists", "size", "list", "delete", "sync",
        "stage", "publish", "discard",  # objects: staged, then published together
    )  # fmt: skip

    def __init__(self, store: Any, die_at: int | None) -> None:
        self._store = store
        self.die_at = die_at
        self.log: list[tuple[str, str]] = []

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._store, attr)
        if attr not in self.OPS:
            return value

        def op(*args: Any, **kwargs: Any) -> Any:
            if self.die_at is not None and len(self.log) >= self.die_at:
                raise Killed(attr)
            key = args[0] if args and isinstance(args[0], str) else ""
            self.log.append((attr, key))
            return value(*args, **kwargs)

        return op


def test_a_save_stopped_before_any_store_operation_is_all_or_nothing(tmp_path: Path) -> None:
    width = 32
    Vault(tmp_path, compaction=None).save(build(0, width=width), metadata={"seed": "0"})

    # A full save's operations, and the one that commits it.
    # Deltas off: a delta's base chain changes how many reads a save makes, and this test
    # needs the same operations in every save (tests/test_vault_compression_crash.py
    # stops delta saves at every operation).
    probe = Vault(tmp_path, delta_chain=0, compaction=None)
    probe.store = DyingStore(probe.store, None)  # type: ignore[assignment]
    probe.save(build(1, width=width), metadata={"seed": "1"})
    log = probe.store.log  # type: ignore[attr-defined]
    commit = log.index(next(e for e in log if e[0] == "put" and e[1].startswith("checkpoints/")))
    assert any(e[0] == "put" and e[1].startswith("intents/") for e in log[:commit])

    seen: dict[str, int] = {}
    check_vault(tmp_path, width, seen)
    for k in range(len(log)):
        seed = 100 + k
        vault = Vault(tmp_path, delta_chain=0, compaction=None)
        vault.store = DyingStore(vault.store, k)  # type: ignore[assignment]
        with pytest.raises(Killed):
            vault.save(build(seed, width=width), metadata={"seed": str(seed)})
        new = check_vault(tmp_path, width, seen)
        committed = k > commit
        assert [seen[n] for n in new] == ([seed] if committed else []), (k, log[k])

    # Stale intents and temp files: gc leaves exactly the referenced objects.
    vault = Vault(tmp_path)
    age(tmp_path / "intents", 2 * gc_module.STALE_SECONDS)
    age(tmp_path / "objects", 2 * gc_module.STALE_SECONDS)  # what dead saves staged
    vault.gc()
    assert set(object_files(tmp_path)) == referenced(tmp_path)
    assert not list((tmp_path / "intents").iterdir())
    recheck: dict[str, int] = {}
    check_vault(tmp_path, width, recheck)
    assert recheck == seen


def _interrupted_put(tmp_path: Path, folder: str, content: bytes) -> Path:
    """A temporary file as ``LocalStore.put`` leaves it when killed mid-write."""
    (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    path = tmp_path / folder / ".tmpk1ll3d.tmp"
    path.write_bytes(content)
    return path


def test_an_object_write_killed_midway_is_ignored_then_freed(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    model = build(1, width=64)
    vault.save(model)
    partial = _interrupted_put(tmp_path, "objects/ab", b"\x01" * 100)

    assert vault.gc() == 0  # it may be a write in progress
    assert partial.exists()
    assert vault.verify().ok
    age(tmp_path / "objects", 2 * gc_module.STALE_SECONDS)
    assert vault.gc() == 100
    assert not partial.exists()
    other = build(2, width=64)
    vault.load(other)
    assert_bitwise(snapshot(other), snapshot(model))


def test_gc_survives_an_intent_write_killed_midway(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    model = build(1, width=16)
    vault.save(model)
    partial = _interrupted_put(tmp_path, "intents", b"")

    # The empty temp file is no intent: gc neither fails on it nor frees a live object.
    assert vault.gc() == 0
    assert vault.verify().ok
    fresh = build(2, width=16)
    vault.load(fresh)
    assert_bitwise(snapshot(fresh), snapshot(model))
    # Once stale, the leftover is cleaned up like any other abandoned temporary file.
    age(tmp_path / "intents", 2 * gc_module.STALE_SECONDS)
    vault.gc()
    assert not partial.exists()


def test_a_stale_gc_marker_does_not_block_saves(tmp_path: Path) -> None:
    """A gc killed mid-run leaves its marker; once stale, saves no longer wait for it."""
    vault = Vault(tmp_path, gc_wait=0.2)
    (tmp_path / "gc").mkdir()
    (tmp_path / "gc" / "dead.json").write_text(json.dumps({"created": 0}))
    age(tmp_path / "gc", 2 * gc_module.STALE_SECONDS)
    rec = vault.save(build(1, width=16))
    assert [r.name for r in vault.list()] == [rec.name]
