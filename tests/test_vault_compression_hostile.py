"""Hostile and damaged object frames: each is a FormatError naming the tensor, never a hang,
a crash, or an allocation beyond the size the checkpoint record gives.

Frames are forged with the writer's own :func:`encode_frame` and then patched field by
field (see ``docs/format.md`` for the layout), so each case breaks exactly one thing.
"""

from __future__ import annotations

import json
import re
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from _frames import reseal_frame  # noqa: E402
from weightvault import FormatError, Vault  # noqa: E402
from weightvault._file.checkpoint import HASH_WINDOW  # noqa: E402
from weightvault._vault.objects.codec import CODECS  # noqa: E402
from weightvault._vault.objects.frame import (  # noqa: E402
    HEADER_SIZE,
    SEAL_SIZE,
    blocks_intact,
    encode_frame,
    parse_frame,
)
from weightvault._vault.objects.read import read_range  # noqa: E402

N = 1 << 14  # floats: 64 KiB, one block


class One(nn.Module):
    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(values.clone())


def values(k: int) -> torch.Tensor:
    return torch.linspace(-1, 1, N) + k * 1e-4


def objects(root: Path, name: str) -> dict[str, Path]:
    doc = json.loads((root / "checkpoints" / f"{name}.json").read_text())
    return {n: root / "objects" / d[:2] / d for n, d in doc["objects"].items()}


@pytest.fixture
def vault(tmp_path: Path) -> Vault:
    """Three checkpoints, compacted: ``000002``, the newest, holds ``w`` whole; ``start``,
    the oldest, is the anchor, whole too; ``000001`` is one delta on the anchor."""
    v = Vault(tmp_path)
    v.save(One(values(-1)), "start")
    v.save(One(values(0)))
    v.save(One(values(1)))
    v.compact()  # settled: the newest full, not left raw
    delta = objects(tmp_path, "000001")["w"].read_bytes()
    assert delta[11] == 2  # a difference delta
    assert delta[32:64].hex() == objects(tmp_path, "start")["w"].name  # on the anchor
    return v


def root(v: Vault) -> Path:
    return Path(v.url)


def refused(v: Vault, name: str, match: str) -> None:
    """Loading ``name`` is a FormatError naming the checkpoint and ``w``; verify says so."""
    model = One(torch.zeros(N))
    with pytest.raises(FormatError, match=match) as info:
        v.load(model, name)
    assert f"{name}.json: tensor 'w'" in str(info.value)
    assert torch.equal(model.w.detach(), torch.zeros(N))  # untouched
    report = v.verify()
    assert not report.ok
    assert any(p.startswith(f"{name}: tensor 'w'") for p in report.problems)


def patch(path: Path, offset: int, fmt: str, *value: Any) -> None:
    """Patch one field, the frame's seal made to fit (so the field's own check is reached)."""
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, *value)
    reseal_frame(data, blocks=False)
    path.write_bytes(bytes(data))


def reseal(path: Path) -> None:
    """Give a forged frame the block sums of its (forged) blocks and its seal, as a crafted
    file would have them, so that the decoder's own checks are what is tested."""
    data = bytearray(path.read_bytes())
    reseal_frame(data)
    path.write_bytes(bytes(data))


def test_a_frame_that_claims_a_larger_size_is_refused_before_any_allocation(vault: Vault) -> None:
    patch(objects(root(vault), "000002")["w"], 16, "<Q", 1 << 40)  # raw size: 1 TiB
    tracemalloc.start()
    try:
        refused(vault, "000002", "claims 1099511627776 raw bytes, the record says 65536")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_a_frame_that_claims_a_smaller_size_is_refused(vault: Vault) -> None:
    patch(objects(root(vault), "000002")["w"], 16, "<Q", N * 4 - 4)
    refused(vault, "000002", "claims 65532 raw bytes")


def test_a_truncated_frame_is_refused(vault: Vault) -> None:
    path = objects(root(vault), "000002")["w"]
    path.write_bytes(path.read_bytes()[:-100])
    refused(vault, "000002", "truncated")


def test_a_frame_cut_inside_its_header_is_refused(vault: Vault) -> None:
    path = objects(root(vault), "000002")["w"]
    path.write_bytes(path.read_bytes()[:40])
    refused(vault, "000002", "shorter than a frame header")


def test_a_decompression_bomb_is_refused_without_decompressing(vault: Vault) -> None:
    """A block that inflates to 1 GiB, in a frame that claims the record's 64 KiB."""
    import blosc2

    bomb = blosc2.compress2(bytes(1 << 30), typesize=4, clevel=1, codec=blosc2.Codec.ZSTD)
    assert len(bomb) < 1 << 20
    header = bytearray(encode_frame(memoryview(bytes(N * 4)), 4, CODECS["blosc2"])[0])
    struct.pack_into("<Q", header, HEADER_SIZE, len(bomb))
    objects(root(vault), "000002")["w"].write_bytes(bytes(header) + bomb)
    reseal(objects(root(vault), "000002")["w"])
    tracemalloc.start()
    try:
        refused(vault, "000002", "claims 1073741824 raw bytes in")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_a_block_whose_header_lies_about_its_size_never_overflows(vault: Vault) -> None:
    """python-blosc2 sizes its destination from the block's header: checked first."""
    path = objects(root(vault), "000002")["w"]
    block = HEADER_SIZE + 16 + SEAL_SIZE  # after the table's one entry and the seal
    patch(path, block + 4, "<i", 2 * N * 4)  # blosc2 header: nbytes
    reseal(path)
    refused(vault, "000002", "a compressed block claims 131072 raw bytes")


def test_a_delta_whose_base_is_missing_is_refused(vault: Vault) -> None:
    objects(root(vault), "start")["w"].unlink()
    refused(vault, "000001", r"its delta base [0-9a-f]{12} is missing")


