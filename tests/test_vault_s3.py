"""The vault on an object store: a real S3-compatible server (moto) on 127.0.0.1.

The server runs in a thread of the test process and speaks HTTP; the vault reaches it
through fsspec/s3fs exactly as it would reach AWS (no client is mocked). Exclusive
commits rely on the server honouring ``If-None-Match: *``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
s3fs = pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from _vault_workers import assert_bitwise, build, snapshot  # noqa: E402
from weightvault import (  # noqa: E402
    CheckpointExistsError,
    CheckpointNotFoundError,
    Vault,
    VaultNotFoundError,
    WeightvaultError,
)

# These tests poke objects/ by path: packs have their own (test_vault_packs.py).
pytestmark = pytest.mark.usefixtures("loose_saves")

CREDENTIALS = {"key": "testing", "secret": "testing"}


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Test credentials, and nothing that could send botocore anywhere but the endpoint."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CREDENTIALS["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CREDENTIALS["secret"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)


@pytest.fixture
def options(endpoint: str) -> dict[str, Any]:
    return {"client_kwargs": {"endpoint_url": endpoint}, **CREDENTIALS}


@pytest.fixture
def bucket(options: dict[str, Any]) -> str:
    name = f"vault-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options).mkdir(name)
    return name


def fs(options: dict[str, Any]) -> Any:
    return s3fs.S3FileSystem(**options)


def object_key(vault: Vault, name: str, tensor: str) -> str:
    doc = json.loads(vault.store.get(f"checkpoints/{name}.json"))
    digest = doc["objects"][tensor]
    return f"{vault.store.root}/objects/{digest[:2]}/{digest}"  # type: ignore[attr-defined]


def fresh(width: int = 64) -> Any:
    return build(-1, backbone_seed=-1, width=width)


def test_vault_on_s3_end_to_end(
    bucket: str, options: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    url = f"s3://{bucket}/run1"
    vault = Vault(url, compression=None, **options)  # raw objects: bytes are counted
    assert not fs(options).exists(f"{bucket}/run1/vault.json")  # opening creates nothing
    with pytest.raises(VaultNotFoundError, match="check the path"):
        vault.list()

    models = [build(seed, width=128) for seed in range(3)]
    head = sum(p.numel() * 4 for p in models[0].head.parameters())
    full = sum(t.numel() * 4 for t in models[0].state_dict().values())
    records = [vault.save(models[0], "first", metadata={"step": "0"})]
    assert fs(options).exists(f"{bucket}/run1/vault.json")  # the first save does
    records += [vault.save(m) for m in models[1:]]
    assert [r.name for r in records] == ["first", "000001", "000002"]
    assert [r.new_bytes for r in records] == [full, head, head]  # the backbone is shared

    # Another client (a new Vault on the same URL) sees the same checkpoints, oldest first.
    other = Vault(url, **options)
    assert [r.name for r in other.list()] == ["first", "000001", "000002"]
    assert other.list()[0].metadata == {"step": "0"}

    # Exclusive names: refused up front, and refused by the server's conditional put when
    # the up-front check misses (another writer created it in between).
    with pytest.raises(CheckpointExistsError):
        vault.save(models[1], "first")
    real_exists = vault.store.exists
    with monkeypatch.context() as patch:
        patch.setattr(
            vault.store,
            "exists",
            lambda key: False if key.startswith("checkpoints/") else real_exists(key),
        )
        with pytest.raises(CheckpointExistsError, match="another writer"):
            vault.save(models[2], "first")
    model = fresh(128)
    vault.load(model, "first")
    assert_bitwise(snapshot(model), snapshot(models[0]))

    # Loads, with every option reaching the adapter.
    model = fresh(128)
    report = other.load(model, restore_frozen=True)
    assert report.ok
    assert_bitwise(snapshot(model), snapshot(models[2]))
    assert not model.backbone[0].weight.requires_grad and model.head.weight.requires_grad
    with pytest.raises(CheckpointNotFoundError, match="000001"):
        other.load(model, "nope")

    assert vault.verify().ok

    out = tmp_path / "exported.safetensors"
    assert vault.export("000001", out) == out.stat().st_size
    plain = safetensors_torch.load_file(str(out))
    assert_bitwise(plain, snapshot(models[1]))

    before = vault.disk_bytes()
    listed = sum(info["size"] for info in fs(options).find(f"{bucket}/run1", detail=True).values())
    assert before == listed
    vault.delete("000001")
    assert [r.name for r in vault.list()] == ["first", "000002"]
    freed = vault.gc()
    assert freed == head
    assert vault.disk_bytes() < before - freed  # the record went too
    assert vault.gc() == 0
    for name, m in [("first", models[0]), ("000002", models[2])]:
        model = fresh(128)
        vault.load(model, name)
        assert_bitwise(snapshot(model), snapshot(m))
    assert vault.verify().ok
    assert not fs(options).find(f"{bucket}/run1/intents")
    assert not fs(options).find(f"{bucket}/run1/gc")


def test_auto_names_retry_on_s3_when_the_next_name_is_taken(
    bucket: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    vault = Vault(f"s3://{bucket}/run", **options)
    first = build(1, width=32)
    vault.save(first)
    from weightvault._vault.writing import commit

    real = commit.next_name
    picks: list[str] = []

    def stale(store: Any) -> str:
        picks.append("x")
        return "000001" if len(picks) == 1 else real(store)

    monkeypatch.setattr(commit, "next_name", stale)
    assert vault.save(build(2, width=32)).name == "000002"
    model = fresh(32)
    vault.load(model, "000001")
    assert_bitwise(snapshot(model), snapshot(first))


def _damaged(bucket: str, options: dict[str, Any], kind: str) -> Vault:
    vault = Vault(f"s3://{bucket}/run", compression=None, **options)  # a flip is a wrong value
    vault.save(build(1, width=64))
    vault.save(build(2, width=64))
    key = object_key(vault, "000002", "head.weight")
    s3 = vault.store.fs  # type: ignore[attr-defined]
    if kind == "flip":
        data = bytearray(s3.cat_file(key))
        data[100] ^= 0x80
        s3.pipe_file(key, bytes(data))
    else:
        s3.rm_file(key)
    return vault


@pytest.mark.parametrize("kind", ["flip", "delete"])
def test_damage_on_s3_is_reported_and_never_loaded(
    bucket: str, options: dict[str, Any], kind: str
) -> None:
    vault = _damaged(bucket, options, kind)
    report = Vault(f"s3://{bucket}/run", **options).verify()
    assert not report.ok and len(report.problems) == 1
    assert report.problems[0].startswith("000002: tensor 'head.weight'")
    assert ("corrupt" if kind == "flip" else "missing") in report.problems[0]

    model = fresh()
    before = snapshot(model)
    with pytest.raises(WeightvaultError) as info:
        vault.load(model, "000002")
    if kind == "flip":
        assert "head.weight" in str(info.value)
    assert_bitwise(snapshot(model), before)
    vault.load(model, "000001")
    assert_bitwise(snapshot(model), snapshot(build(1, width=64)))


def test_a_missing_object_on_s3_is_named_on_load(bucket: str, options: dict[str, Any]) -> None:
    vault = _damaged(bucket, options, "delete")
    with pytest.raises(WeightvaultError, match=r"head\.weight"):
        vault.load(fresh(), "000002")


def test_gc_trash_on_s3_is_read_then_put_back(bucket: str, options: dict[str, Any]) -> None:
    """An object a dead gc left in its trash (S3 has no rename: copy, then delete) still
    loads, and the next gc puts it back under objects/ instead of deleting it."""
    vault = Vault(f"s3://{bucket}/run", **options)
    model = build(1, width=64)
    vault.save(model)
    key = object_key(vault, "000001", "head.weight")
    digest = key.rsplit("/", 1)[-1]
    trash = f"{vault.store.root}/trash/deadgc/{digest}"  # type: ignore[attr-defined]
    fs(options).mv(key, trash)

    loaded = fresh()
    Vault(f"s3://{bucket}/run", **options).load(loaded, "000001")
    assert_bitwise(snapshot(loaded), snapshot(model))
    assert vault.verify().ok
    assert vault.gc() == 0
    assert fs(options).exists(key) and not fs(options).exists(trash)
    loaded = fresh()
    vault.load(loaded, "000001")
    assert_bitwise(snapshot(loaded), snapshot(model))
