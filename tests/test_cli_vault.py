"""`weightvault vault ROOT VERB`: tables, --json, exit codes, and the plot."""

from __future__ import annotations

import io
import json
import re
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
    v.wait()  # compacted: a test's damage lands on the objects as they stay
    return tmp_path / "v", model


def test_log_lists_checkpoints_with_their_cost(vault):
    root, _ = vault
    code, out = run("vault", str(root), "log")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["checkpoint", "created", "raw", "new", "on", "disk", "disk/raw",
                                "metadata"]  # fmt: skip
    assert [line.split()[0] for line in lines[1:4]] == ["000001", "000002", "000003"]
    assert "step=2" in lines[3] and "1.0 KiB" in lines[3]  # only the 4x64 head + bias
    # 17.3 KiB of distinct tensors per checkpoint; the total is the vault's disk bytes.
    m = re.search(r"^3 checkpoints, 51.8 KiB raw; the vault takes ([\d.]+) KiB on disk", out, re.M)
    assert m, out
    code, out = run("vault", str(root), "log", "--json")
    doc = json.loads(out)
    assert [r["new_bytes"] for r in doc["checkpoints"]][1:] == [(4 * 64 + 4) * 4] * 2
    assert doc["total"]["raw_bytes"] == 3 * (64 * 64 + 64 + 4 * 64 + 4) * 4


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
    assert code == 0 and "'gc' frees the bytes" in out
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


# -- every verb, text and --json, on vaults with training state and on DCP records --------


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run the CLI as the shell does: its exit code, standard output and standard error."""
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def verbs(root: Path, tmp: Path) -> list[tuple[list[str], int]]:
    """Every vault verb, the last two deleting; with the exit code each must give."""
    out = [
        (["log"], 0),
        (["show", "latest"], 0),
        (["show", "000001"], 0),
        (["diff", "000001", "000002"], 1),
        (["diff", "000002", "000002"], 0),
        (["verify"], 0),
        (["export", "latest", str(tmp / "exported.safetensors")], 0),
        (["export", "latest", str(tmp / "small.safetensors"), "--dedupe-copies"], 0),
        (["gc"], 0),
    ]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        out.append((["plot", "-o", str(tmp / "bytes.png")], 0))
    return [(["vault", str(root), *argv], want) for argv, want in out]


def run_every_verb(capsys, root: Path, tmp: Path) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Each verb in text and in --json, then rm; the JSON documents, by verb."""
    docs: dict[str, Any] = {}
    for argv, want in verbs(root, tmp):
        code, out, err = cli(capsys, *argv)
        assert code == want, (argv, out, err)
        assert out.strip(), argv
        code, out, err = cli(capsys, *argv, "--json")
        assert code == want, (argv, out, err)
        docs[" ".join(argv[2:4])] = json.loads(out)  # exactly one JSON document
    code, out, _ = cli(capsys, "vault", str(root), "rm", "000001", "--json")
    assert code == 0 and json.loads(out) == {"deleted": ["000001"]}
    return docs


