"""Vault.push and Vault.pull: only missing objects travel, as stored, and the receiver
commits as a save does (objects checked and durable first, the record last)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _transfer_workers import check_loads, finetune, state, step, train  # noqa: E402
from weightvault import (  # noqa: E402
    CheckpointExistsError,
    CheckpointNotFoundError,
    FormatError,
    SourceDamagedError,
    Vault,
    VaultNotFoundError,
)
from weightvault._vault.objects.address import object_key  # noqa: E402
from weightvault._vault.travel import transfer as transfer_module  # noqa: E402
from weightvault._vault.upkeep.gc import collect  # noqa: E402

WORKER = Path(__file__).with_name("_transfer_workers.py")


def object_bytes(vault: Vault) -> int:
    return sum(b.size for b in vault.store.list("objects"))


@pytest.fixture
def source(tmp_path: Path) -> tuple[Vault, dict[str, dict[str, Any]]]:
    vault = Vault(tmp_path / "src", compaction="after-save")
    return vault, finetune(vault, 5)


def test_push_sends_each_missing_object_once_as_stored_and_everything_loads(
    source: tuple[Vault, dict[str, Any]], tmp_path: Path
) -> None:
    """A full push moves exactly the source's object files; a second moves nothing; a
    push after one more save moves what that save and its compaction added."""
    vault, expected = source
    report = vault.push(tmp_path / "dst")
    dest = Vault(tmp_path / "dst")
    assert report.checkpoints == report.committed == list(expected)
    assert report.bytes_sent == object_bytes(vault) == object_bytes(dest)
    assert report.objects_sent == len(vault.store.list("objects")) and report.whole == 0
    assert dest.verify().ok
    check_loads(dest, expected)
    # As stored: every object file is byte for byte the source's (deltas included).
    for blob in vault.store.list("objects"):
        assert dest.store.get(blob.key) == vault.store.get(blob.key)

    again = vault.push(dest)
    assert (again.objects_sent, again.bytes_sent, again.committed) == (0, 0, [])
    assert again.bytes_skipped == report.bytes_sent
    assert again.checkpoints == list(expected)

    before = {b.key for b in vault.store.list("objects")}
    model, opt = train()
    step(model, opt)
    record = vault.save(model, optimizer=opt)
    new = {b.key: b.size for b in vault.store.list("objects") if b.key not in before}
    third = vault.push(dest, [record.name])
    assert third.committed == [record.name]
    assert third.bytes_sent == sum(new.values())
    check_loads(dest, {record.name: state(model, opt)})


def test_pull_of_one_checkpoint_alone_sends_long_chains_whole(
    source: tuple[Vault, dict[str, Any]], tmp_path: Path
) -> None:
    """The second checkpoint's changed tensors are deltas three links from a full object
    (the oldest is whole): pulled alone, they come whole, and the pull costs about what
    saving it alone would."""
    vault, expected = source
    oldest = list(expected)[1]
    empty = Vault(tmp_path / "one", compaction=None)
    report = empty.pull(vault, [oldest])
    assert report.checkpoints == [oldest] and report.whole > 0
    assert empty.verify().ok
    check_loads(empty, {oldest: expected[oldest]})
    # What it needs: the same checkpoint saved alone into a fresh vault, compacted.
    alone = Vault(tmp_path / "alone", compaction="after-save")
    model, opt = train()
    step(model, opt)
    vault.load(model, oldest, optimizer=opt)
    alone.save(model, optimizer=opt)
    assert report.bytes_sent <= 1.05 * object_bytes(alone)

    # The newest checkpoint is whole on the source: it travels as stored.
    newest = list(expected)[-1]
    second = Vault(tmp_path / "two").pull(vault, ["latest"])
    assert second.checkpoints == [newest] and second.whole == 0


def test_a_pull_brings_the_bases_its_deltas_rely_on(
    source: tuple[Vault, dict[str, Any]], tmp_path: Path
) -> None:
    """Two neighbours pulled together: the newest travels as stored; the one before it is
    a delta on an anchor the pull does not send, so each of its deltas travels whole (the
    delta and its anchor would cost more than the tensor), and the receiver holds no
    object that no checkpoint of it reads."""
    vault, expected = source
    names = list(expected)[-2:]
    older = vault.open(names[0]).objects.values()
    deltas = {d for d in older if frame_of(vault, d) is not None and frame_of(vault, d).base}
    assert deltas  # the layout this test is about: deltas on an older anchor
    dest = Vault(tmp_path / "dst")
    report = dest.pull(vault, names)
    assert report.checkpoints == names and report.whole == len(deltas)
    assert dest.verify().ok
    check_loads(dest, {n: expected[n] for n in names})


def frame_of(vault: Vault, digest: str) -> Any:
    """The object's frame header, or ``None`` for raw bytes."""
    from weightvault._vault.objects.probe import object_frame

    return object_frame(vault.store, digest)


