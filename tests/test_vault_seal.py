"""Every byte of a vault that decides what a load returns is checksummed, and ``verify``
finds whatever a load refuses.

Pack indexes, intents and ``vault.json`` carry a seal as checkpoint records do (an xxh3-128
``"sum"`` closing the JSON); files written before the seals read as they did. The
property at the end damages one byte of any file of a small training vault (a torch model
with AdamW, LambdaLR and RNG state; raw, packed, compressed and delta objects) and checks
that every load is exact (weights, optimizer and scheduler state, the next random draws)
or an error, and that ``verify`` reports every damage a load refused.
"""

from __future__ import annotations

import copy
import io
import json
import os
import random
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from _records import read as read_record, rewrite as rewrite_record  # noqa: E402
from weightvault import ChecksumError, FormatError, TrainingStateError, Vault, WeightvaultError  # noqa: E402
from weightvault._cli.app import main  # noqa: E402
from weightvault._vault.records.intents import encode_intent, parse_intent  # noqa: E402
from weightvault._vault.records.reading import read_sealed  # noqa: E402
from weightvault._vault.store.backend import open_store  # noqa: E402
from weightvault._vault.store.pack import check_pack  # noqa: E402
from weightvault._vault.upkeep.verify import VaultVerifyReport, verify_vault  # noqa: E402
from weightvault._vault.writing.commit import begin  # noqa: E402

FRAME_MAGIC = b"\x89WVO\r\n\x1a\n"


# -- a small training vault ----------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 32))


def _trainer(model: nn.Module) -> tuple[Any, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9**s)


def _step(model: nn.Module, opt: Any, sched: Any) -> None:
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _build(root: Path, compression: str | None) -> list[str]:
    """Three checkpoints settled by ``compact()`` (compressed and delta objects with
    compression), a fourth left raw in its pack, and an intent a killed save left."""
    torch.manual_seed(1)
    model = _model()
    opt, sched = _trainer(model)
    vault = Vault(root, compression=compression)
    for _ in range(3):
        _step(model, opt, sched)
        vault.save(model, optimizer=opt, scheduler=sched, rng=True)
    vault.wait()
    vault.compact()
    raw = Vault(root, compression=compression, compaction=None)
    _step(model, opt, sched)
    raw.save(model, optimizer=opt, scheduler=sched, rng=True)
    digests = list(read_record(root / "checkpoints" / "000004.json")["objects"].values())
    begin(raw.store, digests[:5], gc_wait=0)  # never released: as a killed save leaves it
    return [r.name for r in raw.list()]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def vaults(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[str]]]:
    out = {}
    for compression in ("blosc2", None):
        root = tmp_path_factory.mktemp("seal") / "vault"
        out[str(compression)] = (root, _build(root, compression))
    compressed = out["blosc2"][0]
    assert any((compressed / f).read_bytes()[:8] == FRAME_MAGIC for f in _files(compressed))
    for root, _ in out.values():
        kinds = {f.split("/")[0] for f in _files(root)}
        assert {"checkpoints", "objects", "packs", "intents", "vault.json"} <= kinds
    return out


