"""The CLI: readable output, --json, exit codes, and help that teaches."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import weightvault  # noqa: E402
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
    assert out.startswith(f"{path}: NumPy file, read without its framework, 2 names, 1 stored")
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
        VaultBusyError,
        VaultNotFoundError,
    )
    from weightvault._cli.common import EXIT_CODES, exit_code

    cases = {
        FormatError("f"): 3,
        ChecksumError("f", []): 3,
        CheckpointNotFoundError("n"): 3,
        FileNotFoundError("f"): 3,
        VaultNotFoundError("v"): 3,
        # A name already taken was read fine: the save is refused, not unreadable.
        CheckpointExistsError("n"): 5,
        CheckpointNameError("n"): 5,
        VaultBusyError("a gc may still be running"): 5,
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


# -- every subcommand, text and --json, on files with training state and foreign files ------


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the CLI as the shell does: its exit code, standard output and standard error."""
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def file_commands(a: Path, b: Path, tmp: Path) -> list[tuple[list[str], int]]:
    """Every file subcommand on ``a`` (and ``b``), with the exit code each must give."""
    return [
        (["inspect", str(a)], 0),
        (["verify", str(a)], 0),
        (["diff", str(a), str(a)], 0),
        (["diff", str(a), str(b)], 0 if a == b else 1),
        (["convert", str(a), str(tmp / "converted.safetensors")], 0),
        (["convert", str(a), str(tmp / "dry.safetensors"), "--dry-run"], 0),
        (["convert", str(a), str(tmp / "once.safetensors"), "--dedupe-copies"], 0),
    ]


def run_every_command(capsys, a: Path, b: Path, tmp: Path) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Each command in text and in --json; the JSON documents, by command and file."""
    docs: dict[str, Any] = {}
    for argv, want in file_commands(a, b, tmp):
        code, out, _ = cli(capsys, *argv)
        assert code == want, (argv, out)
        assert out.strip(), argv
        code, out, _ = cli(capsys, *argv, "--json")
        assert code == want, (argv, out)
        docs[" ".join(argv[:2])] = json.loads(out)  # exactly one JSON document
    return docs


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Path, Path]:
    """Two steps of a tied model saved with AdamW, StepLR and RNG state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight = model[0].weight
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    paths = []
    for step in (1, 2):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        path = tmp_path / f"step{step}.safetensors"
        meta = {"step": str(step)}
        wv.save(model, path, optimizer=opt, scheduler=sched, rng=True, metadata=meta)
        paths.append(path)
    return paths[0], paths[1]


def test_every_command_on_a_file_with_optimizer_scheduler_and_rng(trained, tmp_path, capsys):
    a, b = trained
    docs = run_every_command(capsys, a, b, tmp_path)
    code, out, _ = cli(capsys, "inspect", str(a))
    assert code == 0 and out.startswith(f"{a}: weightvault v2, 4 names, 3 stored\n")
    assert "__weightvault__" not in out  # training state is no model name
    assert "saved by deduplication 256 B" in out
    assert "training state: " in out
    assert "  optimizer  AdamW for 3 parameters (" in out and "exp_avg_sq" in out
    assert "  scheduler  StepLR\n" in out
    assert "  rng        torch" in out
    doc = docs[f"inspect {a}"]
    assert doc["bytes_saved"] == 256  # the tie, not minus the optimizer state
    assert doc["training"]["optimizer"] == "AdamW" and doc["training"]["parameters"] == 3
    assert doc["training"]["scheduler"] == "StepLR"
    assert {"exp_avg", "exp_avg_sq"} <= set(doc["training"]["slots"])
    assert docs[f"diff {a}"]["changed"]  # b moved every trained tensor
    assert docs[f"verify {a}"]["ok"] is True
    code, out, _ = cli(capsys, "convert", str(a), str(tmp_path / "again.safetensors"))
    assert code == 0 and "wrote 4 tensors, 3 stored; 0 copies kept" in out
    assert "; and 10 tensors of training state\n" in out and "--dedupe-copies" not in out
    # The converted copy keeps the training state, and inspect shows it.
    code, out, _ = cli(capsys, "inspect", str(tmp_path / "converted.safetensors"))
    assert code == 0 and "  optimizer  AdamW" in out


def npz_file(path: Path) -> Path:
    np = pytest.importorskip("numpy")
    a = np.arange(6, dtype=np.float32)
    np.savez(path, a=a, b=a.copy(), c=np.ones((2, 3), np.float16))
    return path


def torch_file(path: Path) -> Path:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    torch.save(model.state_dict(), path)
    return path


