"""What the training-loop integrations share: their import guard, checkpoint replacement,
retention, and how a best checkpoint is named and kept.

A loop names its best checkpoint by folder (the Trainer's
``TrainerState.best_model_checkpoint``). A vault checkpoint has no folder, so it is named
by a URL no path on disk spells, ``vault://<the vault's URL>#<checkpoint name>``
(:func:`best_url`); the vault marks it ``"best"`` (``Vault.mark``), and retention never
deletes a marked checkpoint.

Example:
    >>> str(not_installed("lightning", "Lightning and PyTorch")).split(": ")[1]
    "pip install 'weightvault[lightning]'"
    >>> url = best_url("/runs/vault", "checkpoint-2")
    >>> url, best_name(url), best_name("/runs/out/checkpoint-2")
    ('vault:///runs/vault#checkpoint-2', 'checkpoint-2', None)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from .._base.errors import BackendNotInstalled, CheckpointNotFoundError, VaultNotFoundError
from .._vault.records.order import creation_order
from .._vault.travel.mirror import Mirror
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
    """The :class:`~weightvault._vault.travel.mirror.Mirror` a loop's ``mirror=`` asks for, if any.

    Every integration pushes each checkpoint once it has committed locally
    (``after_save``), in the mirror's own thread, and waits for the last push when
    training ends (``wait``); a mirror that fails only logs warnings.
    """
    return None if mirror is None else Mirror(vault, mirror)


#: The vault mark of the best checkpoint.
BEST = "best"
#: How a best checkpoint's URL begins.
SCHEME = "vault://"


def best_url(vault_url: str, name: str) -> str:
    """What ``best_model_checkpoint`` holds for checkpoint ``name`` of the vault at
    ``vault_url``: ``vault://<vault_url>#<name>``."""
    return f"{SCHEME}{vault_url}#{name}"


def best_name(value: object) -> str | None:
    """The checkpoint name in a :func:`best_url`; ``None`` for anything else (``None``, or
    a folder path a Trainer wrote without a vault)."""
    if not isinstance(value, str) or not value.startswith(SCHEME) or "#" not in value:
        return None
    return value.rpartition("#")[2] or None


def checkpoint_name(name: str) -> str:
    """``name`` as a vault resolves it: a :func:`best_url`'s checkpoint name, else itself.

    The URL's vault part is not checked against the vault it is read from: a copy or a
    mirror of the run's vault holds the same names.

    Example:
        >>> checkpoint_name("vault://s3://bucket/run#checkpoint-8"), checkpoint_name("latest")
        ('checkpoint-8', 'latest')
    """
    return best_name(name) or name


def keep_last(names: Sequence[str], limit: int | None, best: str | None) -> int | None:
    """``Vault.retain(keep_last=...)`` that leaves what the Trainer's rotation leaves.

    The Trainer keeps its newest checkpoint and its best, and deletes the oldest of the
    others until ``save_total_limit`` are left (two when the limit is 1 and the best is
    not the newest). Retention keeps the marked best on its own, so it keeps one fewer
    of the newest when the best is older than those ``limit``.

    Args:
        names: The vault's checkpoints, oldest first.
        limit: ``save_total_limit``; ``None`` or less than 1 deletes nothing.
        best: The best checkpoint's name, marked ``"best"``; ``None`` if none.

    Returns:
        ``keep_last`` for :meth:`Vault.retain`, or ``None`` to delete nothing.

    Example:
        >>> names = ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
        >>> keep_last(names, 2, "checkpoint-4"), keep_last(names, 1, "checkpoint-2")
        (2, 1)
    """
    if limit is None or limit < 1:
        return None
    if best is None or best not in names or best in names[-limit:]:
        return limit
    return max(1, limit - 1)


def retained(vault: Vault, limit: int | None, best: str | None, *, final: bool) -> int | None:
    """:func:`keep_last` for ``vault`` after a save, or at the end of training (``final``),
    where the Trainer with ``save_total_limit=1`` keeps its best alone."""
    if final and limit == 1 and best is not None:
        return 0
    if not limit or best is None:
        return limit or None
    # Ordered from the records' first bytes, as "latest" is, not each read whole.
    return keep_last([name for _, name in creation_order(vault.store)], limit, best)
