"""Every rank's RNG states in a Trainer checkpoint, each distinct one stored once.

Under DDP the Trainer writes one ``rng_state_<rank>.pth`` per process and each process
restores its own on resume; without it a rank resumes with the wrong dropout masks. The
:class:`~weightvault.integrations.transformers.VaultCallback` gathers them on the rank
that saves and keeps them as JSON in the checkpoint's metadata: the Trainer seeds every
rank alike, so the states are usually one, stored once whatever the world size.

Example:
    >>> import torch
    >>> text = encode_ranks([rank_rng(), rank_rng()])
    >>> states = decode_ranks(text, "ckpt")
    >>> sorted(states), torch.equal(states[1]["cpu"], torch.get_rng_state())
    ([0, 1], True)
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import torch

from .. import _training
from .._base.errors import TrainingStateError

__all__ = ["RANKS_KEY", "decode_ranks", "encode_ranks", "rank_rng"]

#: The metadata key of the per-rank RNG states.
RANKS_KEY = "trainer_rng_ranks"


def rank_rng() -> dict[str, Any]:
    """This process's RNG states as JSON, as the Trainer's ``rng_state_<rank>.pth`` holds them."""
    doc: dict[str, Any] = {
        "python": _training.python_rng(),
        "numpy": _training.numpy_rng(),
        "cpu": _bytes(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        # A distributed Trainer stores (and restores) every device's state.
        doc["cuda"] = [_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return doc


def encode_ranks(docs: list[dict[str, Any]]) -> str:
    """The metadata value for every rank's :func:`rank_rng`, in rank order."""
    states: list[dict[str, Any]] = []
    ranks = []
    for doc in docs:
        if doc not in states:
            states.append(doc)
        ranks.append(states.index(doc))
    return json.dumps({"states": states, "ranks": ranks}, sort_keys=True)


def decode_ranks(text: str, where: str) -> dict[int, dict[str, Any]]:
    """``{rank: the dict its rng_state_<rank>.pth holds}``, every state validated.

    Raises:
        TrainingStateError: The value is malformed, naming ``where``.
    """
    try:
        doc = json.loads(text)
        states = [_state(s, where) for s in doc["states"]]
        return {r: states[i] for r, i in enumerate(doc["ranks"])}
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, binascii.Error) as e:
        raise TrainingStateError(
            f"{where}: its per-rank RNG states ({RANKS_KEY!r} metadata) are malformed; "
            "resume from another checkpoint"
        ) from e


def _state(doc: dict[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": _training.python_state(doc["python"], where),
        "numpy": _training.numpy_state(doc["numpy"], where),
        "cpu": _tensor(doc["cpu"]),
    }
    torch.Generator().set_state(out["cpu"])  # validates without touching the global one
    if doc.get("cuda") and torch.cuda.is_available():
        out["cuda"] = [_tensor(s) for s in doc["cuda"]]
    return out


def _bytes(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)