def keras_file(path: Path) -> Path:
    """A real Keras ``.weights.h5`` file, written by Keras itself."""
    pytest.importorskip("h5py")
    keras = pytest.importorskip("keras")
    inp = keras.Input((4,))
    shared = keras.layers.Dense(4, name="shared")
    model = keras.Model(inp, keras.layers.Dense(2, name="head")(shared(shared(inp))))
    model.save_weights(path)
    return path


MXNET = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "mxnet"
FOREIGN: dict[str, Callable[[Path], Path]] = {
    "arrays.npz": npz_file,
    "model.pt": torch_file,
    "model.weights.h5": keras_file,
}


@pytest.mark.parametrize("name", sorted(FOREIGN))
def test_every_command_on_each_foreign_format(name, tmp_path, capsys):
    path = FOREIGN[name](tmp_path / name)
    docs = run_every_command(capsys, path, path, tmp_path)
    _, out, _ = cli(capsys, "inspect", str(path))
    assert "read without its framework" in out.splitlines()[0]
    assert docs[f"inspect {path}"]["training"] is None
    assert docs[f"verify {path}"]["ok"] is True


@pytest.mark.skipif(not MXNET.is_dir(), reason="../shared/fixtures/mxnet is absent")
def test_every_command_on_every_mxnet_fixture(tmp_path, capsys):
    fixtures = sorted(MXNET.glob("*.params"))
    assert fixtures
    for path in fixtures:
        docs = run_every_command(capsys, path, fixtures[0], tmp_path)
        _, out, _ = cli(capsys, "inspect", str(path))
        assert out.splitlines()[0].endswith("stored") and "MXNet .params file" in out
        assert docs[f"inspect {path}"]["container"] == "mxnet"


def test_convert_json_and_rules_report_what_they_renamed(tmp_path, capsys):
    """--rules lists each rename; a rule that matches nothing writes nothing and exits 5."""
    np = pytest.importorskip("numpy")
    src = tmp_path / "m.npz"
    np.savez(src, **{"l1.weight": np.ones(4, np.float32), "l1.bias": np.zeros(2, np.float32)})
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([["l1.*", "l2.*"]]))
    dst = tmp_path / "out.safetensors"
    code, out, _ = cli(capsys, "convert", str(src), str(dst), "--rules", str(rules))
    assert code == 0 and "rules renamed 2 names and dropped 0" in out
    assert "  l1.weight -> l2.weight\n" in out
    code, out, _ = cli(capsys, "convert", str(src), str(dst), "--rules", str(rules), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["renamed"] == {"l1.weight": "l2.weight", "l1.bias": "l2.bias"}
    assert sorted(doc["stored"]) == ["l2.bias", "l2.weight"] and doc["file_bytes"] > 0

    rules.write_text(json.dumps([["l1.*", "l2.*"], ["l9.*", "x.*"]]))
    dst.unlink()
    code, _, err = cli(capsys, "convert", str(src), str(dst), "--rules", str(rules))
    assert code == 5 and not dst.exists()
    assert "rule 1 ('l9.*' -> 'x.*') matches no name" in err
    # A built-in set must match something in all, not every one of its rules.
    code, _, _ = cli(capsys, "convert", str(src), str(dst), "--rules", "MXNET_PREFIXES")
    assert code == 5 and not dst.exists()
    rules.write_text("{not json")
    assert cli(capsys, "convert", str(src), str(dst), "--rules", str(rules))[0] == 2


def test_a_file_that_grows_says_so_and_names_the_flag(tmp_path, capsys):
    np = pytest.importorskip("numpy")
    src = tmp_path / "copies.npz"
    w = np.ones((64, 64), np.float32)
    np.savez(src, a=w, b=w.copy(), c=w.copy())
    code, out, _ = cli(capsys, "convert", str(src), str(tmp_path / "x.safetensors"))
    assert code == 0
    assert "--dedupe-copies would save 32768 (32.0 KiB) more" in out


def test_bad_tolerances_and_sharded_indexes_are_refused_clearly(tied, tmp_path, capsys):
    _, path = tied
    for atol in ("nan", "inf", "-1"):
        assert cli(capsys, "diff", str(path), str(path), f"--atol={atol}")[0] == 2
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {}}')
    code, out, err = cli(capsys, "inspect", str(index))
    assert code == 3 and out == "" and "name a shard" in err
    vault = tmp_path / "v"
    weightvault.Vault(vault).save({"w": torch.ones(2)})
    code, _, err = cli(capsys, "inspect", str(vault))
    assert code == 3 and f"use 'weightvault vault {vault} show'" in err
