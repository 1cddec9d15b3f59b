"""Saving is atomic: whatever happens mid-save, the file at the path is whole.

A real process saving a 64 MB model is killed with SIGKILL at random moments; the file
must always be the old version or one complete new version, never a mixture or a
prefix. Saves that raise mid-write must leave the old file as it was and no temp file.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import weightvault  # noqa: E402
import weightvault._file.writer  # noqa: E402
import weightvault.torch as wvt  # noqa: E402
from weightvault._torch import tensors as _torch_tensors  # noqa: E402

#: 16 tensors of 1 Mi int32 each: 64 MiB per version.
TENSORS = 16
NUMEL = 1 << 20
#: Each tensor's values encode the version, so a torn file cannot pass for a whole one.
VERSION_SOURCE = """
def version(v, torch, tensors, numel):
    out = {"version": torch.tensor(v, dtype=torch.int64)}
    for i in range(tensors):
        out[f"w{i}"] = torch.full((numel,), v * 1000 + i, dtype=torch.int32)
    return out
"""
_ns: dict[str, Any] = {}
exec(VERSION_SOURCE, _ns)


def version(v: int, tensors: int = TENSORS, numel: int = NUMEL) -> dict[str, Any]:
    return _ns["version"](v, torch, tensors, numel)  # type: ignore[no-any-return]


SAVER = (
    textwrap.dedent(
        """
        import sys
        import torch
        import weightvault.torch as wvt
        """
    )
    + VERSION_SOURCE
    + textwrap.dedent(
        """
        path, first, tensors, numel = sys.argv[1], *map(int, sys.argv[2:5])
        v = first
        version(v, torch, tensors, numel)  # warm up allocation before signalling
        print("ready", flush=True)
        while True:
            wvt.save(version(v, torch, tensors, numel), path)
            v += 1
        """
    )
)


def temp_files(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))


def loaded_version(path: Path, tensors: int = TENSORS, numel: int = NUMEL) -> int:
    """The version a file holds, after checking it holds exactly that version, whole."""
    out = wvt.load_file(path, verify=True)
    assert list(out) == ["version", *(f"w{i}" for i in range(tensors))]
    v = int(out["version"])
    for i in range(tensors):
        t = out[f"w{i}"]
        assert t.dtype == torch.int32 and t.shape == (numel,)
        assert bool((t == v * 1000 + i).all()), f"w{i} is not wholly version {v}"
    return v


def _start_saver(path: Path, first: int, log: Path) -> subprocess.Popen[str]:
    script = path.parent / "saver.py"
    script.write_text(SAVER)
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(path), str(first), str(TENSORS), str(NUMEL)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=path.parent,
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        proc.wait()
        pytest.fail(f"saver did not start: {line!r}\n{log.read_text()}")
    return proc


def _watch(path: Path, size: int, until: float, inode: int | None = None) -> int:
    """Check the file at ``path`` is whole until ``until`` (or until its inode changes
    from ``inode``); return the number of checks made."""
    checks = 0
    while True:
        # A partial file would fail the header's layout check or have the wrong size.
        info = weightvault.inspect(path)
        assert info.file_bytes == size
        assert os.stat(path).st_size == size
        checks += 1
        if inode is not None:
            if os.stat(path).st_ino != inode:
                return checks
            assert time.monotonic() < until, "the saver never replaced the file"
        elif time.monotonic() >= until:
            return checks
        time.sleep(0.005)


def test_sigkill_mid_save_leaves_old_or_new_file(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    wvt.save(version(0), path)
    size = path.stat().st_size
    assert loaded_version(path) == 0

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    rounds = 5
    current = 0
    replaced = 0
    for r in range(rounds):
        first = (r + 1) * 10_000
        log = tmp_path / f"saver{r}.log"
        proc = _start_saver(path, first, log)
        try:
            if r == rounds - 1:
                # Make sure at least one round sees the file replaced, then kill soon after.
                _watch(path, size, time.monotonic() + 120, inode=path.stat().st_ino)
                deadline = time.monotonic() + rng.uniform(0.0, 0.3)
            else:
                deadline = time.monotonic() + rng.uniform(0.02, 1.0)
            _watch(path, size, deadline)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
            assert proc.stdout is not None
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL, log.read_text()

        assert path.stat().st_size == size
        report = weightvault.verify(path)
        assert report.ok, (seed, report.problems)
        v = loaded_version(path)
        # The previous version, or a whole version this round's saver wrote.
        assert v == current or first <= v < first + 10_000, (seed, r, v, current)
        if v != current:
            replaced += 1
        current = v
        # Leftover temp files of killed saves are in the folder, never at the path.
        for tmp in temp_files(path):
            assert tmp != path and tmp.name.endswith(".tmp")
    assert replaced >= 1, seed

    # Leftovers (plus one we plant, in case every kill fell between saves) break nothing.
    planted = tmp_path / f".{path.name}.planted.tmp"
    planted.write_bytes(b"\x00" * 1234)
    leftovers = temp_files(path)
    assert planted in leftovers
    assert weightvault.verify(path).ok
    assert weightvault.inspect(path).names == list(version(0))
    wvt.save(version(7, numel=16), path)
    assert loaded_version(path, numel=16) == 7
    assert temp_files(path) == leftovers  # a clean save adds none and touches none
    assert planted.read_bytes() == b"\x00" * 1234


# ---------------------------------------------------------------------------------------
# Saves that raise mid-write
# ---------------------------------------------------------------------------------------


def small(v: int) -> dict[str, Any]:
    return version(v, tensors=4, numel=1024)


def _fail_after_first_write(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> list[int]:
    real = weightvault._file.writer._write_all
    calls: list[int] = []

    def write_all(fd: int, data: Any) -> None:
        calls.append(len(memoryview(data).cast("B")))
        if len(calls) > 1:
            raise exc
        real(fd, data)

    monkeypatch.setattr(weightvault._file.writer, "_write_all", write_all)
    return calls


@pytest.mark.parametrize(
    "exc",
    [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
    ids=["ENOSPC", "KeyboardInterrupt"],
)
def test_failing_write_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    path = tmp_path / "model.safetensors"
    wvt.save(small(1), path)
    old = path.read_bytes()
    inode = path.stat().st_ino

    calls = _fail_after_first_write(monkeypatch, exc)
    with pytest.raises(type(exc)):
        wvt.save(small(2), path)
    assert len(calls) == 2  # the header went out, then the first tensor failed

    assert path.read_bytes() == old
    assert path.stat().st_ino == inode
    assert temp_files(path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    monkeypatch.undo()
    assert loaded_version(path, tensors=4, numel=1024) == 1


def test_failing_tensor_data_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor whose bytes cannot be read (here: the second one) aborts the save."""
    path = tmp_path / "model.safetensors"
    wvt.save(small(1), path)
    old = path.read_bytes()

    real = _torch_tensors.tensor_bytes
    seen: list[int] = []

    def bytes_(t: Any) -> memoryview:
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("device lost")
        return real(t)

    monkeypatch.setattr(_torch_tensors, "tensor_bytes", bytes_)
    with pytest.raises(RuntimeError, match="device lost"):
        wvt.save(small(2), path)
    assert path.read_bytes() == old
    assert temp_files(path) == []


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_failing_commit_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    path = tmp_path / "model.safetensors"
    wvt.save(small(1), path)
    old = path.read_bytes()

    def boom(*args: Any) -> None:
        raise OSError(errno.EIO, f"{step} failed")

    monkeypatch.setattr(weightvault._file.writer.os, step, boom)
    with pytest.raises(OSError, match=f"{step} failed"):
        wvt.save(small(2), path)
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert temp_files(path) == []


def test_failing_first_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "new.safetensors"
    _fail_after_first_write(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(OSError):
        wvt.save(small(1), path)
    assert list(tmp_path.iterdir()) == []


def test_clean_save_leaves_no_temp_file_and_a_readable_mode(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    for v in range(3):
        wvt.save(small(v), path)
        assert temp_files(path) == []
        assert loaded_version(path, tensors=4, numel=1024) == v
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~mask
