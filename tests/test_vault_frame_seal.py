"""Version 3 frames: a seal over the header and block table, and the sum of a delta's base.

A damaged byte anywhere before a frame's blocks is a FormatError naming the tensor before
anything is decoded into the model. A delta on a raw anchor (trained fp32 weights) is
checked by reading the anchor once against the sum its frame records, then decoded once,
straight into the tensor; a damaged anchor is a ChecksumError that leaves the model as
it was. Version 2 frames, which carry neither, still load bitwise.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import weightvault._vault.objects.frame as frame_module  # noqa: E402
from _frames import reseal_frame  # noqa: E402
from weightvault import ChecksumError, FormatError, Vault  # noqa: E402
from weightvault._vault.objects.frame import (  # noqa: E402
    HEADER_SIZE,
    SEAL_SIZE,
    parse_frame,
)

#: Floats per weight: 5 MiB, two blocks of a frame.
N = 5 << 18


class One(nn.Module):
    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(values.clone())


def values(k: int) -> torch.Tensor:
    """Random fp32 weights (they do not compress by a quarter, so an anchor stays raw),
    nudged a little further at each ``k`` (so a delta on them pays)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(N, generator=g) * 0.02
    return base + k * 1e-5 * torch.randn(N, generator=torch.Generator().manual_seed(1))


def object_path(root: Path, name: str) -> Path:
    digest = json.loads((root / "checkpoints" / f"{name}.json").read_text())["objects"]["w"]
    return root / "objects" / digest[:2] / digest


@pytest.fixture(scope="module")
def settled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``a`` (the anchor, raw), ``b`` (a version 3 delta on it) and ``c`` (the newest)."""
    root = tmp_path_factory.mktemp("sealed")
    v = Vault(root)
    for k, name in enumerate("abc"):
        v.save(One(values(k)), name)
    v.compact()
    return root


def copy_of(settled: Path, tmp_path: Path) -> Vault:
    import shutil

    shutil.copytree(settled, tmp_path / "v")
    return Vault(tmp_path / "v")


def test_a_delta_on_a_raw_anchor_records_the_anchor_sum_and_seals_its_header(
    settled: Path,
) -> None:
    anchor, delta = object_path(settled, "a"), object_path(settled, "b")
    assert anchor.stat().st_size == N * 4  # raw
    data = memoryview(delta.read_bytes())
    frame = parse_frame(data, N * 4)
    assert (frame.version, frame.base, len(frame.lengths)) == (3, anchor.name, 2)
    import xxhash

    assert frame.base_sum == xxhash.xxh3_64_intdigest(anchor.read_bytes())
    assert frame.table_end == HEADER_SIZE + 16 * 2 + SEAL_SIZE


def test_a_delta_on_a_raw_anchor_is_decoded_once(
    settled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked by reading (the blocks against their sums, the anchor against its sum),
    then each block decoded once into the tensor: not decoded whole to be checked and
    again to be copied."""
    v = copy_of(settled, tmp_path)
    calls: list[int] = []
    decompress = frame_module._decompress

    def counted(frame, src, out, private):  # type: ignore[no-untyped-def]
        calls.append(out.nbytes)
        decompress(frame, src, out, private)

    monkeypatch.setattr(frame_module, "_decompress", counted)
    model = One(torch.zeros(N))
    v.load(model, "b")  # verify=True, the default
    assert torch.equal(model.w.detach(), values(1))
    assert sum(calls) == N * 4  # each block of the delta once
    assert len(calls) == 2


def test_a_damaged_raw_anchor_is_refused_before_its_delta_is_decoded(
    settled: Path, tmp_path: Path
) -> None:
    v = copy_of(settled, tmp_path)
    anchor = object_path(Path(v.url), "a")
    data = bytearray(anchor.read_bytes())
    data[N * 2] ^= 0x10
    anchor.write_bytes(bytes(data))
    model = One(torch.zeros(N))
    with pytest.raises(ChecksumError, match=r"b\.json: checksum mismatch in 1 tensor\(s\): w"):
        v.load(model, "b")
    assert torch.equal(model.w.detach(), torch.zeros(N))  # untouched
    report = v.verify()
    assert not report.ok
    assert any(p.startswith("b: ") and "'w'" in p for p in report.problems), report.problems


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_damaged_byte_before_the_blocks_is_refused_with_the_model_untouched(
    settled: Path, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """A changed byte of the header, block table, base sum or seal of the delta ``b``: a
    FormatError naming the tensor, with nothing decoded into the model."""
    v = copy_of(settled, tmp_path_factory.mktemp("fuzz"))
    name = "b"
    path = object_path(Path(v.url), name)
    blob = bytearray(path.read_bytes())
    end = parse_frame(memoryview(blob), N * 4).table_end
    at = data.draw(st.integers(8, end - 1))  # the magic is what tells a frame at all
    blob[at] ^= data.draw(st.integers(1, 255))
    path.write_bytes(bytes(blob))
    model = One(torch.zeros(N))
    with pytest.raises(FormatError, match=rf"{name}\.json: tensor 'w'"):
        v.load(model, name)
    assert torch.equal(model.w.detach(), torch.zeros(N))
    assert not v.verify().ok


def test_a_resealed_forgery_is_still_refused(settled: Path, tmp_path: Path) -> None:
    """The seal guards against rot, not an attacker: a forged item size behind a fitting
    seal decodes to bytes that fail the tensor's checksum (as a forged block behind a
    fitting block sum does, tests/test_vault_delta_codec.py), never a silent load."""
    v = copy_of(settled, tmp_path)
    path = object_path(Path(v.url), "b")
    blob = bytearray(path.read_bytes())
    struct.pack_into("<B", blob, 10, 2)  # item size 2 on 4-byte words
    reseal_frame(blob, blocks=False)
    path.write_bytes(bytes(blob))
    with pytest.raises(FormatError, match=r"b\.json: .*(tensor.*w|w\b)"):
        v.load(One(torch.zeros(N)), "b")


def test_a_version_2_delta_on_a_raw_anchor_loads_bitwise(settled: Path, tmp_path: Path) -> None:
    """Rewritten as the previous release wrote it (no seal, no base sum): decoded to be
    checked, then again to be copied, and exact."""
    v = copy_of(settled, tmp_path)
    path = object_path(Path(v.url), "b")
    blob = bytearray(path.read_bytes())
    frame = parse_frame(memoryview(blob), N * 4)
    head = bytearray(blob[: frame.table_end - SEAL_SIZE])
    head[8] = 2
    path.write_bytes(bytes(head) + bytes(blob[frame.table_end :]))
    assert parse_frame(memoryview(path.read_bytes()), N * 4).version == 2
    model = One(torch.zeros(N))
    v.load(model, "b")
    assert torch.equal(model.w.detach(), values(1))
    assert v.verify().ok
