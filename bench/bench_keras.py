"""Keras ``save_weights``/``load_weights`` vs ``weightvault.keras``: time, file size, memory.

One process, one model of about 100M parameters: an embedding (32000 x 1024) whose
variable is shared with the output projection (a tied LM head, held by a second layer),
and 8 Dense(1024 -> 1024) + Dense(1024 -> 4096) + Dense(4096 -> 1024) blocks whose
first Dense kernel is shared by pairs of blocks. Keras writes a shared variable once per
layer that holds it; weightvault writes it once.

Contenders alternate within every round (the first one rotates); medians are reported.
Saves include fsync of the file for both (weightvault always fsyncs; Keras' file gets an
explicit ``os.fsync`` inside the timing). Loads read a warm file into a built model.

With ``--memory``: the peak extra RSS of each load, a fresh process per contender, on
a built model of 12 Dense(2048 -> 2048) (192 MiB). The peak is the kernel's high-water
mark (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the load) minus the
RSS (psutil) after the model is built, so a spike between two polls is never missed.

Usage:
    KERAS_BACKEND=torch python bench/bench_keras.py [--quick] [--rounds 3]
    KERAS_BACKEND=torch python bench/bench_keras.py --memory
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras
import numpy as np

import weightvault.keras as wvk
from weightvault._base.atomic import fsync_file

MiB = 1 << 20


class HeldKernel(keras.layers.Layer):
    """Uses a kernel that another layer owns (a tied head, a shared projection)."""

    def __init__(self, kernel: Any, transpose: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.kernel = kernel
        self.transpose = transpose

    def call(self, x: Any) -> Any:
        k = keras.ops.transpose(self.kernel) if self.transpose else self.kernel
        return keras.ops.matmul(x, k)


def build(quick: bool) -> Any:
    vocab, width, blocks = (4000, 256, 2) if quick else (32000, 1024, 8)
    emb = keras.layers.Embedding(vocab, width, name="embed")
    emb.build((None,))
    inp = keras.Input((8,), dtype="int32")
    x = emb(inp)
    shared: Any = None
    for i in range(blocks):
        if i % 2 == 0:
            proj = keras.layers.Dense(width, name=f"proj{i}")
            x = proj(x)
            shared = proj.kernel
        else:
            x = HeldKernel(shared, name=f"proj{i}")(x)  # shares block i-1's kernel
        x = keras.layers.Dense(4 * width, activation="relu", name=f"up{i}")(x)
        x = keras.layers.Dense(width, name=f"down{i}")(x)
    out = HeldKernel(emb.embeddings, transpose=True, name="lm_head")(x)
    return keras.Model(inp, out)


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


def print_rows(*rows: tuple[str, str, list[float], list[float]]) -> None:
    """One line per contender: its file's size, then save and load medians [min-max]."""
    print(f"{'':26} {'file MiB':>9} {'save s':>18} {'load s':>18}")
    for name, path, s, ld in rows:
        print(
            f"{name:26} {os.path.getsize(path) / MiB:9.1f} "
            f"{statistics.median(s):7.3f} [{min(s):.2f}-{max(s):.2f}] "
            f"{statistics.median(ld):7.3f} [{min(ld):.2f}-{max(ld):.2f}]"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~2M-parameter model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory", action="store_true", help="peak extra RSS of each load")
    ap.add_argument("--repeat", type=int, default=3, help="--memory: processes per contender")
    ap.add_argument("--child", nargs=2, metavar=("CONTENDER", "FOLDER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child or args.memory:
        return child(*args.child) if args.child else memory(args.repeat)

    model = build(args.quick)
    target = build(args.quick)
    n_params = sum(int(np.prod(v.shape)) for v in model.weights)  # each variable once
    folder = tempfile.mkdtemp(prefix="wv-bench-keras-")
    h5 = os.path.join(folder, "m.weights.h5")
    st = os.path.join(folder, "m.safetensors")

    def keras_save() -> None:
        model.save_weights(h5)
        fsync_file(h5)

    def wv_save() -> None:
        wvk.save(model, st)

    saves = rounds(
        {"keras save_weights": keras_save, "weightvault.keras.save": wv_save}, args.rounds
    )
    loads = rounds(
        {
            "keras load_weights": lambda: target.load_weights(h5),
            "weightvault.keras.load": lambda: wvk.load(target, st),
        },
        args.rounds,
    )
    report = wvk.save(model, st)
    x = np.random.default_rng(0).integers(0, 100, (2, 8)).astype("int32")
    wvk.load(target, st)
    same = np.array_equal(
        keras.ops.convert_to_numpy(model(x)), keras.ops.convert_to_numpy(target(x))
    )

    print(f"keras {keras.__version__}, {keras.backend.backend()}, python {sys.version.split()[0]}")
    print(f"model: {n_params / 1e6:.1f}M parameters, {len(report.aliases)} shared-variable aliases")
    print(f"rounds: {args.rounds} (+1 warm-up), medians [min-max] in seconds\n")
    print_rows(
        ("keras .weights.h5", h5, saves["keras save_weights"], loads["keras load_weights"]),
        ("weightvault.keras", st, saves["weightvault.keras.save"], loads["weightvault.keras.load"]),
    )
    print(
        f"\nweightvault stored {report.stored_bytes / MiB:.1f} MiB of "
        f"{report.logical_bytes / MiB:.1f} MiB logical"
    )
    print(f"predictions identical after weightvault load: {same}")
    for f in (h5, st):
        os.unlink(f)
    os.rmdir(folder)
    return 0


# -- peak extra memory of a load (--memory) ----------------------------------------------


def dense_stack() -> Any:
    """12 Dense(2048 -> 2048): 192 MiB of float32 kernels (and 96 KiB of biases)."""
    width = 2048
    return keras.Sequential(
        [keras.Input((width,))] + [keras.layers.Dense(width, name=f"d{i}") for i in range(12)]
    )


#: Contender -> (what it loads, whether the model is built before the measurement).
CONTENDERS: dict[str, tuple[str, bool]] = {
    "(reference) building the model, no load": ("", False),
    "keras load_weights (.weights.h5)": ("keras.weights.h5", True),
    "keras.models.load_model (.keras)": ("keras.keras", False),
    "weightvault.keras.load (weightvault file)": ("m.safetensors", True),
    "weightvault.keras.load (vault)": ("vault", True),
    "weightvault.keras.load (vault, verify=False)": ("vault", True),
    "weightvault.keras.load (vault, compression=None)": ("vault-raw", True),
    "weightvault.keras.load (.keras by save_model)": ("wv.keras", True),
    "weightvault.keras.load (.weights.h5 by save_weights)": ("wv.weights.h5", True),
    "weightvault.keras.load_model (.keras by save_model)": ("wv.keras", False),
}


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmHWM``: the peak RSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(contender: str, folder: str) -> int:
    """Load once in this fresh process; print the peak extra RSS and the time as JSON."""
    import gc
    import json

    import psutil

    import weightvault

    what, built = CONTENDERS[contender]
    path = os.path.join(folder, what)
    model = dense_stack() if built else None
    if what.startswith("vault"):
        # The codec's import (blosc2, ~17 MiB) is once per process, not per load; as
        # Keras has h5py imported before its loads, a vault's codec is imported first.
        from weightvault._vault.objects.codec import _blosc2

        _blosc2()
    gc.collect()
    before = psutil.Process().memory_info().rss
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    t0 = time.perf_counter()
    if contender.startswith("(reference)"):
        model = dense_stack()
    elif contender.startswith("keras load_weights"):
        model.load_weights(path)
    elif contender.startswith("keras.models"):
        model = keras.models.load_model(path)
    elif contender.startswith("weightvault.keras.load_model"):
        model = wvk.load_model(path)
    elif what.startswith("vault"):
        weightvault.Vault(path).load(model, verify="verify=False" not in contender)
    else:
        wvk.load(model, path)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    x = np.ones((1, 2048), "float32")
    out = float(np.asarray(keras.ops.convert_to_numpy(model(x))).sum())
    print(json.dumps({"extra": peak - before, "seconds": seconds, "out": out}))
    return 0


def memory(repeat: int) -> int:
    """Write every file once, then measure each contender in fresh processes (medians)."""
    import json
    import subprocess

    import weightvault

    model = dense_stack()
    rng = np.random.default_rng(0)
    for v in model.weights:  # values a reload must reproduce, not initialiser output
        v.assign(rng.standard_normal(tuple(v.shape)).astype("float32") * 0.01)
    model_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    folder = tempfile.mkdtemp(prefix="wv-bench-keras-mem-")
    model.save_weights(os.path.join(folder, "keras.weights.h5"))
    model.save(os.path.join(folder, "keras.keras"))
    wvk.save(model, os.path.join(folder, "m.safetensors"))
    weightvault.Vault(os.path.join(folder, "vault")).save(model)  # compressed: the default
    weightvault.Vault(os.path.join(folder, "vault-raw"), compression=None).save(model)
    wvk.save_model(model, os.path.join(folder, "wv.keras"))
    wvk.save_weights(model, os.path.join(folder, "wv.weights.h5"))
    expected = float(np.asarray(keras.ops.convert_to_numpy(model(np.ones((1, 2048))))).sum())
    print(
        f"keras {keras.__version__}, backend {keras.backend.backend()}; model: 12 Dense "
        f"2048x2048, {model_bytes / MiB:.1f} MiB; peak extra RSS of one load, fresh process\n"
    )
    print(f"{'':54} {'extra MiB':>9} {'of model':>9} {'load s':>7}  (median of {repeat})")
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend())
    for contender in CONTENDERS:
        runs = []
        for _ in range(repeat):
            done = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", contender, folder],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        extra = statistics.median(r["extra"] for r in runs)
        seconds = statistics.median(r["seconds"] for r in runs)
        right = all(abs(r["out"] - expected) < 1e-3 * max(1.0, abs(expected)) for r in runs)
        note = "" if right or contender.startswith("(reference)") else "  WRONG VALUES"
        print(f"{contender:54} {extra / MiB:9.1f} {extra / model_bytes:9.1%} {seconds:7.3f}{note}")
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        size = os.path.getsize(full) if os.path.isfile(full) else _folder_bytes(full)
        print(f"  {name}: {size / MiB:.1f} MiB")
    shutil.rmtree(folder)
    return 0


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


if __name__ == "__main__":
    raise SystemExit(main())
