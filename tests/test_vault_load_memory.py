"""A vault load streams into the model: its peak extra memory stays a small fraction of
the model, whatever adapter loads it (issue 22, item 5).

Each load runs in a fresh process (``_load_memory_worker.py``) on the 192 MiB model the
issue measured, stored compressed (values of bf16 precision), and reports the kernel's
high-water mark of its RSS, reset just before the load, minus the RSS before it. Holding
every decoded object until the copies (as loads once did) added the whole model again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("blosc2")

HERE = Path(__file__).resolve().parent
MODEL_BYTES = 2048 * 2048 * 4 * 12


def worker(what: str, framework: str, root: Path, **env: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(HERE / "_load_memory_worker.py"), what, framework, str(root)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
@pytest.mark.parametrize(
    ("framework", "backend"), [("torch", ""), ("keras", "torch"), ("keras", "jax")]
)
def test_a_vault_load_adds_at_most_a_tenth_of_the_model(
    tmp_path: Path, framework: str, backend: str
) -> None:
    pytest.importorskip(framework)
    env = {"KERAS_BACKEND": backend, "JAX_PLATFORMS": "cpu"} if backend else {}
    if backend == "jax":
        pytest.importorskip("jax")
    saved = worker("save", framework, tmp_path, **env)
    stored = sum(f.stat().st_size for f in (tmp_path / "objects").rglob("*") if f.is_file())
    assert stored < 0.95 * MODEL_BYTES  # compressed objects: the decoding path is measured
    loaded = worker("load", framework, tmp_path, **env)
    assert loaded["digest"] == saved["digest"]
    if backend == "jax":
        # JAX makes every assigned value a new buffer and hands the replaced ones back by
        # its own schedule, for Keras' own load_weights too (tests/test_keras_files.py):
        # there only a whole extra copy of the model is told apart from that.
        keras_own = worker("keras-load-weights", framework, tmp_path, **env)
        assert loaded["extra"] < keras_own["extra"] + MODEL_BYTES / 2, (loaded, keras_own)
        return
    assert loaded["extra"] <= MODEL_BYTES / 10, loaded["extra"] / MODEL_BYTES
