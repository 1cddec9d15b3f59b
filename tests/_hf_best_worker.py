"""The best-checkpoint settings of tests/test_integrations_transformers_best.py, and its
``torchrun`` worker (DDP on 2 processes, gloo, CPU).

``torchrun --nproc_per_node=2 _hf_best_worker.py OUT`` trains tests/_hf_trainer_worker.py's
GPT-2 from seed 0 for 6 steps with ``load_best_model_at_end``, evaluated and saved every
2 steps, ``save_total_limit=2``: once plain (the Trainer's folders in ``OUT/plain``) and
once with ``VaultCallback(OUT/vault)``. Every rank writes its final parameters
(``plain-<rank>.safetensors``, ``vaulted-<rank>.safetensors``); rank 0 writes what each
run kept and named best (``plain.json``, ``vaulted.json``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import EvalPrediction, Trainer, default_data_collator

sys.path.insert(0, str(Path(__file__).parent))
import _hf_trainer_worker as hf
import weightvault
import weightvault.torch as wv
from weightvault.integrations._common import best_name
from weightvault.integrations.transformers import VaultCallback

#: Evaluated and saved every 2 of 12 steps, the best by eval_loss loaded at the end; the
#: learning rate makes the loss rise after step 2.
BEST: dict[str, Any] = dict(
    max_steps=12, eval_strategy="steps", eval_steps=2, save_steps=2, learning_rate=3e-2,
    load_best_model_at_end=True, metric_for_best_model="eval_loss",
)  # fmt: skip


def evalset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(999)
    ids = [torch.randint(0, 512, (16,), generator=g) for _ in range(8)]
    return [{"input_ids": i, "labels": i.clone()} for i in ids]


def collate(features: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The default collator, drawing from torch's RNG as a collator's random masks do: the
    next batch is fetched before the next step begins, so a checkpoint taken then must
    keep the RNG states of the Trainer's save point."""
    torch.rand(())
    return default_data_collator(features)  # type: ignore[no-any-return]


class Scores:
    """A ``compute_metrics`` whose ``score`` at the n-th evaluation is ``SCORES[n]``:
    the best (2.0, greater is better) at step 4, tied at steps 6 and 10."""

    SCORES = (1.0, 2.0, 2.0, 1.5, 2.0, 0.5)

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prediction: EvalPrediction) -> dict[str, float]:
        self.calls += 1
        return {"score": self.SCORES[self.calls - 1]}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def ddp_run(folder: Path, callbacks: list[Any]) -> Trainer:
    args = hf.args(folder, **{**BEST, "max_steps": 6}, save_total_limit=2, ddp_backend="gloo")
    t = Trainer(model=hf.model(0), args=args, train_dataset=hf.dataset(),
                eval_dataset=evalset(), callbacks=callbacks)  # fmt: skip
    t.train()
    return t


def main() -> None:
    out = Path(sys.argv[1])
    plain = ddp_run(out / "plain", [])
    wv.save(hf.params(plain.model), out / f"plain-{rank()}.safetensors")
    vault = weightvault.Vault(out / "vault")
    ours = ddp_run(out / "run", [VaultCallback(vault)])
    wv.save(hf.params(ours.model), out / f"vaulted-{rank()}.safetensors")
    if rank() == 0:
        found = [p.name for p in (out / "plain").glob("checkpoint-*")]
        (out / "plain.json").write_text(json.dumps({
            "folders": sorted(found, key=lambda n: int(n.rsplit("-", 1)[1])),
            "best": Path(str(plain.state.best_model_checkpoint)).name,
            "metric": plain.state.best_metric,
        }))  # fmt: skip
        (out / "vaulted.json").write_text(json.dumps({
            "names": [r.name for r in vault.list()],
            "folders": [p.name for p in (out / "run").glob("checkpoint-*")],
            "best": best_name(ours.state.best_model_checkpoint),
            "metric": ours.state.best_metric,
            "marks": vault.marks(),
        }))  # fmt: skip
    sys.stdout.flush()
    os._exit(0)  # no teardown of the Trainer's threads in a short-lived worker


if __name__ == "__main__":
    main()
