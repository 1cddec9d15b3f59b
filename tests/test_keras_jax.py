"""The Keras adapter on the JAX backend: the whole Keras suite again, in a fresh process.

Keras picks its backend once per process, at import, so the JAX run cannot share this
process with the torch-backend tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("keras")

HERE = Path(__file__).resolve().parent


def test_keras_suite_passes_on_the_jax_backend():
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "test_keras.py"),
            str(HERE / "test_cross_framework.py"),
            str(HERE / "test_vault_keras.py"),
            str(HERE / "test_keras_resume.py"),
            str(HERE / "test_keras_files.py"),
            str(HERE / "test_keras_hostile.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = result.stdout[-3000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], tail
