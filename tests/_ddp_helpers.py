"""What the ``torchrun`` workers share: their rank, a save counter, a failing disk."""

from __future__ import annotations

import errno
import os
from typing import Any

import weightvault
import weightvault._vault.vault as vault_module


def rank() -> int:
    """This process's rank, as ``torchrun`` sets it."""
    return int(os.environ["RANK"])


def count_saves() -> list[str]:
    """The names this process saves into a vault from now on, as it saves them."""
    names: list[str] = []
    save = weightvault.Vault.save

    def counted(self: weightvault.Vault, model: Any, name: str | None = None, **kw: Any) -> Any:
        names.append(str(name))
        return save(self, model, name, **kw)

    weightvault.Vault.save = counted  # type: ignore[method-assign]
    return names


def fail_on_rank0(name: str) -> None:
    """Make the vault's storage fail on rank 0 for checkpoint ``name``: a full disk."""
    save_sources = vault_module.save_sources

    def failing(*args: Any, **kw: Any) -> Any:
        if rank() == 0 and kw.get("name") == name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save_sources(*args, **kw)

    vault_module.save_sources = failing


def raised(error: Exception | None) -> dict[str, Any]:
    """What a rank raised, as JSON for the test to read."""
    if error is None:
        return {"type": None}
    return {
        "type": type(error).__name__,
        "weightvault": isinstance(error, weightvault.WeightvaultError),
        "message": str(error),
        "failures": {r: repr(x) for r, x in getattr(error, "failures", {}).items()},
        "cause": repr(error.__cause__),
    }
