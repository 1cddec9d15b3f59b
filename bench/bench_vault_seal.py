"""What the vault's seals cost a save and a resume: GPT-2 6 x 512 with AdamW.

Two contenders in one process, alternating (the order rotates each round, after one
warm-up round), each into vaults of its own:

- ``sealed``: the code as it is: records, pack indexes, intents and ``vault.json`` are
  written with their xxh3-128 seal and checked when read;
- ``unsealed``: the same code with the seals patched out (written as plain JSON, read
  without a check).

Per round and contender: a new vault (``compaction=None``, so the save's pack stays and a
resume reads its index), one untimed save, an AdamW step, then a timed save (the vault
exists: intent, objects, pack, record), the same state saved again (only hashing, the
intent and the record: the seals' largest share), and a timed resume as a new process
would do it (the process's pack indexes forgotten, a new ``Vault``,
``load(..., optimizer=)``).
The seals' own work is timed apart: sealing and reading this model's record and pack
index, in microseconds.

Usage::

    python3 -c "bytearray(8 << 30)"     # touch memory first
    .venv/bin/python bench/bench_vault_seal.py --rounds 7
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import torch
from _common import quiesce
from bench_vault_speed import gpt2_model

import weightvault._vault.records.intents as _intents
import weightvault._vault.records.record as _records
import weightvault._vault.store.identity as _marker
import weightvault._vault.store.pack as _pack
import weightvault._vault.store.seal as _seal
import weightvault._vault.writing.commit as _commit
from weightvault import Vault


def _plain(doc: Any, *, sort_keys: bool = False) -> bytes:
    return json.dumps(
        {k: v for k, v in doc.items() if k != "sum"}, separators=(",", ":"), sort_keys=sort_keys
    ).encode()


def _unchecked(raw: Any, doc: dict[str, Any], *args: Any, **kwargs: Any) -> bool:
    return doc.pop("sum", None) is not None


#: (module, attribute, what it becomes with the seals patched out)
_PATCHES: list[tuple[Any, str, Callable[..., Any]]] = [
    (_records, "encode_record", _plain),
    (_commit, "encode_record", _plain),
    (_records, "unseal", _unchecked),
    (_pack, "seal_json", _plain),
    (_pack, "unseal", _unchecked),
    (_marker, "seal_json", _plain),
    (_marker, "unseal", _unchecked),
    (_intents, "seal_json", _plain),
    (_intents, "unseal", _unchecked),
]


@contextlib.contextmanager
def sealed(on: bool) -> Iterator[None]:
    saved = [(m, a, getattr(m, a)) for m, a, _ in _PATCHES]
    try:
        if not on:
            for module, attr, value in _PATCHES:
                setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def _trained() -> tuple[Any, Any]:
    model, opt = gpt2_model()
    ids = torch.randint(
        0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)
    )
    model(input_ids=ids, labels=ids).loss.backward()  # gradients kept: each step moves
    opt.step()
    return model, opt


def _one(model: Any, opt: Any, folder: Path, on: bool) -> tuple[float, float, float]:
    """A save into an existing vault, the same state saved again (nothing new to write:
    the seals' share is largest there), and a new process's resume, in seconds."""
    with sealed(on):
        vault = Vault(folder, compaction=None)
        vault.save(model, optimizer=opt)
        opt.step()  # every weight and moment changes: the timed save writes them all
        quiesce()
        t0 = time.perf_counter()
        vault.save(model, optimizer=opt)
        saved = time.perf_counter() - t0
        quiesce()
        t0 = time.perf_counter()
        vault.save(model, optimizer=opt)
        again = time.perf_counter() - t0
        fresh, fresh_opt = gpt2_model()
        quiesce()
        t0 = time.perf_counter()
        _pack._tables.clear()  # as in a new process: no pack index read yet
        Vault(folder, compaction=None).load(fresh, "latest", optimizer=fresh_opt)
        resumed = time.perf_counter() - t0
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )
    return saved, again, resumed


def _micro(folder: Path) -> dict[str, float]:
    """Microseconds the seal's work takes on this model's record and pack index."""
    name = sorted(p.stem for p in (folder / "checkpoints").iterdir())[-1]
    raw = (folder / "checkpoints" / f"{name}.json").read_bytes()
    doc = json.loads(raw)
    pack = next((folder / "packs").iterdir()).read_bytes()
    length = int.from_bytes(pack[-16:-8], "little")
    index = pack[len(pack) - 16 - length : len(pack) - 16]
    idoc = json.loads(index)
    out = {"record bytes": float(len(raw)), "pack index bytes": float(len(index))}
    cases = {
        "seal the record": lambda: _records.encode_record(doc),
        "write it plain": lambda: _plain(doc),
        "check the record's seal": lambda: _seal.unseal(raw, dict(doc), "x"),
        "seal the pack index": lambda: _pack.seal_json(idoc, sort_keys=True),
        "check the index's seal": lambda: _pack.unseal(
            index, dict(idoc), "x", "i", sealed=True, fix=""
        ),
    }
    for what, fn in cases.items():
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[what] = statistics.median(times) * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    model, opt = _trained()
    times: dict[str, dict[str, list[float]]] = {
        "sealed": {"save": [], "save again": [], "resume": []},
        "unsealed": {"save": [], "save again": [], "resume": []},
    }
    order = list(times)
    scratch = Path(tempfile.mkdtemp(prefix="bench_vault_seal."))
    micro: dict[str, float] = {}
    try:
        for r in range(args.rounds + 1):
            for name in order[r % 2 :] + order[: r % 2]:
                folder = scratch / name
                got = _one(model, opt, folder, name == "sealed")
                if r:  # the first round warms up
                    for what, seconds in zip(times[name], got, strict=True):
                        times[name][what].append(seconds)
                if name == "sealed" and not micro:
                    micro = _micro(folder)
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"GPT-2 6 x 512 + AdamW, {args.rounds} rounds alternating (medians, seconds)")
    for what in times["sealed"]:
        on, off = (statistics.median(times[n][what]) for n in ("sealed", "unsealed"))
        spread = {n: (min(times[n][what]), max(times[n][what])) for n in times}
        print(
            f"  {what:10}  sealed {on:.3f} ({spread['sealed'][0]:.3f}-{spread['sealed'][1]:.3f})"
            f"  unsealed {off:.3f} ({spread['unsealed'][0]:.3f}-{spread['unsealed'][1]:.3f})"
            f"  ratio {on / off:.3f}"
        )
    print("the seal's own work (medians of 200):")
    for what, value in micro.items():
        unit = "" if "bytes" in what else " us"
        print(f"  {what:26} {value:10.1f}{unit}")


if __name__ == "__main__":
    main()
