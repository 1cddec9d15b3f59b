"""Orbax and ``flax.serialization`` vs ``weightvault.jax`` on one Flax NNX model.

One process, one GPT-like NNX model with a tied embedding (the output head holds the
embedding's ``Variable``): an embedding (32000 x 512), 8 blocks of Linear 512 -> 2048 ->
512 with LayerNorms, about 33M distinct parameters (``--quick``: about 1.3M).

Contenders, each saving and restoring the whole model through its usual path:

* ``weightvault.jax.save`` / ``load`` (fills the model in place);
* ``flax.serialization``: ``to_bytes(nnx.to_pure_dict(nnx.state(model)))`` written to a
  file with an explicit ``fsync``; load reads it, ``from_bytes`` into the target's pure
  dict, ``nnx.replace_by_pure_dict`` and ``nnx.update``;
* Orbax ``StandardCheckpointer``: ``save(dir, nnx.state(model), force=True)`` then
  ``wait_until_finished()``; load ``restore(dir, abstract_state)`` and ``nnx.update``.

``nnx.state`` already keeps a shared Variable once, so every contender writes the tied
embedding once here: this compares speed, not deduplication. Contenders alternate within
every round (the first one rotates); medians and minimums are reported, and ratios use
the medians. Loads read warm files.

Usage:
    python bench/bench_jax.py [--quick] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx, serialization

import weightvault.jax as wvj

MiB = 1 << 20
warnings.filterwarnings("ignore")  # Orbax and Flax deprecation chatter


class Head(nnx.Module):
    def __init__(self, weight: nnx.Param) -> None:
        self.weight = weight  # the embedding's Variable: a tied LM head

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight[...].T


class Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs) -> None:
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(nnx.gelu(self.up(self.ln(x))))


class Model(nnx.Module):
    def __init__(self, quick: bool, seed: int) -> None:
        vocab, d, n = (4000, 128, 2) if quick else (32000, 512, 8)
        rngs = nnx.Rngs(seed)
        self.wte = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(n)])
        self.lm_head = Head(self.wte.embedding)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.wte(ids)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


def rounds(fns: dict[str, Callable[[], Any]], n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(n + 1):  # round 0 is a warm-up
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            fns[name]()
            dt = time.perf_counter() - t0
            if r:
                out[name].append(dt)
    return out


def size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~1M-parameter model")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    model = Model(args.quick, 0)
    target = Model(args.quick, 1)
    state = nnx.state(model)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    folder = tempfile.mkdtemp(prefix="wv-bench-jax-")
    st = os.path.join(folder, "m.safetensors")
    msgpack = os.path.join(folder, "m.msgpack")
    orbax_dir = os.path.join(folder, "orbax")
    checkpointer = ocp.StandardCheckpointer()

    def flax_save() -> None:
        data = serialization.to_bytes(nnx.to_pure_dict(nnx.state(model)))
        with open(msgpack, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def flax_load() -> None:
        with open(msgpack, "rb") as f:
            data = f.read()
        st_t = nnx.state(target)
        pure = serialization.from_bytes(nnx.to_pure_dict(st_t), data)
        nnx.replace_by_pure_dict(st_t, pure)
        nnx.update(target, st_t)

    def orbax_save() -> None:
        checkpointer.save(orbax_dir, nnx.state(model), force=True)
        checkpointer.wait_until_finished()

    def orbax_load() -> None:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(target))
        nnx.update(target, checkpointer.restore(orbax_dir, abstract))

    saves = rounds(
        {
            "weightvault": lambda: wvj.save(model, st),
            "flax.serialization": flax_save,
            "orbax": orbax_save,
        },
        args.rounds,
    )
    loads = rounds(
        {
            "weightvault": lambda: wvj.load(target, st),
            "flax.serialization": flax_load,
            "orbax": orbax_load,
        },
        args.rounds,
    )
    ids = jnp.array([[1, 2, 3, 4]])
    same = {}
    for name, fn in (
        ("weightvault", lambda: wvj.load(target, st)),
        ("flax.serialization", flax_load),
        ("orbax", orbax_load),
    ):
        nnx.update(target, nnx.state(Model(args.quick, 2)))  # other values first
        fn()
        same[name] = bool(np.array_equal(target(ids), model(ids)))
    tied = target.lm_head.weight is target.wte.embedding

    print(
        f"jax {jax.__version__}, flax {version('flax')}, "
        f"orbax-checkpoint {ocp.__version__}, python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs"
    )
    print(f"model: {n_params / 1e6:.1f}M distinct parameters (tied embedding)")
    print(
        f"rounds: {args.rounds} (+1 warm-up); seconds as median [min]; ratios to weightvault "
        "as median/min\n"
    )
    print(f"{'':20} {'file MiB':>9} {'save s':>16} {'ratio':>11} {'load s':>16} {'ratio':>11}")
    paths = {"weightvault": st, "flax.serialization": msgpack, "orbax": orbax_dir}

    def cell(times: list[float], base: list[float]) -> str:
        med, low = statistics.median(times), min(times)
        ratio = f"{med / statistics.median(base):.2f}/{low / min(base):.2f}"
        return f"{med:7.3f} [{low:.3f}] {ratio:>11}"

    for name, path in paths.items():
        print(
            f"{name:20} {size(path) / MiB:9.1f} {cell(saves[name], saves['weightvault'])} "
            f"{cell(loads[name], loads['weightvault'])}"
        )
    print(f"\noutputs identical after each load: {same}; tie kept after loads: {tied}")
    shutil.rmtree(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