@pytest.fixture
def training_vault(tmp_path: Path) -> Path:
    """Three checkpoints of a half-frozen model with SGD momentum, StepLR and RNG state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    wv.freeze(model, "0")
    opt = torch.optim.SGD(wv.trainable(model), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    v = weightvault.Vault(tmp_path / "v")
    for step in (10, 20, 30):
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        meta = {"step": str(step)}
        v.save(model, optimizer=opt, scheduler=sched, rng=True, metadata=meta)
    return tmp_path / "v"


def test_every_verb_on_a_vault_with_optimizer_scheduler_and_rng(training_vault, tmp_path, capsys):
    root = training_vault
    code, out, _ = cli(capsys, "vault", str(root), "show", "latest")
    assert code == 0 and "__weightvault__" not in out
    assert "  optimizer  SGD for 2 parameters (momentum_buffer)\n" in out
    assert "  scheduler  StepLR\n" in out and "stored (frozen)" in out
    docs = run_every_verb(capsys, root, tmp_path)
    show = docs["show latest"]
    assert show["record"]["name"] == "000003" and show["training"]["optimizer"] == "SGD"
    assert show["bytes_saved"] == 0 and show["names"] == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
    ]
    assert [r["metadata"]["step"] for r in docs["log"]["checkpoints"]] == ["10", "20", "30"]
    assert docs["verify"]["ok"] is True
    assert docs["export latest"]["bytes"] == (tmp_path / "exported.safetensors").stat().st_size
    # The exported file keeps the training state; inspect shows it.
    code, out, _ = cli(capsys, "inspect", str(tmp_path / "exported.safetensors"))
    assert code == 0 and "  optimizer  SGD" in out
    if "plot -o" in docs:
        plot = docs["plot -o"]
        assert plot["x"] == "step" and [p["step"] for p in plot["points"]] == [10, 20, 30]
        assert plot["ratio"] > 1 and plot["files_bytes"] > plot["vault_bytes"]


@pytest.fixture(scope="module")
def dcp_vault(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two checkpoints of a tiny tied GPT-2 with AdamW state, by weightvault.dcp in one process."""
    pytest.importorskip("torch.distributed.checkpoint")
    import _dcp_workers as W
    import weightvault.dcp as wdcp

    root = tmp_path_factory.mktemp("dcp") / "v"
    model = W.gpt2(1)
    opt = W.optimizer(model)
    for step in (1, 2):
        W.train_step(model, opt, step)
        wdcp.save(model, root, optimizer=opt, metadata={"step": str(step)})
    return root


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_every_verb_on_a_dcp_record(dcp_vault, tmp_path, capsys):
    root = tmp_path / "v"
    import shutil

    shutil.copytree(dcp_vault, root)
    code, out, _ = cli(capsys, "vault", str(root), "show", "latest")
    assert code == 0 and "alias of transformer.wte.weight" in out
    assert "  optimizer  DCP for " in out and "exp_avg_sq" in out
    docs = run_every_verb(capsys, root, tmp_path)
    assert docs["show latest"]["training"]["optimizer"] == "DCP"
    assert docs["diff 000001"]["changed"]


READ_ONLY = [
    ["log"],
    ["show", "latest"],
    ["diff", "000001", "000002"],
    ["verify"],
    ["export", "latest", "out.safetensors"],
    ["plot", "-o", "out.png"],
    ["gc"],
    ["rm", "000001"],
]


@pytest.mark.parametrize("argv", READ_ONLY, ids=lambda a: a[0])
def test_no_verb_creates_a_vault_where_there_is_none(argv, tmp_path, capsys, monkeypatch):
    """A mistyped path exits 3, naming it, and creates nothing, not even the folder."""
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "no" / "such" / "dir"
    code, out, err = cli(capsys, "vault", str(missing), *argv)
    assert code == 3 and out == ""
    assert err == (
        f"weightvault vault {argv[0]}: {missing}: no vault here (no vault.json); check the "
        "path, or create a vault by saving into it: weightvault.Vault(path).save(model)\n"
    )
    assert not (tmp_path / "no").exists() and sorted(tmp_path.iterdir()) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(capsys, "vault", str(empty), *argv)[0] == 3
    assert list(empty.iterdir()) == []
    assert cli(capsys, "vault", "file://" + str(empty), *argv)[0] == 3
    assert list(empty.iterdir()) == []


def test_plot_uses_checkpoint_names_without_steps(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    v = weightvault.Vault(tmp_path / "v")
    v.save({"w": torch.ones(64)}, "warmup")
    v.save({"w": torch.ones(64), "b": torch.zeros(4)}, "final")
    code, out, _ = cli(
        capsys, "vault", str(tmp_path / "v"), "plot", "-o", str(tmp_path / "p.png"), "--json"
    )
    doc = json.loads(out)
    assert code == 0 and doc["x"] == "checkpoint"
    assert [p["name"] for p in doc["points"]] == ["warmup", "final"]
    assert [p["step"] for p in doc["points"]] == [None, None]
    assert doc["files_bytes"] == 64 * 4 * 2 + 16 and doc["vault_bytes"] == 64 * 4 + 16
    assert [p["raw_bytes"] for p in doc["points"]] == [64 * 4, 64 * 4 + 16]


def test_an_empty_vault_and_a_missing_matplotlib(tmp_path, capsys, monkeypatch):
    root = tmp_path / "v"
    v = weightvault.Vault(root)
    v.save({"w": torch.ones(2)})
    v.delete("000001")
    code, out, _ = cli(capsys, "vault", str(root), "log")
    assert code == 0 and out == f"{root}: no checkpoints yet\n"
    doc = json.loads(cli(capsys, "vault", str(root), "log", "--json")[1])
    assert doc["checkpoints"] == [] and doc["total"]["raw_bytes"] == 0
    assert doc["total"]["ratio"] is None
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    code, out, err = cli(capsys, "vault", str(root), "plot", "-o", str(tmp_path / "p.png"))
    assert code == 6 and "pip install 'weightvault[plot]'" in err
