"""A mirror beside training: checkpoints pushed after they commit, off the training
thread; a mirror that goes away warns and catches up, never failing a step."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _transfer_workers import check_loads, state, step, train  # noqa: E402
from weightvault import Vault  # noqa: E402
from weightvault._vault.mirror import Mirror  # noqa: E402


def test_each_checkpoint_reaches_the_mirror_and_local_retention_never_deletes_there(
    tmp_path: Path,
) -> None:
    vault = Vault(tmp_path / "local", training_state_last=1)
    mirror = Mirror(vault, tmp_path / "mirror")
    model, opt = train()
    expected = {}
    for _ in range(4):
        step(model, opt)
        name = vault.save(model, optimizer=opt).name
        expected[name] = state(model, opt)
        mirror.after_save(name)
        vault.retain(keep_last=2)  # older ones go locally, and only locally
    report = mirror.wait(timeout=120)
    assert report is not None
    remote = Vault(tmp_path / "mirror")
    assert [r.name for r in vault.list()] == list(expected)[-2:]
    assert [r.name for r in remote.list()] == list(expected)
    assert remote.verify().ok
    check_loads(remote, expected)  # optimizer state of every one: the mirror kept it all


def test_a_mirror_whose_server_goes_away_warns_once_per_checkpoint_and_catches_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """moto's S3 server stops after the first checkpoint: the next saves still succeed
    and each warns once; the server comes back and the next save pushes every one."""
    s3fs = pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                 "AWS_CONFIG_FILE": str(tmp_path / "none"),
                 "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "key": "testing",
               "secret": "testing"}  # fmt: skip
    s3fs.S3FileSystem(**options).mkdir("mirror")
    # A mirror gives up quickly on a server that is gone (s3fs and botocore retry).
    quick = {**options, "config_kwargs": {"connect_timeout": 1,
             "read_timeout": 2, "retries": {"max_attempts": 1}}}  # fmt: skip
    vault = Vault(tmp_path / "local")
    mirror = Mirror(vault, "s3://mirror/run", **quick)
    model, opt = train()
    expected: dict[str, Any] = {}

    def save() -> None:
        step(model, opt)
        name = vault.save(model, optimizer=opt).name
        expected[name] = state(model, opt)
        mirror.after_save(name)

    try:
        save()
        assert mirror.wait(timeout=120) is not None
        server.stop()  # the network goes away mid-training
        with caplog.at_level(logging.WARNING, logger="weightvault"):
            for _ in range(2):
                save()
                mirror.wait(timeout=120)
            mirror.wait(timeout=120)  # a retry of the same ones warns no more
        warned = [r.getMessage() for r in caplog.records if "mirror" in r.getMessage()]
        assert len(warned) == 2 and "000002" in warned[0] and "000003" in warned[1], warned
        assert all("retrying at the next save" in w for w in warned)
        # The server comes back (moto keeps its buckets in this process).
        server = moto_server.ThreadedMotoServer(ip_address=host, port=port, verbose=False)
        server.start()
        save()
        report = mirror.wait(timeout=120)
        assert report is not None and report.checkpoints == list(expected)[1:]
        remote = Vault("s3://mirror/run", **options)
        assert [r.name for r in remote.list()] == list(expected)
        check_loads(remote, expected)
    finally:
        server.stop()


def test_the_trainer_callback_mirrors_every_checkpoint(tmp_path: Path) -> None:
    """``VaultCallback(path, mirror=...)``: every checkpoint the Trainer saved is on the
    mirror when ``train()`` returns, with ``save_total_limit`` applied locally only."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent))
    import _hf_trainer_worker as hf
    from weightvault.integrations.transformers import VaultCallback

    m = hf.model(0)
    callback = VaultCallback(tmp_path / "local", mirror=tmp_path / "mirror")
    hf.trainer(m, tmp_path / "out", [callback], save_total_limit=1).train()
    assert [r.name for r in Vault(tmp_path / "local").list()] == ["checkpoint-6"]
    remote = Vault(tmp_path / "mirror")
    assert [r.name for r in remote.list()] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert remote.verify().ok
    final = Vault(tmp_path / "local").open("checkpoint-6")
    with remote.open("checkpoint-6") as theirs, final:
        assert theirs.objects == final.objects
