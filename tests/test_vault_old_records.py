"""Records written before records were sealed (version 1, no checksum) keep loading, and
every rewrite of one (a retention that drops training state, a mark) seals it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from _records import read as read_record  # noqa: E402
from weightvault import ChecksumError, TrainingStateError, Vault  # noqa: E402
from weightvault._vault.records.reading import read_sealed  # noqa: E402

FRAME_MAGIC = b"\x89WVO\r\n\x1a\n"  # what a compressed or delta object starts with

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


def _frames(root: Path, doc: dict[str, object]) -> set[str]:
    """The stored names of ``doc`` whose object is a frame (compressed or a delta)."""
    objects = doc["objects"]
    assert isinstance(objects, dict)
    out = set()
    for stored, digest in objects.items():
        path = root / "objects" / digest[:2] / digest
        if path.is_file() and path.read_bytes()[:8] == FRAME_MAGIC:
            out.add(stored)
    return out


@pytest.mark.parametrize("verify", [False, True])
def test_an_old_records_damaged_tensor_sum_changes_nothing_or_is_refused_untouched(
    tmp_path: Path, verify: bool
) -> None:
    """A record without a seal can carry a damaged checksum of a tensor, raw or a frame; the
    load then refuses it before assigning anything, or loads the object's exact bytes."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    root = tmp_path / "v"
    vault = Vault(root, compression="blosc2")
    saved = []
    for _ in range(3):
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        vault.save(model)
        saved.append({k: v.clone() for k, v in model.state_dict().items()})
    vault.wait()
    vault.compact()
    names = [r.name for r in vault.list()]
    checked = 0
    for name, weights in zip(names, saved, strict=True):
        path = root / "checkpoints" / f"{name}.json"
        doc = read_record(path)
        doc["version"] = 1
        doc.pop("labels", None)
        frames = _frames(root, doc)
        for stored in sorted(doc["objects"]):
            header = json.loads(doc["header"])
            manifest = json.loads(header["__metadata__"]["weightvault"])
            digit = manifest["sums"][stored][0]
            manifest["sums"][stored] = ("0" if digit != "0" else "1") + manifest["sums"][stored][1:]
            header["__metadata__"]["weightvault"] = json.dumps(manifest, separators=(",", ":"))
            damaged = dict(doc, header=json.dumps(header, separators=(",", ":")))
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(damaged))
            tmp.replace(path)
            assert not read_sealed(vault.store, name)[1]
            target = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
            before = {k: v.clone() for k, v in target.state_dict().items()}
            try:
                Vault(root).load(target, name, verify=verify)
            except ChecksumError as e:
                assert stored in str(e)
                after = target.state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before), name
            else:
                after = target.state_dict()
                assert all(torch.equal(weights[k], after[k]) for k in weights), name
            checked += stored in frames
    assert checked >= 4  # the older checkpoints' objects are frames