def test_a_name_with_other_content_is_refused_before_anything_moves(
    source: tuple[Vault, dict[str, Any]], tmp_path: Path
) -> None:
    vault, expected = source
    dest = Vault(tmp_path / "dst")
    other = Vault(tmp_path / "other", compaction=None)
    finetune(other, 1, seed=7)  # its 000001 differs from the source's
    other.push(dest)
    before = sorted(b.key for b in dest.store.list(""))
    with pytest.raises(CheckpointExistsError, match="'000001' exists there with other content"):
        vault.push(dest)
    assert sorted(b.key for b in dest.store.list("") if not b.key.startswith("intents/")) == [
        k for k in before if not k.startswith("intents/")
    ]
    # The others go by name; a weights-only copy of a pushed checkpoint is the same one.
    rest = list(expected)[1:]
    assert vault.push(dest, rest).committed == rest
    vault.retain(training_state_last=1)
    assert vault.push(dest, rest).committed == []
    check_loads(dest, {n: expected[n] for n in rest})  # the mirror kept the optimizer


def test_hostile_inputs_are_clear_errors_and_leave_nothing_visible(
    source: tuple[Vault, dict[str, Any]], tmp_path: Path
) -> None:
    vault, _ = source
    with pytest.raises(VaultNotFoundError, match="no vault here"):
        Vault(tmp_path / "nothing").push(tmp_path / "x")
    assert not (tmp_path / "x").exists()
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(FormatError, match=r"holds other data \(cat.jpg\)"):
        vault.push(other)
    assert sorted(os.listdir(other)) == ["cat.jpg"]
    future = tmp_path / "future"
    future.mkdir()
    (future / "vault.json").write_text(json.dumps({"format": "weightvault-vault", "version": 9}))
    with pytest.raises(FormatError, match="format version 9, which this weightvault"):
        vault.push(future)
    with pytest.raises(FormatError, match="format version 9"):
        Vault(tmp_path / "y").pull(future)
    assert sorted(os.listdir(future)) == ["vault.json"]
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint named 'nope'"):
        vault.push(tmp_path / "z", ["nope"])
    with pytest.raises(ValueError, match="itself"):
        vault.push(vault.url)


