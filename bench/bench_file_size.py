"""File size of GPT-2 small: weightvault's default save against safetensors' save_model.

Sizes are deterministic, so one run is enough. The model is built from the default
``GPT2Config`` with random weights (nothing is downloaded); a fresh model has copies
(every LayerNorm weight is all ones, many biases all zeros), which the default
``dedupe_copies=False`` stores under every name so plain readers see them.

Usage:
    python bench/bench_file_size.py
"""

from __future__ import annotations

import os
import tempfile

import safetensors.torch
import torch
import transformers

import weightvault
import weightvault.torch as wv


def main() -> None:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    with tempfile.TemporaryDirectory() as folder:
        paths = {
            "safetensors.torch.save_model": os.path.join(folder, "st.safetensors"),
            "weightvault.torch.save (default)": os.path.join(folder, "wv.safetensors"),
            "weightvault.torch.save(dedupe_copies=True)": os.path.join(folder, "d.safetensors"),
        }
        safetensors.torch.save_model(model, paths["safetensors.torch.save_model"])
        wv.save(model, paths["weightvault.torch.save (default)"])
        wv.save(model, paths["weightvault.torch.save(dedupe_copies=True)"], dedupe_copies=True)
        base = os.path.getsize(paths["safetensors.torch.save_model"])
        for label, path in paths.items():
            size = os.path.getsize(path)
            print(f"{label:45s} {size:>12,d} bytes  {size - base:+,d}")
        info = weightvault.inspect(paths["weightvault.torch.save (default)"])
        print(f"inspect(default file).dedupe_savings: {info.dedupe_savings:,d} bytes")


if __name__ == "__main__":
    main()
