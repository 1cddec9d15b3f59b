"""torch ``.pt``/``.bin`` files: read safely with and without torch; malicious pickles refused.

The oracle is ``torch.save``/``torch.load``. Malicious files are real pickles whose
``__reduce__`` would run ``os.system``; every test asserts their marker file never appears.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import weightvault
import weightvault.numpy as wvn
from weightvault import FormatError
from weightvault.formats import detect
from weightvault.formats._registry import open_checkpoint
from weightvault.formats.pickle_scan import scan

torch = pytest.importorskip("torch")
nn = torch.nn

import weightvault.torch as wv  # noqa: E402


class Evil:
    """Runs a shell command when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


class EvalEvil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (eval, ("__import__('os').getcwd()",))


def shared_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    m[1].weight = m[0].weight  # tied: one storage, same layout
    sd = dict(m.state_dict())
    base = torch.arange(24, dtype=torch.float32)
    sd["v.full"] = base
    sd["v.part"] = base[4:12].view(2, 4)  # partial view of one storage
    sd["v.t"] = base[:12].view(3, 4).t()  # strided view
    sd["copy"] = m[0].bias.detach().clone()  # equal bytes, own storage
    sd["bf"] = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    sd["f8"] = torch.tensor([0.5, 2.0], dtype=torch.float8_e4m3fn)
    sd["steps"] = torch.tensor(7, dtype=torch.int64)
    return sd


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].float(), want[k].float()), k


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_sharing_in_the_pickle_comes_through(tmp_path: Path, legacy: bool) -> None:
    sd = shared_state()
    if legacy:  # the legacy format cannot hold float8
        sd.pop("f8")
    path = tmp_path / "model.pt"
    torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
    assert detect(path) == ("pickle" if legacy else "torch")
    with open_checkpoint(path) as ckpt:
        kinds = {n: ckpt.entry(n).kind for n in ckpt.names}
    assert kinds["1.weight"] == "alias" and kinds["copy"] == "copy"
    assert kinds["v.part"] == kinds["v.t"] == "view" and kinds["v.full"] == "stored"
    assert_same(wv.load_file(path), torch.load(path, weights_only=True))


def test_numpy_reads_torch_files_with_ml_dtypes(tmp_path: Path) -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    sd = shared_state()
    path = tmp_path / "pytorch_model.bin"
    torch.save(sd, path)
    got = wvn.load_file(path)
    assert got["bf"].dtype == ml_dtypes.bfloat16 and got["f8"].dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(got["bf"].astype(np.float32), [1.5, -2.0])
    np.testing.assert_array_equal(got["v.t"], sd["v.t"].numpy())
    # Aliases come back as separate arrays with equal values.
    assert got["1.weight"] is not got["0.weight"]
    np.testing.assert_array_equal(got["1.weight"], got["0.weight"])