def test_a_delta_whose_base_has_another_dtype_is_refused(vault: Vault) -> None:
    """The base's frame splits 2-byte items (a bf16 tensor of the same size)."""
    path = objects(root(vault), "start")["w"]
    raw = values(1).numpy().tobytes()
    path.write_bytes(b"".join(encode_frame(memoryview(raw), 2, CODECS["blosc2"])))
    refused(vault, "000001", "holds 2-byte items, its delta 4-byte ones")


def test_a_delta_whose_base_has_another_shape_is_refused(vault: Vault) -> None:
    path = objects(root(vault), "start")["w"]
    raw = torch.linspace(-1, 1, N // 2).numpy().tobytes()
    path.write_bytes(b"".join(encode_frame(memoryview(raw), 4, CODECS["blosc2"])))
    refused(vault, "000001", "claims 32768 raw bytes, the record says 65536")


def test_a_cycle_of_deltas_is_refused_not_followed(vault: Vault) -> None:
    """The base rewritten as a delta on the delta: each names the other."""
    objs = objects(root(vault), "000001")
    base, delta = objects(root(vault), "start")["w"], objs["w"]
    d = bytearray(delta.read_bytes())
    base_digest = bytes(d[32:64])
    b = bytearray(d)  # the same frame, pointing back at the delta
    b[32:64] = bytes.fromhex(delta.name)
    struct.pack_into("<H", b, 12, 2)
    reseal_frame(b)
    base.write_bytes(bytes(b))
    assert bytes.fromhex(base.name) == base_digest
    refused(vault, "000001", "cyclic")
    vault.gc()  # follows the names without looping


def test_a_delta_on_itself_is_refused(vault: Vault) -> None:
    delta = objects(root(vault), "000001")["w"]
    d = bytearray(delta.read_bytes())
    d[32:64] = bytes.fromhex(delta.name)
    reseal_frame(d)
    delta.write_bytes(bytes(d))
    refused(vault, "000001", "cyclic")


@pytest.mark.parametrize(
    ("offset", "value", "match"),
    [
        (8, 4, "unknown object frame version 4"),
        (9, 77, "unknown codec id 77"),
        (11, 9, "unknown delta kind 9"),
    ],
)
def test_a_frame_of_a_newer_format_says_to_upgrade(
    vault: Vault, offset: int, value: int, match: str
) -> None:
    patch(objects(root(vault), "000001")["w"], offset, "<B", value)
    refused(vault, "000001", match)


def test_a_ranged_read_of_a_damaged_frame_is_a_format_error(vault: Vault) -> None:
    path = objects(root(vault), "000001")["w"]
    assert read_range(vault.store, path.name, 4, 12) == values(0).numpy().tobytes()[4:12]
    with pytest.raises(FormatError, match="lie outside the object's 65536"):
        read_range(vault.store, path.name, 0, 1 << 20)
    objects(root(vault), "start")["w"].unlink()
    with pytest.raises(FormatError, match=rf"objects/{path.name[:2]}/{path.name}: its delta base"):
        read_range(vault.store, path.name, 0, 16)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_damage_to_a_frame_loads_exactly_or_is_a_format_error(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    where = tmp_path_factory.mktemp("fuzz")
    v = Vault(where)
    v.save(One(values(0)))
    v.save(One(values(1)))
    v.compact()  # settled: the newest full, not left raw
    name = data.draw(st.sampled_from(["000002", "000001"]))
    path = objects(where, name)["w"]
    blob = bytearray(path.read_bytes())
    how = data.draw(st.sampled_from(["flip", "cut", "zero"]))
    at = data.draw(st.integers(0, 1 << 30)) % len(blob)  # independent of the length
    if how == "flip":
        blob[at] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "cut":
        del blob[at:]
    else:
        blob[at : at + 8] = bytes(len(blob[at : at + 8]))
    path.write_bytes(bytes(blob))
    model = One(torch.zeros(N))
    try:
        v.load(model, name)
    except FormatError as e:  # a damaged frame, or bytes that fail their checksum
        assert re.search(r"tensor 'w'|tensor\(s\): w", str(e)), e
    else:  # the damage did not matter to the raw bytes (checked against their checksum)
        assert torch.equal(model.w.detach(), values(0 if name == "000001" else 1))
    v.verify()  # reports, never raises


@settings(max_examples=30, deadline=None)
@given(at=st.integers(0, 3 * HASH_WINDOW + 999), bit=st.integers(0, 7))
def test_a_block_larger_than_the_hash_window_is_checked_in_every_window(at: int, bit: int) -> None:
    # Blocks are checked through HASH_WINDOW-sized reads: a flip in any of them must count.
    raw = np.random.default_rng(0).integers(0, 256, 3 * HASH_WINDOW + 1000, np.uint8)
    blob = bytearray(b"".join(encode_frame(memoryview(raw), 4, CODECS["blosc2"])))
    frame = parse_frame(memoryview(blob), raw.nbytes)
    assert max(frame.lengths) > 2 * HASH_WINDOW  # random bytes: one block, barely smaller

    def reads(data: bytearray) -> tuple[Any, Any]:
        def read_into(offset: int, out: memoryview) -> None:
            out[:] = data[offset : offset + out.nbytes]

        return read_into, lambda offset, n: memoryview(data)[offset : offset + n]

    assert blocks_intact(*reads(blob), frame) is True
    assert blocks_intact(None, reads(blob)[1], frame) is True
    where = frame.table_end + at % sum(frame.lengths)
    blob[where] ^= 1 << bit
    assert blocks_intact(*reads(blob), frame) is False
    assert blocks_intact(None, reads(blob)[1], frame) is False
