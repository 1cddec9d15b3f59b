"""What the training-loop integrations share: their import guard and checkpoint replacement.

Example:
    >>> str(not_installed("lightning", "Lightning and PyTorch")).split(": ")[1]
    "pip install 'weightvault[lightning]'"
"""

from __future__ import annotations

import contextlib
import logging

from .._base.errors import BackendNotInstalled, CheckpointNotFoundError, VaultNotFoundError
from .._vault.mirror import Mirror
from .._vault.vault import GC_PACE, Vault, VaultLike

_log = logging.getLogger("weightvault")


def settle(vault: Vault) -> None:
    """End a run's compaction: the background compactor's work done, then the newest
    checkpoint compressed too (the compactor leaves it raw while training may resume
    from it), and the packs left holding only dropped state freed. A failure is logged,
    never raised: the run's checkpoints are committed, and what is left is done by a
    later compaction."""
    vault.wait(raise_errors=False)  # raises what a background save raised, as before
    try:
        vault.compact()
        if vault.store.list("packs"):
            # A settled vault keeps a pack only for what nothing names any more (state a
            # retention dropped before the compactor took the pack apart): free it.
            vault.gc()
    except VaultNotFoundError:
        pass  # the run saved nothing: there is nothing to compact
    except Exception as error:  # training has ended well: its saves stand
        _log.warning("%s: compaction at the end of training failed (%s); a later "
                     "`weightvault vault %s compact` finishes it", vault.store.url, error,
                     vault.store.url)  # fmt: skip


def not_installed(extra: str, needs: str) -> BackendNotInstalled:
    """The error for ``weightvault.integrations.<extra>`` imported without its framework.

    Args:
        extra: The module's name, which is also the pip extra that installs what it needs.
        needs: What is missing, in words (``"transformers and PyTorch"``).
    """
    return BackendNotInstalled(
        f"weightvault.integrations.{extra} needs {needs}: pip install 'weightvault[{extra}]'"
    )


def discard(vault: Vault, name: str) -> None:
    """Delete checkpoint ``name`` if the vault holds it, so a save of that name can follow.

    Training loops overwrite their checkpoint files (a resumed run steps past the point it
    left again), and a vault refuses a second checkpoint of one name; the integrations
    replace it instead. A vault not created yet holds nothing to delete.
    """
    with contextlib.suppress(CheckpointNotFoundError, VaultNotFoundError):
        vault.delete(name)


def trim(vault: Vault, *, keep_last: int | None, training_state_last: int | None) -> None:
    """Apply a loop's retention after a save and free what it let go of.

    A loop's ``save_total_limit`` or ``training_state_last`` promises a disk that stops
    growing, as the Trainer's own folder deletion gives: :meth:`Vault.retain` only
    rewrites records, so a :meth:`Vault.gc` follows it, paced to at most a tenth of the
    loop's time.
    """
    if keep_last is None and training_state_last is None:
        return
    vault.retain(keep_last=keep_last, training_state_last=training_state_last)
    vault.gc(pace=GC_PACE)


def mirror_for(vault: Vault, mirror: VaultLike | None) -> Mirror | None:
    """The :class:`~weightvault._vault.mirror.Mirror` a loop's ``mirror=`` asks for, if any.

    Every integration pushes each checkpoint once it has committed locally
    (``after_save``), in the mirror's own thread, and waits for the last push when
    training ends (``wait``); a mirror that fails only logs warnings.
    """
    return None if mirror is None else Mirror(vault, mirror)
