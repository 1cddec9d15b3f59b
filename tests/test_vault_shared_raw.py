"""Whole weights are read by every resume and by every delta on them (anchors), and objects
that checkpoints share unchanged (a frozen backbone) by every resume of each: the
compactor compresses those only when that saves at least ``1 - ANCHOR_PAYS`` (``1 -
SHARED_PAYS``), where training state read by one checkpoint alone needs ``1 - PAYS``.
Shared means named by a checkpoint and the one before it, or listed as frozen by the
record (known from the first save on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")
from torch import nn  # noqa: E402

from weightvault import Vault  # noqa: E402
from weightvault._vault.objects.codec import CODECS, DEFAULT  # noqa: E402
from weightvault._vault.objects.encoding import (  # noqa: E402
    ANCHOR_PAYS,
    PAYS,
    SHARED_PAYS,
    encode_full,
    size_of,
)
from weightvault._vault.objects.file import object_file  # noqa: E402
from weightvault._vault.objects.frame import HEADER_SIZE, is_frame, parse_frame_header  # noqa: E402

N = 1 << 15  # floats per weight: several blocks, well over SMALL


class Net(nn.Module):
    """A frozen random layer, a trainable one and a constant buffer (a mask)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.backbone = nn.Parameter(torch.randn(N, generator=g) * 0.02, requires_grad=False)
        self.head = nn.Parameter(torch.randn(N, generator=g) * 0.02)
        self.register_buffer("mask", torch.tril(torch.ones(256, 128)))


def kind(vault: Vault, name: str, tensor: str) -> str:
    """``"raw"``, ``"full"`` or ``"delta"``: how ``tensor`` of checkpoint ``name`` is stored."""
    digest = vault.open(name).objects[tensor]
    head = bytes(object_file(vault.store, digest)[:HEADER_SIZE])
    if not is_frame(head):
        return "raw"
    return "full" if parse_frame_header(memoryview(head)).base is None else "delta"


def ratio(t: Any) -> float:
    """What the default codec makes of ``t``, compressed in full."""
    raw = memoryview(t.detach().contiguous().numpy()).cast("B")
    return size_of(encode_full(raw, 4, CODECS[DEFAULT], pays=1.0)) / raw.nbytes


def drift(net: Net, k: int) -> None:
    with torch.no_grad():
        net.head.add_(torch.randn(N, generator=torch.Generator().manual_seed(k)) * 1e-5)


def test_the_bytes_of_this_file_lie_between_the_two_thresholds() -> None:
    # Without this, the tests below would not tell the two thresholds apart.
    net = Net()
    assert SHARED_PAYS < ratio(net.backbone) <= PAYS
    assert ANCHOR_PAYS < ratio(net.head) <= PAYS
    assert ratio(net.mask) <= min(SHARED_PAYS, ANCHOR_PAYS)


def test_a_shared_weight_stays_raw_and_a_shared_buffer_is_compressed(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    net = Net()
    saved = []
    for k in range(3):
        drift(net, k)
        vault.save(net)
        saved.append({n: t.clone() for n, t in net.state_dict().items()})
    vault.wait()
    names = [r.name for r in vault.list()]
    assert kind(vault, names[-1], "backbone") == "raw"
    assert kind(vault, names[-1], "mask") == "full"
    assert kind(vault, names[0], "head") == "raw"  # the anchor: as it was saved
    assert kind(vault, names[1], "head") == "delta"  # on the anchor
    vault.compact()  # settles: nothing here compresses enough to be decoded by a read
    assert kind(vault, names[-1], "backbone") == "raw"
    assert kind(vault, names[-1], "head") == "raw"
    assert kind(vault, names[-1], "mask") == "full"
    for name, want in zip(names, saved, strict=True):
        got = Net()
        vault.load(got, name)
        for n, t in want.items():
            assert torch.equal(got.state_dict()[n], t), (name, n)
    assert vault.verify().ok


@pytest.mark.parametrize("compaction", ["background", "after-save"])
def test_a_frozen_weight_stays_raw_from_the_first_checkpoint(
    tmp_path: Path, compaction: str
) -> None:
    # One checkpoint: nothing is shared yet, but the record lists the weight as frozen.
    vault = Vault(tmp_path, compaction=compaction)
    net = Net()
    opt = torch.optim.SGD([net.head], lr=0.0, momentum=0.9)
    net.head.grad = torch.randn(N, generator=torch.Generator().manual_seed(1)) * 0.02
    opt.step()  # the momentum: the same kind of bytes as the weights, training state
    vault.save(net, optimizer=opt)
    vault.compact()
    name = vault.list()[-1].name
    assert kind(vault, name, "backbone") == "raw"
    assert kind(vault, name, "head") == "raw"  # a weight: an anchor
    moment = next(n for n in vault.open(name).objects if "momentum" in n)
    assert kind(vault, name, moment) == "full"  # read by this checkpoint alone
    got = Net()
    vault.load(got, name)
    assert torch.equal(got.backbone, net.backbone)
    assert got.backbone.requires_grad is False


def test_a_shared_raw_weight_is_not_compressed_again_by_every_compaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import weightvault._vault.upkeep.reencode as reencode_module

    net = Net()
    backbone = net.backbone.detach().numpy().tobytes()
    tries: list[int] = []
    real = reencode_module.encode_full

    def counted(raw: Any, *args: Any, **kwargs: Any) -> Any:
        if bytes(raw) == backbone:
            tries.append(1)
        return real(raw, *args, **kwargs)

    monkeypatch.setattr(reencode_module, "encode_full", counted)
    vault = Vault(tmp_path)
    for k in range(5):
        drift(net, k)
        vault.save(net)
        vault.wait()
    vault.compact()
    assert kind(vault, vault.list()[-1].name, "backbone") == "raw"
    assert len(tries) == 1  # found not to pay once, then remembered
