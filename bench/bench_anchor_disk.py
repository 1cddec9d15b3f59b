"""What the anchor layout costs on disk against the chained layout, and raw vs compressed
anchors, on really trained weights.

The chained layout (an older checkpoint a delta on the next one, up to ``delta_chain``
deep) and the anchor layout (every delta on a whole object of an older checkpoint) are
sized by running this script once per source tree, with ``PYTHONPATH`` naming that
tree's ``src`` (the script prints ``weightvault.__file__``):

- ``sizes``: each phase of ``bench_compress.py``'s trained run (lr 1e-3 and lr 3e-5, 10
  checkpoints each, fp32 and bf16 weights) saved into a vault, ``retain
  (training_state_last=1)`` afterwards, against the Trainer-style folders (the figure
  ``bench_compress.py sizes`` prints as "retain afterwards"), and into a default vault
  that keeps every checkpoint's training state; each vault's bytes split by kind
  (the newest's weights, other whole weights, weight deltas, training state, packs,
  records);
- ``pays``: the anchor tree only: whole weight objects (anchors and the newest) raw
  unless compression saves a quarter (``ANCHOR_PAYS`` 0.75) against compressed when it
  saves 5% (0.95, patched in-process): the disk of both phases (fp32 and bf16), and
  the weights-only read time of the newest checkpoint and of a delta checkpoint of a
  GPT-2 6 x 512 (10 checkpoints, a few AdamW steps at lr 3e-5 between them, compacted
  at the end), the two variants' vaults alternating in one process, medians;
- ``trainer``: ``bench_trainer.py --steps 20 --save-steps 2 --training-state-last 1``
  in a child process with the same ``PYTHONPATH``.

    PYTHONPATH=src .venv/bin/python bench/bench_compress.py train --dir /tmp/wv-lm   # once
    python3 -c "bytearray(8 << 30)"                                                 # touch memory
    PYTHONPATH=/tmp/wv/anchors/chains/src .venv/bin/python bench/bench_anchor_disk.py sizes \\
        --dir /tmp/wv-lm --json /tmp/wv/anchors/sizes-chains.json
    PYTHONPATH=src .venv/bin/python bench/bench_anchor_disk.py sizes --dir /tmp/wv-lm \\
        --json /tmp/wv/anchors/sizes-anchors.json
    PYTHONPATH=src .venv/bin/python bench/bench_anchor_disk.py pays --dir /tmp/wv-lm --rounds 9
    PYTHONPATH=/tmp/wv/anchors/chains/src .venv/bin/python bench/bench_anchor_disk.py trainer
    PYTHONPATH=src .venv/bin/python bench/bench_anchor_disk.py trainer
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from itertools import product
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import _train_lm as T
import torch
from _common import machine, table
from bench_compress import trainer_bytes, vault_run

import weightvault
from weightvault import Vault
from weightvault._file.layout import is_training
from weightvault._vault.objects.address import object_key
from weightvault._vault.objects.probe import probe
from weightvault._vault.upkeep.records_cache import Records

KINDS = ("newest weights", "other whole weights", "weight deltas", "training state")


def breakdown(root: Path) -> dict[str, Any]:
    """The vault's bytes by kind: each object named by a checkpoint once, as its file
    (or its pack entry), and the packs, records and the rest as they lie."""
    vault = Vault(root)
    store = vault.store
    records = Records(store)
    newest = set()
    seen: dict[str, tuple[bool, int]] = {}
    for name in records.names:
        tensors = records.tensors(name) or {}
        for tensor, (digest, _, _, nbytes) in tensors.items():
            seen.setdefault(digest, (is_training(tensor), nbytes))
            if name == records.names[-1]:
                newest.add(digest)
    out: dict[str, int] = defaultdict(int)
    raw: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    for digest, (training, nbytes) in seen.items():
        size = store.size(object_key(digest))
        if size is None:  # in a pack (raw); its bytes are counted with the pack below
            kind = "training state" if training else "in packs (raw)"
            count[kind] += 1
            continue
        frame = None if size == nbytes else probe(store, object_key(digest))
        if training:
            kind = "training state"
        elif frame is not None and frame.base is not None:
            kind = "weight deltas"
        elif digest in newest:
            kind = "newest weights"
        else:
            kind = "other whole weights"
        out[kind] += size
        raw[kind] += nbytes
        count[kind] += 1
    total = vault.disk_bytes()
    for blob in store.list(""):
        if blob.key.startswith("packs/"):
            out["packs"] += blob.size
        elif blob.key.startswith("checkpoints/"):
            out["records"] += blob.size
    out["other"] = total - sum(out.values())
    return {
        "total": total,
        "bytes": dict(out),
        "raw": dict(raw),
        "objects": dict(count),
        "checkpoints": len(records.names),
    }


def default_run(folders: list[Path], root: Path, bf16: bool) -> int:
    """A default vault (every checkpoint's training state kept), settled."""
    vault = Vault(root)
    for f in folders:
        model, opt, sched = T.restore(f)
        if bf16:
            model, opt = T.as_bf16(model, opt)
        vault.save(model, optimizer=opt, scheduler=sched, rng=True)
    vault.gc()
    vault.wait()
    return vault.disk_bytes()


def cmd_sizes(root: Path, scratch: Path) -> list[dict[str, Any]]:
    rows = []
    for phase, lr in (("a", "1e-3"), ("b", "3e-5")):
        folders = T.checkpoints(root, phase)
        for bf16 in (False, True):
            trainer = trainer_bytes(folders, bf16, scratch)
            for how in ("retain afterwards", "default vault"):
                target = scratch / f"vault-{phase}-{bf16}-{how[0]}"
                if how == "default vault":
                    size = default_run(folders, target, bf16)
                else:
                    size = vault_run(folders, target, bf16, retain=True)["vault_bytes"]
                split = breakdown(target)
                shutil.rmtree(target)
                rows.append({
                    "lr": lr, "weights": "bf16" if bf16 else "fp32", "how": how,
                    "trainer_bytes": trainer, "vault_bytes": size, "ratio": size / trainer,
                    "split": split,
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    return rows


def set_anchor_pays(value: float) -> None:
    """ANCHOR_PAYS where the compactor reads it (policy imports it by name)."""
    import weightvault._vault.objects.encoding as encoding
    import weightvault._vault.upkeep.policy as policy

    encoding.ANCHOR_PAYS = value  # type: ignore[attr-defined]
    policy.ANCHOR_PAYS = value  # type: ignore[attr-defined]


@contextmanager
def anchor_pays(value: float) -> Iterator[None]:
    import weightvault._vault.upkeep.policy as policy

    before = policy.ANCHOR_PAYS  # type: ignore[attr-defined]
    set_anchor_pays(value)
    try:
        yield
    finally:
        set_anchor_pays(before)


VARIANTS = {"raw anchors (0.75)": 0.75, "compressed anchors (0.95)": 0.95}


def pays_disk(root: Path, scratch: Path) -> list[dict[str, Any]]:
    rows = []
    for (phase, lr), bf16 in product((("b", "3e-5"), ("a", "1e-3")), (False, True)):
        folders = T.checkpoints(root, phase)
        trainer = trainer_bytes(folders, bf16, scratch)
        for label, value in VARIANTS.items():
            target = scratch / f"pays-{phase}-{bf16}-{value}"
            with anchor_pays(value):
                run = vault_run(folders, target, bf16, retain=True)
            split = breakdown(target)
            shutil.rmtree(target)
            rows.append({
                "lr": lr, "weights": "bf16" if bf16 else "fp32", "variant": label,
                "vault_bytes": run["vault_bytes"], "ratio": run["vault_bytes"] / trainer,
                "split": split,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model: torch.nn.Module = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=512, n_head=8))
    return model.train()


def pays_reads(scratch: Path, rounds: int, steps: int) -> dict[str, Any]:
    """Weights-only reads of the newest and of a delta checkpoint, both variants, per
    dtype: 10 weights-only checkpoints with ``steps`` AdamW steps at lr 3e-5 between
    them (bf16: the fp32 weights rounded), compacted at the end."""
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    roots = {
        (dtype, label): scratch / f"reads-{dtype}-{value}"
        for dtype in ("fp32", "bf16")
        for label, value in VARIANTS.items()
    }
    vaults = {key: Vault(root, compaction="after-save") for key, root in roots.items()}
    for _ in range(10):
        for _ in range(steps):
            batch = torch.randint(0, 50257, (2, 64), generator=g)
            model(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        # Weights only: training state is never a delta nor an anchor, and a
        # weights-only load does not read it (saving it made this part 4x as long).
        half = copy.deepcopy(model).to(torch.bfloat16)
        for (dtype, label), vault in vaults.items():
            with anchor_pays(VARIANTS[label]):
                vault.save(model if dtype == "fp32" else half)
    for (_, label), vault in vaults.items():
        with anchor_pays(VARIANTS[label]):
            vault.compact()
    out: dict[str, Any] = {"rounds": rounds, "steps_between": steps}
    for dtype in ("fp32", "bf16"):
        fresh = gpt2() if dtype == "fp32" else gpt2().to(torch.bfloat16)
        contenders: dict[str, Callable[[], object]] = {}
        for label in VARIANTS:
            vault = vaults[(dtype, label)]
            names = [r.name for r in vault.list()]
            delta = names[4]  # between the oldest (the anchor) and the newest
            contenders[f"{label}: newest"] = partial(vault.load, fresh, names[-1])
            contenders[f"{label}: delta {delta}"] = partial(vault.load, fresh, delta)
            out[f"{dtype} {label} disk_bytes"] = vault.disk_bytes()
            out[f"{dtype} {label} split"] = breakdown(roots[(dtype, label)])
        times: dict[str, list[float]] = {name: [] for name in contenders}
        order = list(contenders)
        for name in order:
            contenders[name]()  # warm the page cache once, untimed
        load_before = os.getloadavg()
        for r in range(rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                t0 = time.perf_counter()
                contenders[name]()
                times[name].append(time.perf_counter() - t0)
        out[f"{dtype} load average before, after"] = [load_before, os.getloadavg()]
        for name, ts in times.items():
            out[f"{dtype} {name} median_s"] = statistics.median(ts)
            out[f"{dtype} {name} all_s"] = ts
        print(json.dumps({k: v for k, v in out.items() if dtype in k and "split" not in k}))
    return out


def cmd_trainer(json_out: Path | None) -> None:
    here = os.path.dirname(__file__)
    cmd = [sys.executable, os.path.join(here, "bench_trainer.py"), "--steps", "20"]
    cmd += ["--save-steps", "2", "--training-state-last", "1"]
    if json_out:
        cmd += ["--json", str(json_out)]
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["sizes", "pays", "pays-disk", "pays-reads", "trainer"])
    ap.add_argument("--dir", type=Path, help="the trained run (bench_compress.py train)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=3, help="AdamW steps between checkpoints")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    print("weightvault from", weightvault.__file__, flush=True)
    print("load average", os.getloadavg(), flush=True)
    if args.what == "trainer":
        cmd_trainer(args.json)
        return
    _ = bytearray(2 << 30)  # touch memory first: fresh pages are slow on first touch
    del _
    scratch = Path(tempfile.mkdtemp(prefix="wv-bench-anchor-"))
    results: dict[str, Any] = {"machine": machine(), "weightvault": weightvault.__file__}
    try:
        if args.what == "sizes":
            results["sizes"] = rows = cmd_sizes(args.dir, scratch)
            print(table(
                [[r["lr"], r["weights"], r["how"], f"{r['vault_bytes'] / 1e6:.2f}",
                  f"{r['trainer_bytes'] / 1e6:.2f}", f"{r['ratio']:.4f}"] for r in rows],
                ["lr", "weights", "vault", "vault MB", "Trainer MB", "ratio"],
            ))  # fmt: skip
        if args.what in ("pays", "pays-disk"):
            results["pays_disk"] = pays_disk(args.dir, scratch)
        if args.what in ("pays", "pays-reads"):
            results["pays_reads"] = pays_reads(scratch, args.rounds, args.steps)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["load average at the end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
