"""Records written before records were sealed (version 1, no checksum) keep loading, and
every rewrite of one (a retention that drops training state, a mark) seals it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from weightvault import ChecksumError, TrainingStateError, Vault  # noqa: E402
from weightvault._vault.records.record import read_sealed  # noqa: E402

FIXTURE = Path(__file__).with_name("fixtures") / "legacy_vault"
EXPECTED = json.loads(FIXTURE.with_name("legacy_vault.expected.json").read_text())


def _model() -> nn.Module:
    m = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 4), nn.Linear(4, 6, bias=False))
    m[2].weight = m[0].weight
    m[1].bias.requires_grad_(False)
    return m


def _weights(m: nn.Module) -> dict[str, str]:
    return {f"model/{k}": v.numpy().tobytes().hex() for k, v in m.state_dict().items()}


def _vault(tmp_path: Path) -> Vault:
    root = tmp_path / "legacy"
    shutil.copytree(FIXTURE, root)
    return Vault(root)


def _expected(name: str) -> dict[str, str]:
    return {k: v for k, v in EXPECTED[name].items() if k.startswith("model/")}


def test_the_old_records_carry_no_sum_and_load_bitwise(tmp_path: Path) -> None:
    vault = _vault(tmp_path)
    for name in ("step-1", "step-2"):
        doc, sealed = read_sealed(vault.store, name)
        assert doc["version"] == 1 and not sealed
        model = _model()
        vault.load(model, name)
        assert _weights(model) == _expected(name)


def test_dropping_an_old_records_training_state_seals_it(tmp_path: Path) -> None:
    vault = _vault(tmp_path)
    vault.retain(training_state_last=1)
    doc, sealed = read_sealed(vault.store, "step-1")
    assert sealed and doc["version"] == 2
    model = _model()
    vault.load(model, "step-1")  # the weights are as they were
    assert _weights(model) == _expected("step-1")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(TrainingStateError, match="step-1"):
        vault.load(_model(), "step-1", optimizer=opt)


def test_marking_an_old_record_seals_it_and_a_changed_byte_is_then_refused(
    tmp_path: Path,
) -> None:
    vault = _vault(tmp_path)
    vault.mark("step-2", "best")
    doc, sealed = read_sealed(vault.store, "step-2")
    assert sealed and doc["version"] == 2
    model = _model()
    vault.load(model, "best")
    assert _weights(model) == _expected("step-2")
    path = tmp_path / "legacy" / "checkpoints" / "step-2.json"
    raw = path.read_bytes()
    at = raw.index(b'"created":') + len(b'"created":') + 1
    damaged = raw[:at] + (b"1" if raw[at : at + 1] != b"1" else b"2") + raw[at + 1 :]
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(damaged)
    tmp.replace(path)
    with pytest.raises(ChecksumError, match="step-2"):
        vault.load(_model(), "step-2")
