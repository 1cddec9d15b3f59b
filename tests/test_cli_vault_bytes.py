"""`weightvault vault ROOT log` and `plot`: each checkpoint's raw bytes against what its
save wrote on disk, checked against the files themselves.

The oracles are the vault's own files (the sizes of its objects on disk), and a
checkpoint exported as plain safetensors, read by the safetensors library.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import weightvault  # noqa: E402
from weightvault._base.progress import human  # noqa: E402
from weightvault._cli.app import main  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def dated(text: str) -> str:
    """``text`` with its dates masked: the fixture's show in the local time zone."""
    return re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "DATE", text)


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def log_json(root: Path) -> dict[str, Any]:
    code, out = run("vault", str(root), "log", "--json")
    assert code == 0, out
    doc: dict[str, Any] = json.loads(out)
    return doc


def file_bytes(folder: Path) -> int:
    """What the files under ``folder`` take, walked with ``os`` (not through the vault)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def data_section(path: Path) -> int:
    """The tensor bytes of a safetensors file: its size less the header, as the format
    lays it out (8-byte length, JSON header, data)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - n


def train(vault: weightvault.Vault, steps: int = 3) -> None:
    """A half-frozen model trained with AdamW, saved with its training state each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(1, steps + 1):
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
        vault.save(model, optimizer=opt, rng=True, metadata={"step": str(step)})
    vault.compact()  # settled: what log reports as on disk is what the files hold


def rows(out: str) -> dict[str, list[str]]:
    """``log``'s table rows by checkpoint: the cells after the date, split on 2+ spaces."""
    found = {}
    for line in out.splitlines()[1:]:
        if not line or not line[0].isalnum() or " " not in line:
            break
        cells = re.split(r"\s{2,}", line.strip())
        found[cells[0]] = cells[2:]
    return found


def test_log_shows_raw_and_on_disk_bytes_as_the_files_hold_them(tmp_path: Path) -> None:
    root = tmp_path / "v"
    train(weightvault.Vault(root))
    doc = log_json(root)
    ckpts = doc["checkpoints"]
    # What each checkpoint's new objects take is what the object files hold.
    assert sum(c["disk_bytes"] for c in ckpts) == file_bytes(root / "objects")
    assert all(c["compacted"] for c in ckpts)
    # The saves wrote raw bytes; the compactor shrank them.
    assert [c["written_bytes"] for c in ckpts] == [c["new_bytes"] for c in ckpts]
    assert doc["total"]["object_bytes"] == file_bytes(root / "objects")
    assert doc["total"]["disk_bytes"] == file_bytes(root)
    assert doc["total"]["ratio"] == round(file_bytes(root) / doc["total"]["raw_bytes"], 4)
    for c in ckpts:
        assert c["written_bytes_recorded"] is True
        # Raw: the checkpoint's distinct tensor bytes, as a deduplicated file holds them.
        exported = tmp_path / f"{c['name']}.safetensors"
        argv = ["vault", str(root), "export", c["name"], str(exported), "--dedupe-copies"]
        assert run(*argv)[0] == 0
        assert c["raw_bytes"] == c["stored_bytes"] == data_section(exported)
        assert c["ratio"] == round(c["disk_bytes"] / c["raw_bytes"], 4)
    # The first save writes everything; later ones only what training changed.
    assert ckpts[0]["new_bytes"] == ckpts[0]["raw_bytes"]
    assert all(c["disk_bytes"] < ckpts[0]["disk_bytes"] for c in ckpts[1:])

    code, out = run("vault", str(root), "log")
    assert code == 0
    table = rows(out)
    for c in ckpts:
        raw, new, disk, ratio = table[c["name"]][:4]
        assert (raw, new, disk) == (
            human(c["raw_bytes"]),
            human(c["new_bytes"]),
            human(c["disk_bytes"]),
        )
        assert ratio == f"{c['ratio']:.2f}x"
    assert "*" not in out  # every figure comes from the records
    last = ckpts[-1]
    code, shown = run("vault", str(root), "show", "latest")
    assert code == 0 and shown.splitlines()[0].endswith(
        f"new bytes {human(last['new_bytes'])} ({human(last['disk_bytes'])} on disk)"
    )
    total = doc["total"]
    assert out.endswith(
        f"\n3 checkpoints, {human(total['raw_bytes'])} raw; the vault takes "
        f"{human(total['disk_bytes'])} on disk ({total['ratio']:.2f}x of raw"
        + (f", {1 / total['ratio']:.1f}x smaller)" if total["ratio"] < 1 else ")")
        + f": {human(total['object_bytes'])} of objects, "
        f"{human(total['disk_bytes'] - total['object_bytes'])} of records\n"
    )


def test_without_compression_on_disk_equals_new(tmp_path: Path) -> None:
    root = tmp_path / "v"
    train(weightvault.Vault(root, compression=None))
    ckpts = log_json(root)["checkpoints"]
    assert [c["written_bytes"] for c in ckpts] == [c["new_bytes"] for c in ckpts]
    assert sum(c["new_bytes"] for c in ckpts) == file_bytes(root / "objects")


