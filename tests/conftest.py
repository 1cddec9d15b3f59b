"""Shared fixtures: small models that each isolate one sharing case."""

from __future__ import annotations

import os

# Tests never reach the network; transformers must not try.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Keras picks its backend at import; CI tests weightvault.keras on PyTorch.
os.environ.setdefault("KERAS_BACKEND", "torch")