def test_nested_checkpoints_are_flattened_and_non_tensors_skipped(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pth"
    torch.save({"model": {"w": torch.ones(2)}, "epoch": 3, "ema": {"w": torch.zeros(2)}}, path)
    assert list(wv.load_file(path)) == ["model.w", "ema.w"]


def test_frozen_parameters_are_recorded(tmp_path: Path) -> None:
    path = tmp_path / "p.pt"
    torch.save({"p": nn.Parameter(torch.ones(2), requires_grad=False), "q": torch.ones(3)}, path)
    with open_checkpoint(path) as ckpt:
        assert ckpt.manifest.frozen == ["p"]


def test_adapter_load_accepts_a_torch_file(tmp_path: Path) -> None:
    src = nn.Linear(3, 2)
    path = tmp_path / "lin.bin"
    torch.save(src.state_dict(), path)
    dst = nn.Linear(3, 2)
    assert wv.load(dst, path).ok
    assert torch.equal(dst.weight, src.weight)


# ---------------------------------------------------------------------------------------
# Malicious pickles
# ---------------------------------------------------------------------------------------


def evil_files(tmp_path: Path) -> tuple[Path, list[Path]]:
    marker = tmp_path / "pwned"
    zip_pt = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": Evil(marker)}, zip_pt)
    legacy = tmp_path / "evil_legacy.pt"
    torch.save(
        {"w": torch.ones(2), "x": Evil(marker)}, legacy, _use_new_zipfile_serialization=False
    )
    plain = tmp_path / "evil.pkl"
    plain.write_bytes(pickle.dumps({"x": Evil(marker)}, protocol=2))
    p4 = tmp_path / "evil4.bin"  # protocol 4: STACK_GLOBAL with memoized strings
    p4.write_bytes(pickle.dumps({"x": Evil(marker), "y": Evil(marker)}, protocol=4))
    p0 = tmp_path / "evil0.bin"  # protocol 0: text GLOBAL
    p0.write_bytes(pickle.dumps(Evil(marker), protocol=0))
    return marker, [zip_pt, legacy, plain, p4, p0]


def test_malicious_pickles_are_refused_and_never_run(tmp_path: Path) -> None:
    marker, files = evil_files(tmp_path)
    for path in files:
        for read in (open_checkpoint, wv.load_file, wvn.load_file, weightvault.inspect):
            with pytest.raises(FormatError, match=r"(posix|os)\.system") as info:
                read(path)
            assert str(path) in str(info.value)
        with pytest.raises(FormatError, match="system"):
            weightvault.convert(path, tmp_path / "out.safetensors")
    assert not marker.exists()
    assert not (tmp_path / "out.safetensors").exists()


def test_builtins_eval_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "eval.pt"
    torch.save({"w": torch.ones(1), "e": EvalEvil()}, path)
    with pytest.raises(FormatError, match=r"builtins\.eval"):
        open_checkpoint(path)


def test_scan_needs_no_unpickling() -> None:
    assert scan(io.BytesIO(pickle.dumps({"a": [1, 2.0, "x"]}, protocol=5)), "ok") == []
    with pytest.raises(FormatError, match=r"builtins\.exec"):
        scan(io.BytesIO(pickle.dumps(exec, protocol=4)), "x")
    with pytest.raises(FormatError, match="not a valid pickle"):
        scan(io.BytesIO(b"\x80\x04\x95\xff\xff\xff\xff"), "x")


def test_cli_refuses_a_malicious_file(tmp_path: Path) -> None:
    from weightvault._cli.app import main

    marker, files = evil_files(tmp_path)
    assert main(["convert", str(files[0]), str(tmp_path / "o.safetensors")]) == 3
    assert not marker.exists()


# ---------------------------------------------------------------------------------------
# Without torch
# ---------------------------------------------------------------------------------------

NO_TORCH = """
import json, sys
sys.modules["torch"] = None
import weightvault, weightvault.numpy as wvn
from weightvault.formats._registry import open_checkpoint
out = {}
with open_checkpoint(sys.argv[1]) as ckpt:
    out["kinds"] = {n: ckpt.entry(n).kind for n in ckpt.names}
weightvault.convert(sys.argv[1], sys.argv[2])
for bad in sys.argv[3:]:
    try:
        open_checkpoint(bad)
    except weightvault.FormatError as e:
        out.setdefault("refused", []).append(str(e))
assert sys.modules["torch"] is None
print(json.dumps(out))
"""


def test_no_torch_path_reads_what_torch_save_wrote(tmp_path: Path) -> None:
    sd = shared_state()
    path = tmp_path / "model.pt"
    torch.save(sd, path)
    marker, evil = evil_files(tmp_path)
    out = tmp_path / "converted.safetensors"
    run = subprocess.run(
        [sys.executable, "-c", NO_TORCH, str(path), str(out), *map(str, evil)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    kinds = doc["kinds"]
    assert kinds["1.weight"] == "alias" and kinds["copy"] == "copy" and kinds["v.t"] == "view"
    assert len(doc["refused"]) == len(evil)
    assert all("system" in msg or "legacy" in msg for msg in doc["refused"])
    assert not marker.exists()
    assert_same(wv.load_file(out), sd)


# ---------------------------------------------------------------------------------------
# Hostile zips and pickles
# ---------------------------------------------------------------------------------------


def _p(obj: object) -> bytes:
    """The opcodes of one small value, without PROTO and STOP."""
    return pickle.dumps(obj, protocol=2)[2:-1]


def tensor_pickle(
    shape: tuple[int, ...], stride: tuple[int, ...], numel: int, key: str = "0"
) -> bytes:
    """A state dict ``{"w": tensor}`` written opcode by opcode, as torch.save writes it."""
    storage = b"(" + _p("storage") + b"ctorch\nFloatStorage\n" + _p(key) + _p("cpu") + _p(numel)
    storage += b"tQ"  # TUPLE, BINPERSID
    args = b"(" + storage + _p(0) + _p(shape) + _p(stride) + b"\x89ccollections\nOrderedDict\n)R"
    return b"\x80\x02}" + _p("w") + b"ctorch._utils\n_rebuild_tensor_v2\n" + args + b"tRs."


def torch_zip(path: Path, pkl: bytes, storages: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", "3\n")
    return path


def test_handwritten_zip_matches_torch(tmp_path: Path) -> None:
    data = np.arange(6, dtype=np.float32).tobytes()
    path = torch_zip(tmp_path / "ok.pt", tensor_pickle((2, 3), (3, 1), 6), {"0": data})
    assert torch.equal(wv.load_file(path)["w"], torch.arange(6.0).view(2, 3))


HOSTILE_ZIPS = {
    "absurd-shape": (tensor_pickle((1 << 40, 1 << 20), (1 << 20, 1), 6), {"0": bytes(24)}),
    "storage-too-small": (tensor_pickle((2, 3), (3, 1), 6), {"0": bytes(8)}),
    "missing-storage": (tensor_pickle((2, 3), (3, 1), 6), {}),
    "negative-stride": (tensor_pickle((2, 3), (3, -1), 6), {"0": bytes(24)}),
    "truncated-pickle": (tensor_pickle((2, 3), (3, 1), 6)[:40], {"0": bytes(24)}),
    "not-a-dict": (b"\x80\x02K\x05.", {}),
}


@pytest.mark.parametrize("no_torch", [False, True], ids=["torch", "no-torch"])
@pytest.mark.parametrize("case", list(HOSTILE_ZIPS), ids=list(HOSTILE_ZIPS))
def test_hostile_torch_zips_raise_format_error(
    tmp_path: Path, case: str, no_torch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkl, storages = HOSTILE_ZIPS[case]
    path = torch_zip(tmp_path / f"{case}.pt", pkl, storages)
    if no_torch:
        monkeypatch.setitem(sys.modules, "torch", None)
    start = time.perf_counter()
    with pytest.raises(FormatError) as info:
        open_checkpoint(path)
    assert time.perf_counter() - start < 2.0
    assert str(path) in str(info.value)


def test_truncated_torch_files_raise_format_error(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3)}, good)
    data = good.read_bytes()
    cut = tmp_path / "cut.pt"
    for n in (4, 100, len(data) // 2, len(data) - 30):
        cut.write_bytes(data[:n])
        with pytest.raises(FormatError):
            open_checkpoint(cut)


# ---------------------------------------------------------------------------------------
# Zip files through the stand-ins, torch installed or not: bitwise what torch.load gives
# ---------------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as bytes (NaNs and signed zeros compare exactly)."""
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)
    dense = flat.new_empty(flat.shape).copy_(flat)  # stride 1 even where numel is 1
    return dense.view(torch.uint8) if dense.numel() else dense


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
        assert torch.equal(bits(got[k]), bits(w)), k


def reference(path: Path) -> dict[str, torch.Tensor]:
    return dict(torch.load(path, weights_only=True))


def no_torch_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every torch.load fail, so that a read that passes never called it."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", refuse)


def views_state() -> dict[str, torch.Tensor]:
    """Ties, views at offsets and with strides, flags, dtypes and empties of storages."""
    torch.manual_seed(1)
    emb = nn.Embedding(10, 6)
    head = nn.Linear(6, 10, bias=False)
    head.weight = emb.weight  # tied, as GPT-2's head is
    frozen = nn.Parameter(torch.randn(3), requires_grad=False)
    base = torch.randn(6, 8)
    z = torch.randn(5, dtype=torch.complex64)
    wide = torch.arange(64, dtype=torch.float64)
    return {
        "emb.weight": emb.weight,
        "head.weight": head.weight,
        "frozen": frozen,
        "base.rows": base[2:5],  # an offset into the storage, contiguous
        "base.cols": base[:, 3:7],  # a narrow along the last dimension: strided
        "base.t": base.t(),
        "base.step": base.view(-1)[1::5],
        "base.expand": base[0, :1].expand(4, 3),  # stride 0
        "base.diag": base.diagonal(),
        "base.empty": base[:0],
        "base.scalar": base[1, 1],  # 0-dim, at an offset
        "z.conj": z.conj(),
        # float32 with the negative bit, over a complex storage saved only this way
        "neg_imag": torch.randn(5, dtype=torch.complex64).conj().imag,
        "z": z,
        "wide.tail": wide[40:],  # only the storage's tail is used
        "bf16": torch.randn(4, 4).to(torch.bfloat16)[:, ::2],
        "f8": torch.tensor([0.5, -2.0, 448.0], dtype=torch.float8_e4m3fn),
        "mask": torch.tensor([True, False, True]),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
    }


def test_gpt2_reads_bitwise_as_torch_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=32)
    model = GPT2LMHeadModel(cfg).eval()
    path = tmp_path / "pytorch_model.bin"
    torch.save(model.state_dict(), path)
    want = reference(path)
    no_torch_load(monkeypatch)
    with open_checkpoint(path) as ckpt:
        assert ckpt.entry("lm_head.weight").kind == "alias"
        assert ckpt.entry("lm_head.weight").stored == "transformer.wte.weight"
    for mmap in (False, True):
        assert_bitwise(wv.load_file(path, mmap=mmap), want)
    other = GPT2LMHeadModel(cfg).eval()
    assert wv.load(other, path).ok
    assert_bitwise(dict(other.state_dict()), want)
    assert other.lm_head.weight is other.transformer.wte.weight


def test_tied_and_strided_views_read_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "views.pt"
    torch.save(views_state(), path)
    want = reference(path)
    no_torch_load(monkeypatch)
    with open_checkpoint(path) as ckpt:
        kinds = {n: ckpt.entry(n).kind for n in ckpt.names}
        assert ckpt.manifest.frozen == ["frozen"]
    assert kinds["head.weight"] == "alias" and kinds["emb.weight"] == "stored"
    # Flagged tensors hold values their storage's bytes do not: never views of them.
    assert want["neg_imag"].is_neg() and want["z.conj"].is_conj()
    assert kinds["z.conj"] == kinds["neg_imag"] == "stored"
    assert {kinds[n] for n in ("base.cols", "base.t", "base.step", "base.expand")} == {"view"}
    for mmap in (False, True):
        assert_bitwise(wv.load_file(path, mmap=mmap), want)
    got = wvn.load_file(path)
    np.testing.assert_array_equal(got["base.t"], want["base.t"].numpy())
    np.testing.assert_array_equal(got["z.conj"], want["z.conj"].resolve_conj().numpy())


def test_only_the_bytes_a_tensor_uses_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import weightvault.formats.torch_zip as torch_zip

    path = tmp_path / "slice.pt"
    big = torch.arange(1 << 21, dtype=torch.float32)  # 8 MiB, all of it in the file
    torch.save({"w": big[1000:1004], "e": big[:0]}, path)
    sizes: list[int] = []
    real = torch_zip.new_buffer

    def recording(nbytes: int) -> memoryview:
        sizes.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(torch_zip, "new_buffer", recording)
    assert_bitwise(wv.load_file(path), reference(path))
    assert sizes == [16], sizes  # w's 4 floats (byte 4000 is aligned); e reads nothing


def test_legacy_files_are_still_read_by_torch_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "legacy.pt"
    sd = shared_state()
    sd.pop("f8")
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    assert_bitwise(wv.load_file(path), reference(path))
    no_torch_load(monkeypatch)
    with pytest.raises(FormatError, match=r"torch\.load\(weights_only=True\) refused"):
        open_checkpoint(path)


@st.composite
def strided_views(
    draw: st.DrawFn,
) -> tuple[int, list[tuple[int, tuple[int, ...], tuple[int, ...]]]]:
    """A storage's length and views of it (offset, shape, stride), each inside it."""
    length = draw(st.integers(1, 64))
    views = []
    for _ in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
        stride = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
        if 0 in shape:  # holds no element, wherever it starts
            views.append((draw(st.integers(0, length - 1)), shape, stride))
            continue
        reach = sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
        if reach < length:
            views.append((draw(st.integers(0, length - 1 - reach)), shape, stride))
    return length, views


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=strided_views(), dtype=st.sampled_from([torch.float32, torch.int16, torch.bfloat16]))
def test_any_view_of_a_storage_reads_as_torch_load(
    tmp_path: Path,
    case: tuple[int, list[tuple[int, tuple[int, ...], tuple[int, ...]]]],
    dtype: torch.dtype,
) -> None:
    length, views = case
    base = torch.arange(length).to(dtype)
    sd = {"base": base} if length % 2 else {}
    for i, (offset, shape, stride) in enumerate(views):
        sd[f"v{i}"] = base.as_strided(shape, stride, offset)
    sd["other"] = torch.ones(3, dtype=dtype)
    path = tmp_path / f"views-{os.urandom(6).hex()}.pt"
    torch.save(sd, path)
    assert_bitwise(wv.load_file(path), reference(path))
    path.unlink()


