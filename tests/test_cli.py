"""The CLI: readable output, --json, exit codes, and help that teaches."""

from __future__ import annotations

import io
import json

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import weightvault.torch as wv  # noqa: E402
from weightvault._cli.app import main  # noqa: E402


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


@pytest.fixture
def tied(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = model[0].weight
    path = tmp_path / "tied.safetensors"
    wv.save(model, path, metadata={"step": "7"})
    return model, path


def test_inspect_table_shows_groups_and_savings(tied):
    _, path = tied
    code, out = run("inspect", str(path))
    assert code == 0
    assert "alias of 0.weight" in out and "1.weight" in out
    assert "saved by deduplication 256 B" in out
    assert '"step": "7"' in out


def test_inspect_json_is_machine_readable(tied):
    _, path = tied
    code, out = run("inspect", str(path), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["aliases"] == {"1.weight": "0.weight"}
    assert doc["bytes_saved"] == 256


def test_verify_names_the_damaged_tensor(tied):
    _, path = tied
    assert run("verify", str(path))[0] == 0
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last stored tensor
    path.write_bytes(bytes(data))
    code, out = run("verify", str(path))
    assert code == 1
    assert "DAMAGED" in out and "checksum mismatch in '1.bias'" in out


def test_diff_lists_changes_with_max_abs_difference(tied, tmp_path):
    model, a = tied
    with torch.no_grad():
        model[0].bias[0] += 0.5
    b = tmp_path / "b.safetensors"
    wv.save(model, b)
    code, out = run("diff", str(a), str(b))
    assert code == 1
    assert "~ 0.bias: max abs diff 0.5" in out
    assert run("diff", str(a), str(a))[0] == 0
    assert run("diff", str(a), str(b), "--atol", "1")[0] == 0


def test_exit_codes_for_unreadable_and_usage(tmp_path, capsys):
    assert run("inspect", str(tmp_path / "missing.safetensors"))[0] == 3
    assert run("verify", str(tmp_path / "missing.safetensors"))[0] == 3
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 3)
    assert run("inspect", str(bad))[0] == 3
    assert "too short" in capsys.readouterr().err
    assert run("verify", str(bad))[0] == 1
    assert run("frobnicate")[0] == 2


def test_help_teaches_with_examples_and_exit_codes(capsys):
    assert run("--help")[0] == 0
    text = capsys.readouterr().out
    assert "exit codes:" in text and "weightvault inspect model.safetensors" in text


def test_inspect_names_a_foreign_format(tmp_path):
    np = pytest.importorskip("numpy")
    path = tmp_path / "arrays.npz"
    a = np.arange(6, dtype=np.float32)
    np.savez(path, a=a, b=a.copy())
    code, out = run("inspect", str(path))
    assert code == 0
    assert out.startswith(f"{path}: numpy file, read without its framework, 2 names, 1 stored")
    assert "copy of a" in out


def test_each_exit_code_has_one_meaning_everywhere(capsys):
    from pathlib import Path

    from weightvault import (
        BackendNotInstalled,
        CheckpointExistsError,
        CheckpointNameError,
        CheckpointNotFoundError,
        ChecksumError,
        FormatError,
        RuleError,
    )
    from weightvault._cli.common import EXIT_CODES, exit_code

    cases = {
        FormatError("f"): 3,
        ChecksumError("f", []): 3,
        CheckpointNotFoundError("n"): 3,
        FileNotFoundError("f"): 3,
        # A name already taken was read fine: the save is refused, not unreadable.
        CheckpointExistsError("n"): 5,
        CheckpointNameError("n"): 5,
        RuleError("r"): 5,
        BackendNotInstalled("pip install h5py"): 6,
        RuntimeError("bug"): 4,
    }
    assert {e: exit_code(e) for e in cases} == cases
    assert run("--help")[0] == 0
    text = capsys.readouterr().out
    docs = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    for code in EXIT_CODES:
        assert f"\n  {code:<4}" in text, code
        assert f"\n| {code} |" in docs, code
