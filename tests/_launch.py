"""Run a worker script on several processes with PyTorch's own launcher, never hanging.

``torchrun`` (``python -m torch.distributed.run``) starts the ranks as users do. A rank
stuck in a collective would hang the suite, so every launch has a hard timeout that kills
the launcher and all its ranks (they share a new session), and fails the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def env() -> dict[str, str]:
    """This environment, with the worktree's ``src`` first on the path."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join(p for p in [SRC, out.get("PYTHONPATH")] if p)
    out["OMP_NUM_THREADS"] = "1"  # what torchrun sets; every run alike, so bitwise equal
    out["PYTHONFAULTHANDLER"] = "1"  # a rank killed by a signal (SIGABRT) prints its stacks
    return out


def by_rank(out: str, tail: int = 3000) -> str:
    """``out`` of a failed launch: the last ``tail`` characters of each rank's lines (the
    launcher's ``--tee`` prefixes them ``[default<rank>]:``), then the launcher's own, so
    one rank's long traceback does not push another's out of the report."""
    ranks: dict[str, list[str]] = {}
    for line in out.splitlines():
        key = line.split("]:", 1)[0] + "]" if line.startswith("[default") else "launcher"
        ranks.setdefault(key, []).append(line)
    return "\n".join(
        f"--- {key} ---\n" + "\n".join(lines)[-tail:] for key, lines in sorted(ranks.items())
    )


def torchrun(script: str, *args: str, ranks: int = 2, timeout: float = 120) -> str:
    """Run ``script args`` on ``ranks`` processes; return their output.

    ``--standalone`` takes a free port itself, so parallel launches do not collide.

    Fails the test when the launch exits non-zero or runs past ``timeout`` seconds (then
    every rank is killed first), showing each rank's last output: its traceback.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--tee=3",
           f"--nproc_per_node={ranks}", script, *args]  # fmt: skip
    what = " ".join([Path(script).name, *args])
    proc = subprocess.Popen(
        cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{what} hung past {timeout} s:\n{by_rank(out)}")
    if proc.returncode != 0:
        pytest.fail(f"{what} exited {proc.returncode}:\n{by_rank(out)}")
    return out