def _copy(root: Path, dest: Path) -> Path:
    shutil.copytree(root, dest)
    return dest


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` as a new file, then rename it over (never in place)."""
    tmp = path.with_name(path.name + ".damage")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _flip(path: Path, at: int, xor: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= xor
    _replace(path, bytes(data))


# -- what a load returns --------------------------------------------------------------------


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _load(root: Path, name: str, **options: Any) -> dict[str, Any] | WeightvaultError:
    """What a load of ``name`` with all its training state gives, or the error it raised
    (after checking that the model was left untouched)."""
    model = _model()
    opt, sched = _trainer(model)
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    before = _snapshot(model)
    try:
        vault = Vault(root, compaction=None)
        vault.load(model, name, optimizer=opt, scheduler=sched, rng=True, **options)
    except WeightvaultError as e:
        after = _snapshot(model)
        assert all(torch.equal(after[k], v) for k, v in before.items()), "model changed"
        return e
    return {
        "weights": _snapshot(model),
        "optimizer": copy.deepcopy(opt.state_dict()),
        "scheduler": sched.state_dict(),
        "draws": (torch.rand(4), random.random(), np.random.rand()),
    }


def _same(a: Any, b: Any) -> bool:
    """Equal, tensors bitwise (dtype, shape and bytes), containers item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and bool(a == b)


def _verify(root: Path) -> VaultVerifyReport:
    """``Vault.verify()``; where ``vault.json`` is damaged so that no Vault opens, the
    check it makes (which ``weightvault vault ROOT verify`` makes then)."""
    try:
        vault = Vault(root, compaction=None)
    except FormatError:
        return verify_vault(open_store(str(root)))
    return vault.verify()


@pytest.fixture(scope="module")
def expected(vaults: dict[str, tuple[Path, list[str]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for variant, (root, names) in vaults.items():
        out[variant] = {}
        for name in names:
            got = _load(root, name)
            assert isinstance(got, dict), got
            out[variant][name] = got
        report = _verify(root)
        assert report.ok and not report.notes, report
    return out


# -- each kind of file is sealed -------------------------------------------------------------


def test_every_metadata_file_a_save_writes_is_sealed(
    vaults: dict[str, tuple[Path, list[str]]],
) -> None:
    root, names = vaults["blosc2"]
    store = open_store(str(root))
    marker = json.loads((root / "vault.json").read_bytes())
    assert list(marker) == ["format", "version", "hash", "sum"]
    packs = [f for f in _files(root) if f.startswith("packs/")]
    assert packs and all(check_pack(store, key)[1] for key in packs)
    intents = [f for f in _files(root) if f.startswith("intents/")]
    assert intents and all(parse_intent((root / f).read_bytes(), f)[1] for f in intents)
    assert all(read_sealed(store, name)[1] for name in names)


def test_a_record_whose_lr_digit_changed_is_refused_and_reported(
    vaults: dict[str, tuple[Path, list[str]]], tmp_path: Path
) -> None:
    """The fuzz finding: one digit of the optimizer's lr, in the manifest inside the
    record, loaded silently and verify said ok."""
    root = _copy(vaults["blosc2"][0], tmp_path / "v")
    path = root / "checkpoints" / "000002.json"
    text = path.read_bytes()
    found = re.search(rb'"lr[\\"]*:(\d)', text)  # in the manifest, in the header, escaped
    assert found is not None
    at = found.start(1)
    _replace(path, text[:at] + (b"2" if text[at : at + 1] != b"2" else b"3") + text[at + 1 :])
    got = _load(root, "000002")
    assert isinstance(got, ChecksumError) and "000002" in str(got)
    report = _verify(root)
    assert not report.ok and report.problems[0].startswith("000002: record")


def _rewrite_index(pack: Path, body: bytes) -> None:
    """The pack with ``body`` as its index (and the index's length fitted)."""
    data = pack.read_bytes()
    (length,) = struct.unpack("<Q", data[-16:-8])
    start = len(data) - 16 - length
    _replace(pack, data[:start] + body + struct.pack("<Q", len(body)) + data[-8:])


def _index_body(pack: Path) -> bytes:
    data = pack.read_bytes()
    (length,) = struct.unpack("<Q", data[-16:-8])
    return data[len(data) - 16 - length : len(data) - 16]


def test_a_damaged_pack_index_is_refused_by_name_even_unverified(
    vaults: dict[str, tuple[Path, list[str]]], tmp_path: Path
) -> None:
    """An offset moved by one in a pack's index would point a ``verify=False`` load at
    other bytes: the index's own checksum refuses it first, naming the pack."""
    root = _copy(vaults["None"][0], tmp_path / "v")
    pack = next((root / "packs").iterdir())
    body = _index_body(pack)
    at = body.index(b",", body.index(b'":[')) - 1  # the first offset's last digit
    damaged = body[:at] + bytes([body[at] ^ 1]) + body[at + 1 :]
    assert json.loads(damaged) != json.loads(body)  # still JSON, still in bounds
    _rewrite_index(pack, damaged)
    for verify in (True, False):
        got = _load(root, "000004", verify=verify)
        assert isinstance(got, ChecksumError) and pack.name in str(got), got
    report = _verify(root)
    assert not report.ok and any(p.startswith(f"pack {pack.name}") for p in report.problems)


def test_a_version_1_pack_index_reads_as_before_and_a_version_change_is_refused(
    vaults: dict[str, tuple[Path, list[str]]],
    expected: dict[str, dict[str, Any]],
    tmp_path: Path,
) -> None:
    root = _copy(vaults["None"][0], tmp_path / "v")
    pack = next((root / "packs").iterdir())
    doc = json.loads(_index_body(pack))
    old = {"version": 1, "objects": doc["objects"]}  # as weightvault wrote it before seals
    _rewrite_index(pack, json.dumps(old, separators=(",", ":"), sort_keys=True).encode())
    got = _load(root, "000004")
    assert isinstance(got, dict) and _same(got, expected["None"]["000004"])
    report = _verify(root)
    assert report.ok and report.notes == [
        f"1 pack indexes carry no checksum (written before "
        f"they were sealed; read as before): {pack.name}"
    ]
    # A sealed index whose version byte turned to 1 still holds its sum: refused.
    sealed = _copy(vaults["None"][0], tmp_path / "w")
    pack = next((sealed / "packs").iterdir())
    body = _index_body(pack)
    _rewrite_index(pack, body.replace(b'"version":2', b'"version":1'))
    assert isinstance(_load(sealed, "000004"), ChecksumError)
    assert not _verify(sealed).ok


def test_a_damaged_intent_stops_gc_and_verify_reports_it(
    vaults: dict[str, tuple[Path, list[str]]], tmp_path: Path
) -> None:
    root = _copy(vaults["blosc2"][0], tmp_path / "v")
    intent = next((root / "intents").iterdir())
    named = json.loads(intent.read_bytes())["objects"]
    text = intent.read_bytes()
    _replace(intent, text.replace(named[0][:8].encode(), named[0][:7].encode() + b"x", 1))
    before = _files(root)
    vault = Vault(root, compaction=None)
    for name in ("000001", "000002", "000003"):
        vault.delete(name)
    with pytest.raises(ChecksumError, match=intent.name):
        vault.gc()  # it cannot tell which objects that save relies on: deletes nothing
    # gc compacted first (which may rewrite objects and take packs apart), freed nothing.
    assert {f for f in before if f.startswith("objects")} <= set(_files(root))
    report = vault.verify()
    assert not report.ok and report.problems[0].startswith(f"intent {intent.name}: ")


def test_an_intent_written_before_seals_is_read_and_noted(tmp_path: Path) -> None:
    """An intent without a version is one from before seals: gc keeps what it names."""
    vault = Vault(tmp_path, compaction=None)
    vault.save({"w": np.arange(8, dtype=np.float32)})
    digest = read_record(tmp_path / "checkpoints" / "000001.json")["objects"]["w"]
    legacy = tmp_path / "intents" / "legacy.json"
    legacy.parent.mkdir(exist_ok=True)
    legacy.write_text(json.dumps({"created": 1e12, "objects": [digest]}))
    vault.delete("000001")
    vault.gc()
    assert any(p.name == digest for p in (tmp_path / "objects").rglob("*"))
    assert parse_intent(legacy.read_bytes(), "legacy") == ([digest], False)
    report = vault.verify()
    assert report.ok and "intents carry no checksum" in report.notes[0]
    # One changed byte of a sealed intent's version name: a sum without a version.
    sealed = encode_intent([digest], 1.0)
    for damaged in (sealed.replace(b'"version"', b'"versiom"'), sealed.replace(b":2,", b":1,")):
        with pytest.raises(FormatError):
            parse_intent(damaged, "x")


def test_vault_json_is_sealed_and_its_damage_reported(
    vaults: dict[str, tuple[Path, list[str]]], tmp_path: Path
) -> None:
    root = _copy(vaults["blosc2"][0], tmp_path / "v")
    marker = root / "vault.json"
    text = marker.read_bytes()
    for damaged in (text.replace(b"blake3", b"blake4"), text.replace(b'"sum"', b'"sux"')):
        _replace(marker, damaged)
        with pytest.raises(ChecksumError, match=r"vault\.json"):
            Vault(root)
        out = io.StringIO()
        code = main(["vault", str(root), "verify"], out)
        assert code == 1 and "DAMAGED" in out.getvalue() and "  vault.json: " in out.getvalue()
        assert "4 checkpoints" not in out.getvalue()
    # A marker written before seals opens as before, and a settled vault says so.
    _replace(
        marker, json.dumps({"format": "weightvault-vault", "version": 2, "hash": "blake3"}).encode()
    )
    assert [r.name for r in Vault(root).list()] == ["000001", "000002", "000003", "000004"]
    out = io.StringIO()
    assert main(["vault", str(root), "verify"], out) == 0
    assert "OK, 4 checkpoints" in out.getvalue()


def _manifest_edit(path: Path, edit: Any) -> None:
    """Rewrite record ``path`` as a version 1 record (no checksum, as before seals), with
    ``edit`` applied to the manifest inside its header."""
    doc = read_record(path)
    header = json.loads(doc["header"])
    manifest = json.loads(header["__metadata__"]["weightvault"])
    edit(manifest)
    header["__metadata__"]["weightvault"] = json.dumps(manifest, separators=(",", ":"))
    doc["header"] = json.dumps(header, separators=(",", ":"))
    doc["version"] = 1
    path.write_text(json.dumps(doc, separators=(",", ":")))


def test_verify_makes_the_checks_a_load_makes_of_an_unsealed_record(
    vaults: dict[str, tuple[Path, list[str]]],
    expected: dict[str, dict[str, Any]],
    tmp_path: Path,
) -> None:
    """A record from before seals is read unchecked; what a load refuses in it (its
    training state, a tensor's checksum) verify reports."""
    base = vaults["blosc2"][0]
    root = _copy(base, tmp_path / "a")
    _manifest_edit(root / "checkpoints" / "000002.json", lambda m: None)
    assert _same(_load(root, "000002"), expected["blosc2"]["000002"])
    report = _verify(root)
    assert report.ok and report.notes[0].startswith("1 records carry no checksum")

    def lose_hyper(m: dict[str, Any]) -> None:
        group = m["training"]["optimizer"]["groups"][0]
        group["hyperz"] = group.pop("hyper")

    def bad_sum(m: dict[str, Any]) -> None:
        name = sorted(m["sums"])[0]
        m["sums"][name] = ("0" if m["sums"][name][0] != "0" else "1") + m["sums"][name][1:]

    def bad_rng(m: dict[str, Any]) -> None:
        m["training"]["rng"]["python"] = [3, [1, 2], None]

    cases = [
        (lose_hyper, TrainingStateError),
        (bad_sum, ChecksumError),
        (bad_rng, TrainingStateError),
    ]
    for i, (edit, error) in enumerate(cases):
        root = _copy(base, tmp_path / f"c{i}")
        _manifest_edit(root / "checkpoints" / "000002.json", edit)
        assert isinstance(_load(root, "000002"), error)
        report = _verify(root)
        assert not report.ok and all(p.startswith("000002: ") for p in report.problems), report


def test_a_damaged_block_sum_that_a_load_refuses_is_reported(tmp_path: Path) -> None:
    """A load reads a whole frame against its block sums without decoding it: a sum
    changed, its blocks intact, is refused by the load, so verify reports it too. In a
    version 3 frame the block table is under the frame's seal: the load refuses it when
    it parses the frame (a FormatError naming the tensor), before reading a block."""
    model = _model()
    with torch.no_grad():  # bf16's precision: whole fp32 weights that compress to frames
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    opt, sched = _trainer(model)
    root = tmp_path / "v"
    with Vault(root) as vault:
        vault.save(model, optimizer=opt, scheduler=sched, rng=True)
        vault.compact()
    record = read_record(root / "checkpoints" / "000001.json")
    weights = {d for t, d in record["objects"].items() if "train/" not in t}
    frames = (p for p in (root / "objects").rglob("*") if p.is_file() and p.name in weights)
    whole = [p for p in frames if p.read_bytes()[:8] == FRAME_MAGIC and p.read_bytes()[11] == 0]
    assert whole  # a compressed whole weight: a load checks it by its block sums
    _flip(whole[0], 64 + 8, 0x01)  # the first block's sum: after its compressed length
    error = _load(root, "000001")
    assert isinstance(error, FormatError) and "does not match its seal" in str(error), error
    report = _verify(root)
    assert not report.ok and any("does not match its seal" in p for p in report.problems)


def test_a_dcp_record_is_covered_by_its_seal_and_its_values_checked(tmp_path: Path) -> None:
    """A DCP record holds its chunk layout inline, and its chunk tables are objects named
    by their hash: the record's seal covers the rest. In a record from before seals,
    values that a DCP load could not decode are reported."""
    import weightvault.dcp as wdcp

    model = _model()
    opt, sched = _trainer(model)
    _step(model, opt, sched)
    rec = wdcp.save(model, tmp_path, optimizer=opt)
    path = tmp_path / "checkpoints" / f"{rec.name}.json"
    assert read_sealed(open_store(str(tmp_path)), rec.name)[1]
    assert _verify(tmp_path).ok
    doc = read_record(path)
    doc["version"] = 1
    key = sorted(doc["dcp"]["values"])[0]
    doc["dcp"]["values"][key] = {"$nonsense": 1}
    path.write_text(json.dumps(doc))
    report = _verify(tmp_path)
    assert not report.ok and report.problems[0].startswith(f"{rec.name}: record unusable")
    rewrite_record(path, {**doc, "version": 2})  # sealed: the same values, still reported
    assert not _verify(tmp_path).ok


# -- the property: one damaged byte anywhere --------------------------------------------------


def _kinds(root: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in _files(root):
        out.setdefault(f.split("/")[0], []).append(f)
    return out


def _position(size: int, region: str, n: int) -> int:
    if region == "start":
        return min(n % 256, size - 1)
    if region == "end":
        return size - 1 - n % min(size, 4096)
    return n % size


_counter: Iterator[int] = iter(range(10**9))


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_one_damaged_byte_anywhere_loads_exactly_or_fails_and_verify_reports_it(
    vaults: dict[str, tuple[Path, list[str]]],
    expected: dict[str, dict[str, Any]],
    tmp_path: Path,
    data: st.DataObject,
) -> None:
    variant = data.draw(st.sampled_from(sorted(vaults)), label="variant")
    source, names = vaults[variant]
    kinds = _kinds(source)
    kind = data.draw(st.sampled_from(sorted(kinds)), label="kind")
    name = data.draw(st.sampled_from(kinds[kind]), label="file")
    size = (source / name).stat().st_size
    if size == 0:
        return  # nothing to damage (compact/lock, a to-do marker)
    region = data.draw(st.sampled_from(["any", "start", "end"]), label="region")
    at = _position(size, region, data.draw(st.integers(0, 2**31), label="offset"))
    xor = data.draw(st.integers(1, 255), label="xor")
    root = _copy(source, tmp_path / f"case{next(_counter)}")
    _flip(root / name, at, xor)

    refused = []
    for checkpoint in names:
        got = _load(root, checkpoint)
        if isinstance(got, WeightvaultError):
            refused.append(checkpoint)
        else:
            assert _same(got, expected[variant][checkpoint]), (name, at, xor, checkpoint)
    report = _verify(root)
    if refused:
        assert not report.ok, (name, at, xor, refused)
    shutil.rmtree(root)
