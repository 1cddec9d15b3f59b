"""A mirror beside training: checkpoints pushed after they commit, off the training
thread; a mirror that goes away warns and catches up, never failing a step."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _transfer_workers import check_loads, state, step, train  # noqa: E402
from weightvault import Vault  # noqa: E402
from weightvault._vault.travel.mirror import Mirror  # noqa: E402
from weightvault._vault.upkeep.compact import pending  # noqa: E402


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
    # The end of training settles the local vault: the newest compressed, nothing to do.
    assert pending(Vault(tmp_path / "local").store) == []
    remote = Vault(tmp_path / "mirror")
    assert [r.name for r in remote.list()] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert remote.verify().ok
    final = Vault(tmp_path / "local").open("checkpoint-6")
    with remote.open("checkpoint-6") as theirs, final:
        assert theirs.objects == final.objects


def test_the_mirror_holds_back_while_the_local_vault_saves_or_loads(tmp_path: Path) -> None:
    """A push waits between batches while the vault is busy, and goes on once it is not."""
    vault = Vault(tmp_path / "local", compaction=None)
    mirror = Mirror(vault, tmp_path / "mirror")
    model, opt = train()
    step(model, opt)
    name = vault.save(model, optimizer=opt).name
    expected = {name: state(model, opt)}
    with vault._compactor.busy():  # what a save or a load of this Vault holds
        mirror.after_save(name)
        time.sleep(1.0)
        assert (
            not (tmp_path / "mirror" / "checkpoints").exists()
            or not Vault(tmp_path / "mirror").list()
        )
    report = mirror.wait(timeout=120)
    assert report is not None and report.committed == [name]
    check_loads(Vault(tmp_path / "mirror"), expected)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_mirror_thread_runs_nicer_than_training(tmp_path: Path) -> None:
    seen: list[int] = []
    real = Mirror._push_queued

    def spy(self: Mirror) -> bool:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(self)

    vault = Vault(tmp_path / "local", compaction=None)
    model, opt = train()
    step(model, opt)
    mirror = Mirror(vault, tmp_path / "mirror")
    Mirror._push_queued = spy  # type: ignore[method-assign]
    try:
        mirror.after_save(vault.save(model, optimizer=opt).name)
        assert mirror.wait(timeout=120) is not None
    finally:
        Mirror._push_queued = real  # type: ignore[method-assign]
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen and seen[0] == min(19, mine + 10), (seen, mine)


def test_retention_waits_for_the_mirror_then_applies_what_it_left(tmp_path: Path) -> None:
    """Saves outrun the push (held back here): the mirror still gets every checkpoint
    with its optimizer state, and the local vault ends as its retention asked."""
    vault = Vault(tmp_path / "local", compaction=None)
    mirror = Mirror(vault, tmp_path / "mirror")
    model, opt = train()
    expected = {}
    with vault._compactor.busy():
        for _ in range(3):
            step(model, opt)
            name = vault.save(model, optimizer=opt).name
            expected[name] = state(model, opt)
            mirror.after_save(name)
            assert vault.retain(keep_last=1, training_state_last=1) == []
        assert [r.name for r in vault.list()] == list(expected)  # all kept, still queued
    assert mirror.wait(timeout=120) is not None
    check_loads(Vault(tmp_path / "mirror"), expected)
    assert [r.name for r in vault.list()] == list(expected)[-1:]
    assert not vault.spared


def test_a_failing_mirror_does_not_hold_local_retention(tmp_path: Path) -> None:
    blocker = tmp_path / "mirror"
    blocker.write_text("not a vault")  # every push fails
    vault = Vault(tmp_path / "local", compaction=None)
    mirror = Mirror(vault, blocker)
    model, opt = train()
    for _ in range(3):
        step(model, opt)
        mirror.after_save(vault.save(model, optimizer=opt).name)
        mirror.wait(timeout=60)
        vault.retain(keep_last=1)
    assert len(vault.list()) == 1 and not vault.spared