CUT = r"""
import json, os, sys
import torch, weightvault, weightvault.torch as wvt
path, call = sys.argv[1], sys.argv[2]
size, victim = os.path.getsize(path), os.stat(path)
real = getattr(os, call)
state = {"cut": False}
def cutting(fd, *args):
    st = os.fstat(fd)
    if not state["cut"] and (st.st_dev, st.st_ino) == (victim.st_dev, victim.st_ino):
        os.truncate(path, size // 2)
        state["cut"] = True
    return real(fd, *args)
setattr(os, call, cutting)
model = torch.nn.Module()
model.a = torch.nn.Parameter(torch.zeros(1 << 18))
model.b = torch.nn.Parameter(torch.zeros(1 << 18))
out = {"outcome": "loaded", "message": ""}
try:
    wvt.load(model, path)
except weightvault.FormatError as e:
    out["outcome"], out["message"] = "raised", str(e)
out["cut"] = state["cut"]
out["untouched"] = not (model.a.detach().any() or model.b.detach().any()).item()
print(json.dumps(out))
"""


@pytest.mark.parametrize("call", ["pread", "preadv"], ids=["before-headers", "before-data"])
def test_a_pt_cut_short_while_read_is_an_error_naming_the_tensor(tmp_path: Path, call: str) -> None:
    path = tmp_path / "model.pt"
    torch.save({"a": torch.ones(1 << 18), "b": torch.full((1 << 18,), 2.0)}, path)
    run = subprocess.run(
        [sys.executable, "-c", CUT, str(path), call], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, f"the reader died (signal {-run.returncode}): {run.stderr[-2000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["cut"], f"the cut never came, so nothing was tested: {out}"
    assert out["outcome"] == "raised", out
    assert re.search(f"{re.escape(str(path))}: tensor '[ab]'", out["message"]), out
    assert out["untouched"], out
