"""Shared fixtures: small models that each isolate one sharing case."""

from __future__ import annotations

import os

# Tests never reach the network; transformers must not try.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Keras picks its backend at import; CI tests weightvault.keras on PyTorch.
os.environ.setdefault("KERAS_BACKEND", "torch")

try:
    from hypothesis import settings
except ImportError:  # pragma: no cover
    pass
else:
    # CI explores the same examples on every run, so a landing never hinges on luck; local
    # runs keep exploring new ones.
    settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")


import pytest


@pytest.fixture
def loose_saves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves in this process write every object as a file of its own, as before packs.

    For tests about loose objects' own mechanics (damage to one object file, gc's trash,
    fsyncs per file), which poke ``objects/`` by path; packs have their own tests in
    tests/test_vault_packs.py.
    """
    from weightvault._vault.store import pack

    monkeypatch.setattr(pack, "PACK_OBJECT", 0)
