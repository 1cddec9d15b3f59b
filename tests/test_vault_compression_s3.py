"""Compressed and delta objects on an object store (a real S3-compatible server, moto).

Reads on S3 fetch whole objects concurrently and then each level of a delta chain in one
more round (``prefetch``); gc follows bases by ranged reads of frame headers; a damaged
base is a FormatError naming the tensor, as on a local disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from torch import nn  # noqa: E402

from test_vault_s3 import aws_env, bucket, endpoint, fs, options  # noqa: E402, F401
from weightvault import FormatError, Vault  # noqa: E402
from weightvault._vault.objects.frame import MAGIC  # noqa: E402


def trained() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model: nn.Module, opt: Any) -> None:
    model(torch.randn(8, 128)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state(model: nn.Module) -> dict[str, bytes]:
    return {k: v.numpy().tobytes() for k, v in model.state_dict().items()}


def test_deltas_and_weights_only_history_on_s3(
    bucket: str,  # noqa: F811 (the fixtures of test_vault_s3)
    options: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    from safetensors.torch import load_file

    url = f"s3://{bucket}/run"
    vault = Vault(url, delta_chain=2, training_state_last=1, **options)
    model, opt = trained()
    saved = []
    for _ in range(6):
        step(model, opt)
        vault.save(model, optimizer=opt)
        saved.append(state(model))
    vault.compact()  # settled: anchors and deltas

    def head(name: str) -> bytes:
        digest = _digest(vault, name)
        return bytes(fs(options).cat_file(f"{bucket}/run/objects/{digest[:2]}/{digest}")[:64])

    # Each checkpoint is whole (an anchor, raw fp32) or one delta on an anchor, at most
    # K = 2 deltas per anchor, the newest whole: 1 <- 2, 3; 4 <- 5; 6.
    whole = [head(f"00000{i}")[:8] != MAGIC for i in range(1, 7)]
    assert whole == [True, False, False, True, False, True]
    assert {head(f"00000{i}")[11] for i in (2, 3, 5)} == {2}  # a difference delta
    assert _base_of(vault, "000002") == _base_of(vault, "000003") == _digest(vault, "000001")
    assert _base_of(vault, "000005") == _digest(vault, "000004")

    vault.retain(keep_last=3)
    vault.gc()
    other = Vault(url, **options)  # a new client: nothing cached
    for rec, values in zip(other.list(), saved[-3:], strict=True):
        fresh, _ = trained()
        other.load(fresh, rec.name)
        assert state(fresh) == values
    assert [r.weights_only for r in other.list()] == [True, True, False]
    assert other.verify().ok
    out = tmp_path / "plain.safetensors"
    other.export("latest", out)
    plain = load_file(str(out))  # the weights, and the latest's training state besides
    assert {k: plain[k].numpy().tobytes() for k in saved[-1]} == saved[-1]

    # The base of the delta gone: a FormatError naming the tensor, nothing loaded.
    base = _base_of(vault, "000005")
    fs(options).rm_file(f"{bucket}/run/objects/{base[:2]}/{base}")
    fresh, _ = trained()
    with pytest.raises(FormatError, match=r"000005\.json: tensor '0\.weight'.*delta base"):
        Vault(url, **options).load(fresh, "000005")


def _digest(vault: Vault, name: str) -> str:
    return str(json.loads(vault.store.get(f"checkpoints/{name}.json"))["objects"]["0.weight"])


def _base_of(vault: Vault, name: str) -> str:
    frame = vault.store.get_range(
        f"objects/{_digest(vault, name)[:2]}/{_digest(vault, name)}", 0, 64
    )
    return frame[32:64].hex()
