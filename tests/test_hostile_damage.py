"""Damaged files: found and named, a FormatError or a report, never anything worse.

A byte flipped after saving fails its checksum, names the stored tensor and never reaches
a model; a fuzzed valid file loads or is a FormatError; a file truncated underneath an
open reader is a FormatError or a report, never a SIGBUS.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import weightvault
from _hostile_files import _write, needs_torch, reseal, torch, wvt
from weightvault.formats._registry import open_checkpoint

# ---------------------------------------------------------------------------------------
# Checksums: damage after saving is found, named, and never reaches a model
# ---------------------------------------------------------------------------------------


def _flip_byte_of(path: Path, stored: str, index: int = 0) -> None:
    with open_checkpoint(path) as ckpt:
        info = ckpt.stored[stored]
        assert info.nbytes > index
        at = ckpt.header.data_start + info.start + index
    with open(path, "r+b") as f:
        f.seek(at)
        (byte,) = f.read(1)
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))


@needs_torch
def test_flipped_byte_is_caught_and_named(tmp_path: Path) -> None:
    assert torch is not None and wvt is not None
    torch.manual_seed(0)

    def build() -> torch.nn.Module:
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        m[2].weight = torch.nn.Parameter(m[0].weight.detach().t().clone())
        m.register_buffer("steps", torch.tensor(7))
        return m

    saved = build()
    path = tmp_path / "model.safetensors"
    wvt.save(saved, path)
    assert weightvault.verify(path).ok

    _flip_byte_of(path, "2.weight", index=37)

    report = weightvault.verify(path)
    assert report.ok is False
    assert len(report.problems) == 1
    assert "'2.weight'" in report.problems[0]
    assert "checksum mismatch" in report.problems[0]

    target = build()  # different random values from the file
    with torch.no_grad():
        for p in target.parameters():
            p.add_(1.0)
    before = {k: v.detach().clone() for k, v in target.state_dict().items()}
    with pytest.raises(weightvault.ChecksumError, match=r"2\.weight") as info:
        wvt.load(target, path, verify=True)
    assert info.value.names == ["2.weight"]
    assert isinstance(info.value, weightvault.FormatError)
    after = target.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k

    with pytest.raises(weightvault.ChecksumError, match=r"2\.weight"):
        wvt.load_file(path, verify=True)
    # Without verify the damage is not looked for, and the undamaged tensors are intact.
    loaded = wvt.load_file(path)
    assert torch.equal(loaded["0.weight"], saved[0].weight.detach())
    assert not torch.equal(loaded["2.weight"], saved[2].weight.detach())


@needs_torch
def test_flipped_byte_in_tied_tensor_names_the_stored_tensor(tmp_path: Path) -> None:
    assert torch is not None and wvt is not None
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    path = tmp_path / "tied.safetensors"
    wvt.save(model, path)
    assert weightvault.inspect(path).aliases == {"head.weight": "emb.weight"}
    _flip_byte_of(path, "emb.weight", index=5)
    report = weightvault.verify(path)
    assert not report.ok
    assert "'emb.weight'" in report.problems[0]
    fresh = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)}
    )
    fresh.head.weight = fresh.emb.weight
    before = fresh.emb.weight.detach().clone()
    with pytest.raises(weightvault.ChecksumError, match=r"emb\.weight"):
        wvt.load(fresh, path, verify=True)
    assert torch.equal(fresh.emb.weight.detach(), before)


# ---------------------------------------------------------------------------------------
# Fuzz: a damaged valid file loads or is a FormatError, never anything else
# ---------------------------------------------------------------------------------------


def _valid_file() -> bytes:
    """A small weightvault file with an alias, a copy, views, frozen names and metadata."""
    assert torch is not None and wvt is not None
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 4, generator=g)
    tensors = {
        "w": base,
        "w_tied": base,
        "w_t": base.t(),
        "w_copy": base.clone(),
        "b": torch.arange(5, dtype=torch.int16),
        "flag": torch.tensor(True),
        "half": torch.randn(2, 2, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 2),
    }
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "v.safetensors")
        wvt.save(tensors, p, metadata={"step": "3"})
        with open(p, "rb") as f:
            return f.read()


_VALID: bytes | None = None


def _valid() -> bytes:
    global _VALID
    if _VALID is None:
        _VALID = _valid_file()
    return _VALID


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    data = bytearray(_valid())
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    for _ in range(draw(st.integers(0, 4))):
        # Mostly hit the header, where every byte means something.
        hi = draw(st.sampled_from([header_end, len(data)])) - 1
        at = draw(st.integers(0, hi))
        kind = draw(st.sampled_from(["set", "flip", "delete", "insert"]))
        if kind == "set":
            data[at] = draw(st.sampled_from(b'0123456789-[]{}",:.eE ') | st.integers(0, 255))
        elif kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "delete":
            del data[at]
        else:
            data.insert(at, draw(st.integers(0, 255)))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    # Resealed, so the damage reaches the parser's checks past the header's sum.
    return reseal(bytes(data))


@needs_torch
@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=damaged())
def test_fuzzed_file_loads_or_is_a_format_error(tmp_path: Path, data: bytes) -> None:
    assert wvt is not None
    path = _write(tmp_path, data, "fuzz.safetensors")
    for read in (
        weightvault.inspect,
        wvt.load_file,
        lambda p: wvt.load_file(p, mmap=True, verify=True),
    ):
        with contextlib.suppress(weightvault.FormatError):
            read(path)
    report = weightvault.verify(path)  # never raises: damage is reported
    assert isinstance(report.ok, bool)


# ---------------------------------------------------------------------------------------
# A file truncated underneath a reader: FormatError or a report, never SIGBUS
# ---------------------------------------------------------------------------------------

_TRUNCATE = """
import sys, os
import numpy as np
import weightvault, weightvault.numpy as wvn
from weightvault.formats._registry import open_checkpoint