def test_a_damaged_source_object_is_reported_not_sent(
    source: tuple[Vault, dict[str, Any]], tmp_path: Path
) -> None:
    """One flipped byte in the newest checkpoint's head: that checkpoint, and every older
    one whose deltas are built on the object, stay behind; the rest arrive and load."""
    vault, expected = source
    newest = list(expected)[-1]
    doc = json.loads(vault.store.get(f"checkpoints/{newest}.json"))
    first = json.loads(vault.store.get(f"checkpoints/{next(iter(expected))}.json"))
    digest = next(d for n, d in doc["objects"].items() if d not in first["objects"].values())
    path = tmp_path / "src" / object_key(digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(SourceDamagedError, match=digest[:12]) as caught:
        vault.push(tmp_path / "dst")
    report = caught.value.report
    assert newest not in report.checkpoints and report.damaged
    dest = Vault(tmp_path / "dst")
    assert not dest.store.exists(object_key(digest))
    assert [r.name for r in dest.list()] == report.checkpoints
    assert dest.verify().ok
    check_loads(dest, {n: expected[n] for n in report.checkpoints})

    (tmp_path / "src" / "checkpoints" / f"{newest}.json").write_text("{not json")
    with pytest.raises(SourceDamagedError, match="not valid JSON"):
        vault.push(tmp_path / "dst2", [newest])
    assert Vault(tmp_path / "dst2").list() == []


def test_a_gc_on_the_receiver_during_a_push_frees_nothing_it_relies_on(
    source: tuple[Vault, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver holds unreferenced copies of what the push will reuse (a deleted
    checkpoint's); a gc runs after the push found them, before each record commits."""
    vault, expected = source
    dest = Vault(tmp_path / "dst")
    vault.push(dest)
    for r in dest.list():
        dest.delete(r.name)
    real = transfer_module._commit
    freed = []

    def gc_then_commit(store: Any, ckpt: Any, report: Any) -> None:
        freed.append(collect(store))  # after the push found the objects there
        real(store, ckpt, report)

    monkeypatch.setattr(transfer_module, "_commit", gc_then_commit)
    names = [f"again-{n}" for n in expected]
    for old, new in zip(expected, names, strict=True):  # the same checkpoints, renamed
        doc = vault.store.get(f"checkpoints/{old}.json")
        vault.store.put(f"checkpoints/{new}.json", doc)
        vault.delete(old)
    report = vault.push(dest)
    assert report.committed == names and len(freed) == len(names) and sum(freed) == 0
    assert report.objects_sent == 0  # everything was there, and stayed
    assert dest.verify().ok
    check_loads(dest, dict(zip(names, expected.values(), strict=True)))


def test_concurrent_pushes_and_saves_lose_nothing(tmp_path: Path) -> None:
    """Two vaults push into one receiver from threads, twice each, while one of them keeps
    saving and a gc loops on the receiver."""
    a = Vault(tmp_path / "a", compaction="after-save")
    b = Vault(tmp_path / "b", compaction="after-save")
    expected_a = finetune(a, 3)
    expected_b = {f"b-{n}": s for n, s in finetune(b, 3, seed=3).items()}
    for n in list(b.list()):
        doc = b.store.get(f"checkpoints/{n.name}.json")
        b.store.put(f"checkpoints/b-{n.name}.json", doc)
        b.delete(n.name)
    dest = tmp_path / "dst"
    Vault(dest, create=True)
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(fn: Any) -> threading.Thread:
        def body() -> None:
            try:
                fn()
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=body)
        t.start()
        return t

    def gc_loop() -> None:
        while not stop.is_set():
            Vault(dest).gc()

    more: dict[str, Any] = {}

    def saves() -> None:
        model, opt = train(seed=5)
        for _ in range(3):
            step(model, opt)
            more[a.save(model, optimizer=opt).name] = state(model, opt)
            a.push(dest)

    threads = [run(gc_loop), run(saves)]
    threads += [run(lambda v=v: v.push(dest)) for v in (a, b, a, b)]
    for t in threads[1:]:
        t.join(timeout=300)
    stop.set()
    threads[0].join(timeout=300)
    assert not any(t.is_alive() for t in threads) and errors == []
    final = a.push(dest)
    receiver = Vault(dest)
    assert {r.name for r in receiver.list()} == {*expected_a, *more, *expected_b}
    assert final.committed == []
    assert receiver.verify().ok
    check_loads(receiver, {**expected_a, **more, **expected_b})


def test_raw_arrivals_are_left_to_the_receivers_compactor(tmp_path: Path) -> None:
    vault = Vault(tmp_path / "src", compaction=None)
    expected = finetune(vault, 2)
    dest = Vault(tmp_path / "dst", compaction=None)
    report = dest.pull(vault)
    assert sorted(report.marked) == sorted(expected)
    assert sorted(p.name for p in (tmp_path / "dst" / "compact").iterdir()) == sorted(
        f"{n}.todo" for n in expected
    )
    assert dest.compact().checkpoints == list(expected)
    check_loads(dest, expected)


def _worker(src: Path, dst: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, str(WORKER), "push", str(src), str(dst)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_a_push_killed_at_random_points_leaves_loadable_checkpoints_and_resumes(
    tmp_path: Path,
) -> None:
    """20 pushes SIGKILLed at random moments: every checkpoint the receiver shows loads,
    and a rerun completes, sends only what is still missing, and verifies."""
    src = Vault(tmp_path / "src", compaction="after-save")
    expected = finetune(src, 6, width=96)
    total = len(src.store.list("objects"))
    timed = _worker(tmp_path / "src", tmp_path / "timed")
    assert timed.stdout is not None
    assert timed.stdout.readline().strip() == "pushing"
    started = time.monotonic()
    out, _ = timed.communicate(timeout=120)
    took = time.monotonic() - started  # a whole push, timed on this machine as it is now
    assert timed.returncode == 0 and "done" in out
    rng = random.Random(29)
    interrupted = 0
    for run in range(20):
        dst = tmp_path / f"dst{run}"
        proc = _worker(tmp_path / "src", dst)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "pushing"
        threading.Event().wait(rng.uniform(0, 0.8 * took))  # inside the push, mostly
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        interrupted += "done" not in out
        if not (dst / "vault.json").exists():
            continue
        receiver = Vault(dst, compaction=None)
        shown = [r.name for r in receiver.list()]
        assert receiver.verify().ok, run
        check_loads(receiver, {n: expected[n] for n in shown}, width=96)
        held = len([b for b in receiver.store.list("objects") if "/." not in b.key])
        rerun = src.push(receiver)
        assert rerun.objects_sent <= total - held, run
        assert rerun.checkpoints == list(expected), run
        assert receiver.verify().ok, run
    assert interrupted >= 5  # the kills landed inside pushes, not after them
    check_loads(Vault(tmp_path / "dst19"), expected, width=96)


def test_push_to_and_pull_from_s3(
    source: tuple[Vault, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against moto's S3 server on 127.0.0.1: a full push, a second that sends nothing, a
    pull of the newest alone, and a pull of everything back, each loading bitwise."""
    pytest.importorskip("s3fs")
    from _dcp_s3 import moto_s3

    vault, expected = source
    with moto_s3(monkeypatch, tmp_path) as (url, options):
        report = vault.push(url, **options)
        assert report.committed == list(expected)
        assert report.bytes_sent == object_bytes(vault)
        assert vault.push(url, **options).bytes_sent == 0
        remote = Vault(url, **options)
        assert remote.verify().ok
        newest = list(expected)[-1]
        one = Vault(tmp_path / "one").pull(remote, ["latest"])
        assert one.checkpoints == [newest] and one.whole == 0
        back = Vault(tmp_path / "back")
        assert back.pull(url, **options).committed == list(expected)
        assert back.verify().ok
        check_loads(back, expected)
        check_loads(remote, {newest: expected[newest]})
