"""SIGKILL during delta saves, during the training-state drop (retain) and during gc loses
no committed checkpoint.

A real process trains a small model and saves after every step into a vault with deltas
(``delta_chain=3``) and ``training_state_last=1``, so every save writes delta objects and
then rewrites the record of the checkpoint before it without its training state. A
second process runs gc in a loop. Both are killed with SIGKILL at random moments, round
after round; after each round every listed checkpoint must load (verified) to exactly
the weights of its step, the newest must resume bitwise, and the vault must verify. A
deterministic twin stops a delta save before each of its store operations in turn.
"""

from __future__ import annotations

import contextlib
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
from _compression_workers import name_of, state_at, train_step  # noqa: E402
from _vault_workers import assert_bitwise, snapshot  # noqa: E402
from test_vault_crash import DyingStore, Killed, age, worker_env  # noqa: E402
from weightvault import Vault  # noqa: E402

WORKERS = str(Path(__file__).with_name("_compression_workers.py"))
_STATES: dict[int, tuple[Any, Any]] = {}
_RUN: list[Any] = []  # [step, model, optimizer]: one replay, advanced as steps are asked


def expected(step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Weights and optimizer state after ``step`` steps (cached: replays are not free)."""
    if step not in _STATES:
        if not _RUN or _RUN[0] > step:
            _RUN[:] = [0, *state_at(0)]
        while _RUN[0] < step:
            train_step(_RUN[1], _RUN[2], _RUN[0])
            _RUN[0] += 1
        state = {
            f"{i}/{k}": v.clone()
            for i, st in _RUN[2].state_dict()["state"].items()
            for k, v in st.items()
        }
        _STATES[step] = (snapshot(_RUN[1]), state)
    return _STATES[step]


def check(root: Path) -> list[int]:
    """Every checkpoint loads to its step's weights, the newest resumes; return the steps."""
    vault = Vault(root)
    records = vault.list()
    steps = [int(r.metadata["step"]) for r in records]
    assert [r.name for r in records] == [name_of(s) for s in steps]
    for rec, step in zip(records, steps, strict=True):
        model, _ = state_at(0)
        vault.load(model, rec.name, verify=True)
        assert_bitwise(snapshot(model), expected(step)[0])
    if records and not records[-1].weights_only:
        model, opt = state_at(0)
        opt.step()  # AdamW builds its state lazily
        vault.load(model, records[-1].name, optimizer=opt)
        got = {f"{i}/{k}": v for i, st in opt.state_dict()["state"].items() for k, v in st.items()}
        assert_bitwise(got, expected(steps[-1])[1])
    report = vault.verify()
    assert report.ok, report.problems
    return steps


def spawn(*args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, WORKERS, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=worker_env(),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_sigkill_during_delta_saves_retain_and_gc_loses_nothing(tmp_path: Path) -> None:
    root = tmp_path / "vault"
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    saver = spawn("saver", str(root))
    watchdog = threading.Timer(240, saver.kill)
    watchdog.start()
    assert saver.stdin is not None and saver.stdout is not None
    steps: list[int] = []
    child = dry = 0
    try:
        for rnd in range(12):
            if rnd >= 4 and len(steps) >= 8:
                break
            gc = spawn("gc", str(root)) if root.exists() else None
            saver.stdin.write(f"go {steps[-1] + 1 if steps else 0}\n")
            saver.stdin.flush()
            child = int(saver.stdout.readline().split()[1])
            # Each round without a commit lets the next child live longer (a loaded machine).
            time.sleep(rng.uniform(1.0, 2.5) + 1.0 * dry)
            os.kill(child, signal.SIGKILL)
            if gc is not None:
                kill(gc)
            assert saver.stdout.readline().startswith("reaped")
            child = 0
            now = check(root) if root.exists() else []
            assert now[: len(steps)] == steps[: len(now)], f"random seed {seed}"
            assert len(now) >= len(steps), f"a committed checkpoint was lost (seed {seed})"
            dry = 0 if len(now) > len(steps) else dry + 1
            steps = now
        saver.stdin.write("quit\n")
        saver.stdin.flush()
        saver.wait(timeout=30)
    finally:
        watchdog.cancel()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        if saver.poll() is None:
            kill(saver)
    assert len(steps) >= 4, f"too few saves committed (random seed {seed})"

    # Once the dead saves' intents are stale, gc frees what they left; all still loads.
    age(root / "intents", 2 * gc_module.STALE_SECONDS)
    Vault(root).gc()
    assert check(root) == steps


def test_a_delta_save_stopped_before_any_store_operation_is_all_or_nothing(
    tmp_path: Path,
) -> None:
    """The deterministic twin: stop the save of step 3 before its k-th store operation,
    for every k, each time on a fresh copy of a vault holding steps 0 to 2."""
    import shutil

    base = tmp_path / "base"
    vault = Vault(base, delta_chain=3, training_state_last=1)
    for step in range(3):
        model, opt = state_at(step)
        vault.save(model, name_of(step), optimizer=opt, metadata={"step": str(step)})
    vault.wait()  # copied below: no compaction may be halfway through it
    model, opt = state_at(3)

    def attempt(k: int | None) -> tuple[Path, list[tuple[str, str]]]:
        root = tmp_path / f"try-{k}"
        shutil.copytree(base, root)
        v = Vault(root, delta_chain=3, training_state_last=1)
        v.store = DyingStore(v.store, k)  # type: ignore[assignment]
        with contextlib.suppress(Killed):
            v.save(model, name_of(3), optimizer=opt, metadata={"step": "3"})
        return root, v.store.log  # type: ignore[attr-defined]

    _, log = attempt(None)
    assert any(k == "put" and key.startswith("checkpoints/s000002") for k, key in log)
    for k in range(len(log)):
        root, _ = attempt(k)
        steps = check(root)
        assert steps in ([0, 1, 2], [0, 1, 2, 3]), (k, log[k])
        shutil.rmtree(root)
