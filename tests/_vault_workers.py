"""Models and subprocess bodies shared by the vault tests.

The tests import :func:`build` to rebuild what a worker saved; a worker process runs this
file as a script (``python tests/_vault_workers.py COMMAND ...``), so it imports nothing
from the test suite and prints one line per event for the parent to read.

Commands:
    crash-server ROOT WIDTH
        Imports torch once, then for every ``go FIRST_SEED`` line on stdin forks a child
        that saves checkpoints of ``build(seed)`` for seed = FIRST_SEED, FIRST_SEED+1, ...
        into ROOT forever (metadata ``seed``). Prints ``child PID``; the parent kills that
        child with SIGKILL, and the server prints ``reaped STATUS``.
    writer ROOT WRITER_ID SAVES WIDTH GO_FILE
        Waits for GO_FILE, then saves SAVES checkpoints with auto names; prints each name.
    gc-loop ROOT GO_FILE STOP_FILE
        Waits for GO_FILE, then runs ``Vault.gc()`` until STOP_FILE exists, with short
        random pauses; prints ``gc RUNS FREED``.
    gc-stop ROOT STALE WHEN
        Runs one ``Vault.gc()`` with a gc staleness window of STALE seconds, and stops
        itself with SIGSTOP just before (WHEN=before) or just after (WHEN=after) gc first
        removes or moves a key under ``objects/``; prints ``stopping`` first, then
        ``freed BYTES`` when gc returns (after a SIGCONT).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import traceback
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

import weightvault
import weightvault.torch as wvt


def build(head_seed: int, *, backbone_seed: int = 0, width: int = 256, depth: int = 2) -> nn.Module:
    """A frozen backbone (values from ``backbone_seed``) and a trainable head (``head_seed``).

    Values come from seeded generators, so any process rebuilds exactly the same bytes.
    """
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.ReLU())
    model = nn.Sequential(
        OrderedDict(backbone=nn.Sequential(*layers), head=nn.Linear(width, width))
    )
    fill(model.backbone, backbone_seed)
    fill(model.head, 1_000_003 + head_seed)
    wvt.freeze(model, "backbone")
    return model


def fill(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every state_dict entry, cloned."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bytes (so -0.0 and NaN payloads count too)."""
    assert list(got) == list(expected)
    for name, want in expected.items():
        have = got[name]
        assert have.dtype == want.dtype and have.shape == want.shape, name
        a = have.detach().contiguous().reshape(-1).view(torch.uint8)
        b = want.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{name}: bytes differ"


def _wait_for(path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.005)


def crash_server(root: str, width: int) -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd != "go":
            break
        first = int(args[0])
        pid = os.fork()
        if pid == 0:  # the child: save until killed
            code = 0
            try:
                vault = weightvault.Vault(root)
                for i in range(10_000):
                    seed = first + i
                    vault.save(build(seed, width=width), metadata={"seed": str(seed)})
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        print(f"child {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"reaped {status}", flush=True)


def writer(root: str, writer_id: int, saves: int, width: int, go_file: str) -> None:
    vault = weightvault.Vault(root)
    models = [
        build(100 * writer_id + i, backbone_seed=writer_id, width=width, depth=3)
        for i in range(saves)
    ]
    print("ready", flush=True)
    _wait_for(go_file)
    for i, model in enumerate(models):
        rec = vault.save(model, metadata={"writer": str(writer_id), "i": str(i)})
        print(f"saved {rec.name}", flush=True)


def gc_loop(root: str, go_file: str, stop_file: str) -> None:
    vault = weightvault.Vault(root)
    print("ready", flush=True)
    _wait_for(go_file)
    runs = freed = 0
    rng = random.Random(os.getpid())
    while not os.path.exists(stop_file):
        freed += vault.gc()
        runs += 1
        time.sleep(rng.uniform(0.0, 0.03))
    print(f"gc {runs} {freed}", flush=True)


def gc_stop(root: str, stale: float, when: str) -> None:
    from weightvault._vault.store import lease as _gc

    _gc.GC_STALE_SECONDS = stale
    _gc.GC_HEARTBEAT_SECONDS = stale / 5
    vault = weightvault.Vault(root)
    store: Any = vault.store
    stopped: list[bool] = []

    def stop_once() -> None:
        if not stopped:
            stopped.append(True)
            print("stopping", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def hooked(real: Any) -> Any:
        def call(key: str, *rest: Any) -> Any:
            mine = key.startswith("objects/")
            if mine and when == "before":
                stop_once()
            result = real(key, *rest)
            if mine and when == "after":
                stop_once()
            return result

        return call

    store.delete = hooked(store.delete)
    if hasattr(store, "rename"):  # where gc moves objects rather than deleting them
        store.rename = hooked(store.rename)
    freed = vault.gc()
    print(f"freed {freed}", flush=True)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    cmd, *args = argv
    commands: dict[str, Any] = {
        "crash-server": lambda: crash_server(args[0], int(args[1])),
        "writer": lambda: writer(args[0], int(args[1]), int(args[2]), int(args[3]), args[4]),
        "gc-loop": lambda: gc_loop(args[0], args[1], args[2]),
        "gc-stop": lambda: gc_stop(args[0], float(args[1]), args[2]),
    }
    commands[cmd]()


if __name__ == "__main__":
    main(sys.argv[1:])
