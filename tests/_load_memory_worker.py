"""Subprocess body of tests/test_vault_load_memory.py: save a model into a vault, or load
it in a fresh process and print the peak RSS the load added, as JSON.

    python _load_memory_worker.py save|load|keras-load-weights torch|keras ROOT
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
from typing import Any

import numpy as np

#: 12 layers of 2048 x 2048 float32: the 192 MiB model of issue 22.
WIDTH, DEPTH = 2048, 12


def build(framework: str) -> Any:
    if framework == "torch":
        import torch

        return torch.nn.Sequential(
            *[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)]
        )
    import keras

    return keras.Sequential(
        [keras.Input((WIDTH,))]
        + [keras.layers.Dense(WIDTH, use_bias=False, name=f"d{i}") for i in range(DEPTH)]
    )


def arrays(framework: str, model: Any) -> list[Any]:
    if framework == "torch":
        return [p.detach().numpy() for p in model.parameters()]
    import keras

    return [keras.ops.convert_to_numpy(v.value) for v in model.weights]


def values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Small normals with bf16's precision (the low half of each float zero): whole fp32
    weights stay raw unless compression saves a quarter, and these compress to about
    half, so the load measured decodes."""
    a = (rng.standard_normal(shape) * 0.01).astype(np.float32)
    return (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def fill(framework: str, model: Any) -> None:
    rng = np.random.default_rng(0)
    for a in arrays(framework, model) if framework == "torch" else []:
        a[...] = values(rng, a.shape)
    if framework == "keras":
        for v in model.weights:
            v.assign(values(rng, tuple(v.shape)))


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":")) * 1024


def digest(framework: str, model: Any) -> list[float]:
    return [float(np.asarray(a, np.float64).sum()) for a in arrays(framework, model)]


def main(what: str, framework: str, root: str) -> None:
    from weightvault import Vault

    model = build(framework)
    if what == "save":
        fill(framework, model)
        with Vault(root) as vault:
            vault.save(model)
            vault.compact()  # the newest compressed (see values), so the load decodes
        if framework == "keras":
            model.save_weights(f"{root}/keras.weights.h5")  # the oracle's own file
        print(json.dumps({"digest": digest(framework, model)}))
        return
    # The codec's import is a one-time cost of the process (about 17 MiB), not the load's.
    from weightvault._vault.objects.codec import _blosc2

    _blosc2()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory malloc kept would hide a peak
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    if what == "keras-load-weights":
        model.load_weights(f"{root}/keras.weights.h5")  # Keras' own load, the oracle
    else:
        Vault(root).load(model)  # verify=True, its default
    extra = status("VmHWM") - before
    print(json.dumps({"extra": extra, "digest": digest(framework, model)}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