def test_compressible_weights_show_a_ratio_below_raw(tmp_path: Path) -> None:
    """Weights that compress well (bf16 with a narrow range) cost less than their raw bytes."""
    root = tmp_path / "v"
    w = (torch.arange(1 << 16, dtype=torch.float32) % 7).to(torch.bfloat16)
    with weightvault.Vault(root) as vault:
        vault.save({"w": w})
        vault.compact()  # the newest compressed too (the background compactor leaves it raw)
    (c,) = log_json(root)["checkpoints"]
    assert c["raw_bytes"] == w.numel() * 2
    assert c["disk_bytes"] == file_bytes(root / "objects") < c["raw_bytes"] / 4
    assert c["ratio"] < 0.25


def test_a_legacy_vault_shows_derived_sizes_marked(tmp_path: Path) -> None:
    """Records from before compression hold no written_bytes: their objects were raw, so
    on disk is new_bytes, marked as derived, and the object files agree."""
    root = tmp_path / "legacy"
    shutil.copytree(FIXTURES / "legacy_vault", root)
    doc = log_json(root)
    ckpts = {c["name"]: c for c in doc["checkpoints"]}
    assert set(ckpts) == {"step-1", "step-2", "dcp"}
    for c in ckpts.values():
        raw_doc = json.loads((root / "checkpoints" / f"{c['name']}.json").read_text())
        assert "written_bytes" not in raw_doc  # what makes it derived
        assert c["written_bytes_recorded"] is False
        assert c["written_bytes"] == c["new_bytes"] == raw_doc["new_bytes"]
    assert sum(c["new_bytes"] for c in ckpts.values()) == file_bytes(root / "objects")
    code, out = run("vault", str(root), "log")
    assert code == 0
    table = rows(out)
    assert table["step-1"][:4] == ["500 B", "500 B", "500 B*", "1.00x"]
    assert table["dcp"][2] == "0 B*"
    assert re.search(r"^\* not in the record: these objects were written raw", out, re.M)
    code, shown = run("vault", str(root), "show", "step-2")
    assert code == 0 and ", new bytes 484 B (484 B on disk)\n" in shown
    # docs/cli.md shows this very output (dates aside).
    shown = DOC.read_text().split("$ weightvault vault tests/fixtures/legacy_vault log\n")[1]
    assert dated(shown.split("```")[0]) == dated(out)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_record_shows_its_raw_chunks(tmp_path: Path) -> None:
    """DCP records hold no written_bytes; their chunks are written raw, so the object
    files hold exactly their new bytes. A Vault.save in the same vault is recorded."""
    dcp = pytest.importorskip("weightvault.dcp")
    root = tmp_path / "v"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    dcp.save(model, root, metadata={"step": "1"})
    before = file_bytes(root / "objects")
    with torch.no_grad():
        model[1].weight.add_(1.0)
    weightvault.Vault(root).save(model, metadata={"step": "2"})
    dcp_rec, saved = log_json(root)["checkpoints"]
    assert dcp_rec["written_bytes_recorded"] is False and saved["written_bytes_recorded"]
    assert dcp_rec["written_bytes"] == dcp_rec["new_bytes"] == before
    assert dcp_rec["raw_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    code, out = run("vault", str(root), "log")
    assert code == 0
    table = rows(out)
    assert table["000001"][2].endswith("*") and not table["000002"][2].endswith("*")


def test_weights_only_checkpoints_have_no_ratio(tmp_path: Path) -> None:
    """After the training state of older checkpoints is dropped, their raw bytes count
    the weights only while their saves wrote the training state too: no ratio."""
    root = tmp_path / "v"
    train(weightvault.Vault(root, training_state_last=1))
    ckpts = log_json(root)["checkpoints"]
    assert [c["weights_only"] for c in ckpts] == [True, True, False]
    assert [c["ratio"] is None for c in ckpts] == [True, True, False]
    code, out = run("vault", str(root), "log")
    assert code == 0
    table = rows(out)
    assert [table[c["name"]][3] for c in ckpts][:2] == ["-", "-"]
    assert re.search(r"^- weights only: its training state was dropped", out, re.M)


def test_plot_draws_what_log_reports(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    root = tmp_path / "v"
    train(weightvault.Vault(root))
    ckpts = log_json(root)["checkpoints"]
    png = tmp_path / "p.png"
    code, out = run("vault", str(root), "plot", "-o", str(png), "--json")
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(out)
    points = doc["points"]
    assert [p["raw_bytes"] for p in points] == [c["raw_bytes"] for c in ckpts]
    assert [p["written_bytes"] for p in points] == [c["disk_bytes"] for c in ckpts]
    running = 0
    for p, c in zip(points, ckpts, strict=True):
        running += c["disk_bytes"]
        assert p["disk_bytes"] == running
    assert doc["disk_bytes"] == file_bytes(root / "objects")
    assert doc["ratio"] == round(doc["files_bytes"] / doc["disk_bytes"], 2) > 1
    code, out = run("vault", str(root), "plot", "-o", str(png))
    assert f"{human(doc['disk_bytes'])} written on disk ({doc['ratio']:.1f}x smaller)" in out


def test_plot_of_the_legacy_vault(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    root = tmp_path / "legacy"
    shutil.copytree(FIXTURES / "legacy_vault", root)
    code, out = run("vault", str(root), "plot", "-o", str(tmp_path / "p.png"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["disk_bytes"] == doc["vault_bytes"] == file_bytes(root / "objects")
    assert os.path.getsize(tmp_path / "p.png") > 0
