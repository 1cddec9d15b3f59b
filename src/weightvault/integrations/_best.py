"""The Hugging Face Trainer's best checkpoint and save point, for ``VaultCallback``.

The Trainer saves at its save point, after a step's (or an epoch's) log and evaluation:
it has updated the best metric there (``state.best_metric``, ``best_global_step``), and
every callback's ``on_evaluate`` has run (``EarlyStoppingCallback``'s counter, the stop
it asks for). :class:`SavePoints` takes each save the Trainer makes there, with what the
Trainer would store: its state, its stateful callbacks (:func:`stateful`) and the RNG
states of that point; the best checkpoint is named in ``state.best_model_checkpoint`` by
its vault URL (:func:`~._common.best_url`) and marked ``"best"`` in the vault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from transformers import TrainerControl
from transformers.trainer_callback import CallbackHandler, ExportableState

from .._base.errors import VaultNotFoundError
from .._ranks import agree, gather, rank, world_size
from .._vault.vault import Vault
from ._common import BEST, best_name, best_url
from ._rank_rng import rank_rng

__all__ = [
    "FIX", "STATE_KEY", "Due", "SavePoints", "check_best", "resumed_best", "rng_as", "stateful",
    "trainer_callbacks",
]  # fmt: skip

#: The metadata key that holds the ``TrainerState`` as JSON.
STATE_KEY = "trainer_state"
#: The fix every rank's error of a save names.
FIX = "fix that rank's error and resume the run from the vault's 'latest' checkpoint"

#: What a resumed state and the checkpoint it came from agree on.
_SAME = ("global_step", "best_global_step", "best_metric")


def resumed_best(vault: Vault, state: Any, key: str) -> str | None:
    """The best checkpoint of the run that a resumed ``state`` left, if ``vault`` holds it.

    The Trainer drops a ``best_model_checkpoint`` that names no folder when it resumes,
    and :func:`~weightvault.integrations.transformers.checkout` writes none: the vault's
    checkpoint of the resumed step keeps it, in its Trainer state (metadata ``key``), when
    that is the state the run resumed (the same step and the same best).
    """
    try:
        records = {r.name: r for r in vault.list()}
    except VaultNotFoundError:
        return None
    record = records.get(f"checkpoint-{state.global_step}")
    text = None if record is None else record.metadata.get(key)
    saved = json.loads(text) if text else {}
    if any(saved.get(k) != getattr(state, k) for k in _SAME):
        return None
    name = best_name(saved.get("best_model_checkpoint"))
    return name if name in records else None


def check_best(args: Any) -> None:
    """Refuse settings under which the Trainer never evaluates, so never finds a best.

    ``TrainingArguments`` refuses ``load_best_model_at_end`` without evaluations unless
    ``save_strategy="best"``, under which the Trainer then never saves at all.
    """
    if getattr(args, "eval_strategy", "no") != "no":
        return
    if getattr(args, "load_best_model_at_end", False):
        setting = "load_best_model_at_end=True"
    elif getattr(args, "save_strategy", None) == "best":
        setting = 'save_strategy="best"'
    else:
        return
    raise ValueError(
        f"VaultCallback: {setting} needs evaluations to find the best checkpoint, but "
        'eval_strategy is "no": set eval_strategy="steps" (and eval_steps) or "epoch"'
    )


@dataclasses.dataclass
class Due:
    """A save the Trainer asked for, or may ask for after an evaluation, until the
    Trainer's save point has passed.

    Attributes:
        asked: The Trainer asked for it at a step's or an epoch's end.
        rng: The RNG states at the save point (taken at the last event before it).
        ranks: Every rank's RNG states then, under several processes.
        evaluated: An evaluation came before the save point.
        best_before: ``state.best_global_step`` before that evaluation.
    """

    asked: bool
    rng: Any = None
    ranks: Any = None
    evaluated: bool = False
    best_before: int | None = None

    def saved(self, args: Any, state: Any, asked_since: bool) -> bool:
        """Whether the Trainer saved at the save point that has passed; ``asked_since``:
        a callback asked for a save after the evaluation."""
        if self.evaluated and args.save_strategy == "best":
            # The Trainer saves exactly when it has just found a new best.
            return bool(state.best_global_step == state.global_step != self.best_before)
        return self.asked or asked_since


def stateful(state: Any, callbacks: Iterable[Any], control: dict[str, Any]) -> None:
    """Update ``state.stateful_callbacks`` as the Trainer's save does: each
    ``ExportableState`` callback by class name (a list for several of one class), and
    the ``TrainerControl`` as ``control``, its state at the save point."""
    saved = state.stateful_callbacks
    for cb in callbacks:
        if not isinstance(cb, ExportableState):
            continue
        name = type(cb).__name__
        value = control if isinstance(cb, TrainerControl) else cb.state()
        if isinstance(saved.get(name), list):
            saved[name].append(value)
        else:
            saved[name] = value


class SavePoints:
    """The events at which a Trainer callback takes the Trainer's own saves.

    The Trainer saves at its save point, after a step's (or an epoch's) log and
    evaluation: it has updated the best metric there, and every callback's
    ``on_evaluate`` has run (``EarlyStoppingCallback``'s counter, the stop it asks for).
    No callback runs at that point, so an asked-for save is taken at the last event
    before it when nothing comes between (the step's end, or its log), and after an
    evaluation at the next event, with the RNG states of the save point kept: the next
    batch is fetched in between (a collator's random masks draw). A mixin: the callback
    provides ``_take``, the write.
    """

    vault: Vault
    _callbacks: list[Any]  # the Trainer's, whose states its saves store
    _due: Due | None = None
    _training = False  # between on_train_begin and on_train_end
    _hidden: str | None = None  # the best's URL, kept from the Trainer's own end
    _best: str | None = None  # the best checkpoint's name, when it is in the vault
    _marked: str | None = None  # the name this callback last marked best

    def _flush_event(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._flush(args, state, control, kwargs)

    on_step_begin = on_epoch_begin = _flush_event

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        return self._asked(args, state, control, kwargs)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        control = self._flush(args, state, control, kwargs)  # the epoch's last step's
        return self._asked(args, state, control, kwargs)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> Any:
        if not control.should_evaluate:  # the step's own log, the last event before its save
            control = self._flush(args, state, control, kw)
        if logs is not None and "train_runtime" in logs and best_name(state.best_model_checkpoint):
            # The end of training follows: the Trainer's _load_best_model would look for a
            # folder of that name (and warn), save_total_limit=1 would compare folders with
            # it. The callback loads the best itself and puts the name back (on_train_end).
            self._hidden, state.best_model_checkpoint = state.best_model_checkpoint, None
        return control

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not self._training:  # trainer.evaluate() outside train(): no save follows
            return control
        due = self._due or Due(asked=False)
        due.rng, due.ranks = self._snapshot()  # the evaluation drew (its dataloader's seed)
        due.evaluated, due.best_before = True, state.best_global_step
        self._due = due
        # With save_strategy="best" the Trainer asks for its save after every on_evaluate,
        # where no callback can clear the flag: a control that reads should_save False
        # until the next event keeps it from writing a folder.
        return self._hold(control)

    def _asked(self, args: Any, state: Any, control: Any, kwargs: dict[str, Any]) -> Any:
        """Take over a save the Trainer asked for at a step's or an epoch's end."""
        if not control.should_save:
            return control
        # Every rank skips the Trainer's save, not just the writer: a rank going on into
        # it enters collectives (its FLOP count's) the others never reach, and hangs.
        control.should_save = False
        rng, ranks = self._snapshot()  # collective: all ranks
        self._due = Due(asked=True, rng=rng, ranks=ranks)
        if control.should_evaluate or control.should_log:
            return control  # taken after them (on_log, or the event after on_evaluate)
        return self._flush(args, state, control, kwargs)

    def _flush(self, args: Any, state: Any, control: Any, kwargs: dict[str, Any]) -> Any:
        """Take the save the Trainer's last save point made, if any (every rank)."""
        control, asked = self._release(control)
        due, self._due = self._due, None
        if due is not None and due.saved(args, state, asked):
            self._take(args, state, control, due, kwargs)
        return control

    def _snapshot(self) -> tuple[Any, Any]:
        """This process's RNG states, and every rank's under several (collective)."""
        return _rng_now(), (gather(rank_rng()) if world_size() > 1 else None)

    def _hold(self, control: Any) -> Any:
        return _HeldControl(**control.state()["args"])

    def _release(self, control: Any) -> tuple[Any, bool]:
        """A plain control again, and whether a save was asked of the held one."""
        if not isinstance(control, _HeldControl):
            return control, False
        return TrainerControl(**control.state()["args"]), control.asked

    def _at_save(self, args: Any, state: Any, control: Any, name: str) -> None:
        """What the Trainer's save updates in ``state`` before storing it, for checkpoint
        ``name`` of this step: the best's name, the stateful callbacks' states."""
        if state.best_global_step == state.global_step:  # this one is the best
            state.best_model_checkpoint = best_url(self.vault.url, name)
        self._best = best_name(state.best_model_checkpoint)
        if args.should_save:  # as the Trainer, before its trainer_state.json
            held = control.state()
            held["args"].update(should_save=True, should_evaluate=False, should_log=False)
            stateful(state, [*self._callbacks, control], held)

    def _resumed(self, state: Any) -> None:
        """Name (and mark) again the best checkpoint of the run this one resumes."""
        if state.best_model_checkpoint is not None:  # a Trainer folder, or already named
            self._best = best_name(state.best_model_checkpoint)
            return
        name = resumed_best(self.vault, state, STATE_KEY)
        if name is None:
            return
        state.best_model_checkpoint = best_url(self.vault.url, name)
        self._best = name
        error = None
        if rank() == 0:
            try:
                self.vault.mark(name, BEST)  # the run it left may have marked a later one
                self._marked = name
            except Exception as e:
                error = e
        agree(error, f"marking {name} best in {self.vault.url}", FIX)

    def _take(self, args: Any, state: Any, control: Any, due: Due, kwargs: dict[str, Any]) -> None:
        """Store the Trainer's checkpoint of this step."""
        raise NotImplementedError


class _HeldControl(TrainerControl):  # type: ignore[misc]
    """A ``TrainerControl`` whose ``should_save`` reads False, from an evaluation to the
    next event: a save asked of it is recorded (``asked``), and the callback takes it."""

    asked = False

    @property  # type: ignore[misc]
    def should_save(self) -> bool:
        return False

    @should_save.setter
    def should_save(self, value: bool) -> None:
        self.asked = self.asked or bool(value)


def _rng_now() -> tuple[Any, ...]:
    """The RNG states a Trainer checkpoint stores: Python, numpy, torch, CUDA."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng(states: tuple[Any, ...]) -> None:
    python, numpy, cpu, cuda = states
    random.setstate(python)
    np.random.set_state(numpy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def rng_as(states: tuple[Any, ...] | None) -> Iterator[None]:
    """The RNG states as ``states`` (those of the save point) for a save, then as they were."""
    if states is None:
        yield
        return
    now = _rng_now()
    _set_rng(states)
    try:
        yield
    finally:
        _set_rng(now)


def trainer_callbacks() -> list[Any]:
    """The Trainer's callbacks (``EarlyStoppingCallback`` among them), live.

    The Trainer stores their states with every checkpoint; no callback is told of the
    others, but the ``CallbackHandler`` calling this one holds them. Empty when the
    callback is called some other way.
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler):
            return owner.callbacks  # type: ignore[no-any-return]
        frame = frame.f_back  # type: ignore[assignment]
    return []
