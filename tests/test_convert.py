"""``weightvault.convert`` and ``weightvault convert``: every format in, one file out."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import weightvault
import weightvault.numpy as wvn
from weightvault import FormatError, RuleError
from weightvault._cli.app import main

safe_open = pytest.importorskip("safetensors").safe_open

W = np.arange(16, dtype=np.float32).reshape(4, 4)


def mxnet_file(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    out = struct.pack("<QQQ", 0x112, 0, len(arrays))
    for a in arrays.values():
        out += struct.pack("<Iii", 0xF993FAC9, 0, a.ndim) + struct.pack(f"<{a.ndim}q", *a.shape)
        out += struct.pack("<iii", 1, 0, 0) + a.astype(np.float32).tobytes()
    out += struct.pack("<Q", len(arrays))
    for n in arrays:
        out += struct.pack("<Q", len(n)) + n.encode()
    path.write_bytes(out)
    return path


def sources(tmp_path: Path) -> dict[str, Path]:
    """The same three names (two of them copies) in every format."""
    arrays = {"l1.weight": W, "l2.weight": W.copy(), "l1.bias": np.ones(4, np.float32)}
    out = {"mxnet": mxnet_file(tmp_path / "m.params", arrays)}
    np.savez(tmp_path / "m.npz", **arrays)
    out["npz"] = tmp_path / "m.npz"
    wvn.save(arrays, tmp_path / "m.safetensors", dedupe_copies=False)
    out["safetensors"] = tmp_path / "m.safetensors"
    try:
        import h5py

        with h5py.File(tmp_path / "m.weights.h5", "w") as f:
            for k, v in arrays.items():
                f[k.replace(".", "/")] = v
        out["keras"] = tmp_path / "m.weights.h5"
    except ImportError:
        pass
    try:
        import torch

        torch.save({k: torch.from_numpy(v.copy()) for k, v in arrays.items()}, tmp_path / "m.pt")
        out["torch"] = tmp_path / "m.pt"
    except ImportError:
        pass
    return out


def test_every_format_converts_with_copies_stored_once(tmp_path: Path) -> None:
    for fmt, src in sources(tmp_path).items():
        # By default the copy stays stored, so plain readers see it; inspect knows what
        # deduping it would save.
        kept = tmp_path / f"{fmt}-kept.safetensors"
        report = weightvault.convert(src, kept)
        assert report.copies == {} and len(report.duplicates) == 1, fmt
        assert report.stored_bytes == W.nbytes + 16 + report.dedupe_savings, fmt
        with safe_open(str(kept), framework="np") as f:
            assert len(list(f.keys())) == 3, fmt
        assert weightvault.inspect(kept).dedupe_savings == report.dedupe_savings > 0

        dst = tmp_path / f"{fmt}.safetensors"
        report = weightvault.convert(src, dst, dedupe_copies=True)
        assert len(report.copies) == 1, fmt
        assert report.stored_bytes == W.nbytes + 16, fmt
        assert report.file_bytes == dst.stat().st_size
        got = wvn.load_file(dst)
        assert len(got) == 3, fmt
        for name, value in got.items():
            expected = W if "weight" in name else np.ones(4, np.float32)
            np.testing.assert_array_equal(value, expected, err_msg=f"{fmt} {name}")
        assert weightvault.verify(dst).ok


def test_rules_rename_and_drop(tmp_path: Path) -> None:
    src = mxnet_file(tmp_path / "m.params", {"arg:fc.gamma": np.ones(2), "aux:fc.x": np.zeros(2)})
    report = weightvault.convert(
        src, tmp_path / "o.safetensors", rules=[("arg:*.gamma", "*.weight"), ("aux:*", None)]
    )
    assert report.skipped == ["aux:fc.x"]
    assert weightvault.inspect(tmp_path / "o.safetensors").names == ["fc.weight"]


def test_rules_that_merge_names_are_refused(tmp_path: Path) -> None:
    src = mxnet_file(tmp_path / "m.params", {"arg:w": np.ones(2), "aux:w": np.zeros(2)})
    with pytest.raises(RuleError, match="both"):
        weightvault.convert(src, tmp_path / "o.safetensors", rules=[("*:w", "w")])


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    src = sources(tmp_path)["mxnet"]
    report = weightvault.convert(src, tmp_path / "o.safetensors", dry_run=True)
    assert report.file_bytes == 0 and len(report.duplicates) == 1
    assert not (tmp_path / "o.safetensors").exists()


def test_views_and_aliases_survive_a_second_conversion(tmp_path: Path) -> None:
    base = np.arange(24, dtype=np.float32)
    wvn.save({"full": base, "part": base[4:12], "same": base}, tmp_path / "a.safetensors")
    report = weightvault.convert(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert report.aliases == {"same": "full"} and report.views == ["part"]
    np.testing.assert_array_equal(wvn.load_file(tmp_path / "b.safetensors")["part"], base[4:12])


def test_unknown_format_is_a_format_error(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"GIF89a" + bytes(100))
    with pytest.raises(FormatError):
        weightvault.convert(tmp_path / "x.bin", tmp_path / "o.safetensors")


def test_torch_adapter_loads_every_format_directly(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import weightvault.torch as wv

    for fmt, src in sources(tmp_path).items():
        model = torch.nn.Module()
        model.l1 = torch.nn.Linear(4, 4)
        model.l2 = torch.nn.Linear(4, 4, bias=False)
        rules = [("l1/weight", "l1.weight"), ("l2/weight", "l2.weight"), ("l1/bias", "l1.bias")]
        report = wv.load(model, src, rules=rules)
        assert report.ok, fmt
        assert torch.equal(model.l2.weight, torch.from_numpy(W)), fmt


# ---------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------


def test_cli_prints_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = sources(tmp_path)["mxnet"]
    dst = tmp_path / "o.safetensors"
    assert main(["convert", str(src), str(dst)]) == 0
    text = capsys.readouterr().out
    assert "3 tensors" in text and "1 copies kept under their own names" in text
    assert f"bytes before {src.stat().st_size}" in text
    assert f"after {dst.stat().st_size}" in text
    assert "--dedupe-copies would save" in text
    kept = dst.stat().st_size
    assert main(["convert", str(src), str(dst), "--dedupe-copies"]) == 0
    text = capsys.readouterr().out
    assert "1 copies stored once" in text and f"after {dst.stat().st_size}" in text
    assert dst.stat().st_size < kept and weightvault.inspect(dst).copies


def test_cli_rules_file_and_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = sources(tmp_path)["mxnet"]
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([["l2.*", None], ["l1.*", "fc.*"]]))
    dst = tmp_path / "o.safetensors"
    assert main(["convert", str(src), str(dst), "--rules", str(rules), "--dry-run"]) == 0
    assert "would write 2 tensors" in capsys.readouterr().out and not dst.exists()
    assert main(["convert", str(src), str(dst), "--rules", str(rules)]) == 0
    assert weightvault.inspect(dst).names == ["fc.weight", "fc.bias"]


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = sources(tmp_path)["mxnet"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    assert main(["convert", str(src), str(tmp_path / "o"), "--rules", str(bad)]) == 2
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "o")]) == 3
    (tmp_path / "junk").write_bytes(b"junk" * 10)
    assert main(["convert", str(tmp_path / "junk"), str(tmp_path / "o")]) == 3
    assert "weightvault convert" in capsys.readouterr().err