path, how = sys.argv[1], sys.argv[2]
arrays = {f"t{i}": np.full(1 << 18, i, np.float32) for i in range(4)}
wvn.save(arrays, path)

def shrink():
    os.truncate(path, 4096)

if how == "verify":
    calls = []
    def progress(n):
        calls.append(n)
        if len(calls) == 1:
            shrink()
    report = weightvault.verify(path, progress=progress)
    print("ok" if report.ok else "damaged", report.problems[:1])
    sys.exit(0)
ckpt = open_checkpoint(path)
shrink()
try:
    if how == "numpy":
        wvn.load_file(ckpt, verify=True)
    elif how == "numpy_noverify":
        wvn.load_file(ckpt)
    elif how == "numpy_load":
        wvn.load({k: np.zeros_like(v) for k, v in arrays.items()}, ckpt, verify=True)
    elif how == "torch":
        import weightvault.torch as wvt
        wvt.load_file(ckpt, verify=True)
    elif how == "torch_noverify":
        import weightvault.torch as wvt
        wvt.load_file(ckpt)
    elif how == "torch_load":
        import torch, weightvault.torch as wvt
        m = torch.nn.ParameterDict({k: torch.zeros(1 << 18) for k in arrays})
        wvt.load(m, ckpt, verify=True)
    elif how == "torch_load_views":
        # Views cannot be read straight into a parameter; they are copied from their base.
        import torch, weightvault.torch as wvt
        ckpt.close()
        base = torch.arange(1 << 20, dtype=torch.float32)
        wvt.save({"a": base[: 1 << 19], "b": base[1 << 18 :]}, path)
        ckpt = open_checkpoint(path)
        shrink()
        m = torch.nn.ParameterDict({"a": torch.zeros(1 << 19), "b": torch.zeros(3 << 18)})
        wvt.load(m, ckpt)
except weightvault.FormatError as e:
    print("FormatError", e)
"""


@pytest.mark.parametrize(
    "how",
    [
        "verify",
        "numpy",
        "numpy_noverify",
        "numpy_load",
        pytest.param("torch", marks=needs_torch),
        pytest.param("torch_noverify", marks=needs_torch),
        pytest.param("torch_load", marks=needs_torch),
        pytest.param("torch_load_views", marks=needs_torch),
    ],
)
def test_truncated_after_open_is_no_sigbus(tmp_path: Path, how: str) -> None:
    import subprocess
    import sys

    path = tmp_path / "shrinks.safetensors"
    result = subprocess.run(
        [sys.executable, "-c", _TRUNCATE, str(path), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # A SIGBUS shows as returncode -7 with no output.
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    if how == "verify":
        assert result.stdout.startswith("damaged"), result.stdout
        assert "the file ended before its bytes did" in result.stdout
    else:
        assert result.stdout.startswith("FormatError"), result.stdout
        assert str(path) in result.stdout
