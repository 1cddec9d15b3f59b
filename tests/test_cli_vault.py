"""`weightvault vault ROOT VERB`: tables, --json, exit codes, and the plot."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault.torch as wv  # noqa: E402
from weightvault._cli.app import main  # noqa: E402


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


@pytest.fixture
def vault(tmp_path: Path) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    wv.freeze(model, "0")
    opt = torch.optim.SGD(wv.trainable(model), lr=0.1)
    v = weightvault.Vault(tmp_path / "v")
    for step in range(3):
        model(torch.randn(2, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        v.save(model, metadata={"step": str(step)})
    return tmp_path / "v", model


def test_log_lists_checkpoints_with_their_cost(vault):
    root, _ = vault
    code, out = run("vault", str(root), "log")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["checkpoint", "created", "logical", "new"]
    assert [line.split()[0] for line in lines[1:4]] == ["000001", "000002", "000003"]
    assert "step=2" in lines[3] and "1.0 KiB" in lines[3]  # only the 4x64 head + bias
    assert "3 checkpoints; vault on disk" in out
    code, out = run("vault", str(root), "log", "--json")
    doc = json.loads(out)
    assert [r["new_bytes"] for r in doc][1:] == [(4 * 64 + 4) * 4] * 2


def test_show_diff_verify_export_rm_gc(vault, tmp_path):
    root, model = vault
    code, out = run("vault", str(root), "show", "latest")
    assert code == 0 and "0.weight" in out and "stored (frozen)" in out
    code, out = run("vault", str(root), "diff", "000001", "000002")
    assert code == 1 and "~ 1.weight: max abs diff" in out and "2 identical" in out
    assert run("vault", str(root), "diff", "000002", "000002")[0] == 0
    assert run("vault", str(root), "verify")[0] == 0

    target = tmp_path / "exported.safetensors"
    code, out = run("vault", str(root), "export", "latest", str(target))
    assert code == 0 and target.exists()
    fresh = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    wv.load(fresh, target)
    assert torch.equal(fresh[1].weight, model[1].weight)

    code, out = run("vault", str(root), "rm", "000001", "000002")
    assert code == 0 and "run 'gc'" in out
    code, out = run("vault", str(root), "gc", "--json")
    assert code == 0 and json.loads(out)["freed_bytes"] == 2 * (4 * 64 + 4) * 4


def test_verify_exits_1_naming_the_damage(vault):
    root, _ = vault
    objects = sorted((root / "objects").rglob("*"), key=lambda p: p.stat().st_size)
    biggest = objects[-1]
    data = bytearray(biggest.read_bytes())
    data[0] ^= 1
    biggest.write_bytes(bytes(data))
    code, out = run("vault", str(root), "verify")
    assert code == 1 and "DAMAGED" in out and "tensor '0.weight'" in out and "corrupt" in out


def test_unknown_checkpoint_and_usage(vault, capsys):
    root, _ = vault
    assert run("vault", str(root), "show", "nope")[0] == 3
    assert "no checkpoint named 'nope'; it has 000001, 000002, 000003" in capsys.readouterr().err
    assert run("vault", str(root))[0] == 2


def test_plot_writes_a_png(vault, tmp_path):
    pytest.importorskip("matplotlib")
    root, _ = vault
    png = tmp_path / "bytes.png"
    code, out = run("vault", str(root), "plot", "-o", str(png))
    assert code == 0 and str(png) in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_export_keeps_copies_for_plain_readers_unless_asked(tmp_path: Path) -> None:
    """The vault stores two equal tensors once; export writes both names as tensors by
    default (plain readers see them) and once with --dedupe-copies."""
    from safetensors import safe_open

    v = weightvault.Vault(tmp_path / "v")
    v.save({"a": torch.ones(256), "b": torch.ones(256)}, "one")
    plain, deduped = tmp_path / "plain.safetensors", tmp_path / "deduped.safetensors"
    assert run("vault", str(tmp_path / "v"), "export", "one", str(plain))[0] == 0
    code, _ = run("vault", str(tmp_path / "v"), "export", "one", str(deduped), "--dedupe-copies")
    assert code == 0
    with safe_open(str(plain), "pt") as f:
        assert sorted(f.keys()) == ["a", "b"]
    with safe_open(str(deduped), "pt") as f:
        assert sorted(f.keys()) == ["a"]
    assert plain.stat().st_size - deduped.stat().st_size >= 256 * 4
    for path in (plain, deduped):
        assert torch.equal(wv.load_file(path)["b"], torch.ones(256))


def test_a_refused_request_is_not_an_unreadable_input(vault, capsys):
    root, _ = vault
    # "latest" can never be deleted by name: the vault was read, the request is refused.
    assert run("vault", str(root), "rm", "latest")[0] == 5
    assert "latest" in capsys.readouterr().err
