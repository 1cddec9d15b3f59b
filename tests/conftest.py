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
