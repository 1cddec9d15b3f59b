"""The vault against hostile names, damaged records, and a gc that stalls or dies.

Names: a string that becomes a path must never reach outside the vault, whichever entry
point it comes through. Records: a damaged record is reported, never a crash. gc: one
stalled far past its staleness window (a real process, SIGSTOPped) or killed (SIGKILL)
never costs a committed checkpoint an object, and a dead gc's marker stops blocking saves.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _records import read as read_record, seal  # noqa: E402
from _vault_workers import assert_bitwise, build, snapshot  # noqa: E402
from weightvault import CheckpointNameError, FormatError, Vault, WeightvaultError  # noqa: E402
from weightvault._cli.app import main  # noqa: E402
from weightvault._vault.store import lease as _gc  # noqa: E402
from weightvault._vault.store.backend import check_key  # noqa: E402

# These tests poke objects/ by path: packs have their own (test_vault_packs.py).
pytestmark = pytest.mark.usefixtures("loose_saves")

WORKERS = str(Path(__file__).with_name("_vault_workers.py"))


def run(*argv: str) -> tuple[int, str]:
    """The CLI in this process: an exception it lets escape (a traceback) fails the test."""
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def fresh(width: int = 64) -> Any:
    return build(-1, backbone_seed=-1, width=width)


def loads_exactly(vault: Vault, name: str, expected: Any, width: int = 64) -> None:
    model = fresh(width)
    vault.load(model, name, verify=True)
    assert_bitwise(snapshot(model), snapshot(expected))


def object_files(root: Path) -> set[str]:
    out = set()
    for _, _, files in os.walk(root / "objects"):
        out |= {f for f in files if not f.startswith(".")}
    return out


def trash_files(root: Path) -> list[str]:
    return [f for _, _, files in os.walk(root / "trash") for f in files]


# -- names --------------------------------------------------------------------------------


@pytest.fixture
def neighbours(tmp_path: Path) -> tuple[Path, Path]:
    """Two vaults side by side, A and B, one checkpoint each."""
    for letter in "AB":
        Vault(tmp_path / letter).save(build(ord(letter), width=32))
    return tmp_path / "A", tmp_path / "B"


ESCAPE = "../../B/checkpoints/000001"  # from A/checkpoints/ to B's first checkpoint


def test_rm_through_a_name_cannot_delete_another_vaults_checkpoint(
    neighbours: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = neighbours
    code, _ = run("vault", str(a), "rm", ESCAPE)
    assert code == 5  # refused: the name is invalid, nothing was unreadable
    assert "not allowed" in capsys.readouterr().err
    assert (b / "checkpoints" / "000001.json").exists()
    with pytest.raises(CheckpointNameError, match=r"\.\./\.\./B"):
        Vault(a).delete(ESCAPE)
    vault_b = Vault(b)
    assert [r.name for r in vault_b.list()] == ["000001"]
    assert vault_b.save(build(7, width=32)).name == "000002"  # 000001 is never handed out
    assert [r.name for r in Vault(a).list()] == ["000001"]


@pytest.mark.parametrize(
    "call",
    [
        lambda v, n: v.delete(n),
        lambda v, n: v.open(n),
        lambda v, n: v.load(fresh(32), n),
        lambda v, n: v.export(n, os.devnull),
    ],
    ids=["delete", "open", "load", "export"],
)
@pytest.mark.parametrize("name", [ESCAPE, "000001\n", "/etc/passwd", "a\\b", "", "x" * 129])
def test_every_entry_point_checks_names(
    neighbours: tuple[Path, Path], call: Any, name: str
) -> None:
    a, b = neighbours
    before = sorted(p.name for p in (b / "checkpoints").iterdir())
    with pytest.raises(CheckpointNameError, match="not allowed"):
        call(Vault(a), name)
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == before


@pytest.mark.parametrize(
    "argv",
    [
        ["show", ESCAPE],
        ["diff", "000001", ESCAPE],
        ["export", ESCAPE, "out.safetensors"],
        ["rm", "000001", ESCAPE],
    ],
)
def test_cli_verbs_refuse_bad_names_without_a_traceback(
    neighbours: tuple[Path, Path], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = neighbours
    code, _ = run("vault", str(a), *argv)
    assert code == 5
    err = capsys.readouterr().err
    assert "not allowed" in err and "Traceback" not in err


def test_a_trailing_newline_is_not_a_name(tmp_path: Path) -> None:
    """``re.match`` with ``$`` accepted "a\\n" (``$`` matches before a final newline)."""
    vault = Vault(tmp_path)
    with pytest.raises(CheckpointNameError, match=r"'a\\n'"):
        vault.save(build(1, width=16), "a\n")
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
    vault.save(build(1, width=16), "a")
    with pytest.raises(CheckpointNameError):
        vault.open("a\n")
    assert isinstance(CheckpointNameError("x"), ValueError)


def test_files_save_could_not_have_made_are_not_checkpoints(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    model = build(1, width=16)
    vault.save(model)
    (tmp_path / "checkpoints" / "sub").mkdir()
    (tmp_path / "checkpoints" / "sub" / "x.json").write_text("{}")
    (tmp_path / "checkpoints" / "a b.json").write_text("{}")
    (tmp_path / "deleted").mkdir()
    (tmp_path / "deleted" / "\N{SUPERSCRIPT TWO}.json").write_text("{}")  # "²".isdigit()
    assert [r.name for r in vault.list()] == ["000001"]
    assert vault.verify().ok
    assert vault.save(build(2, width=16)).name == "000002"
    vault.gc()
    loads_exactly(vault, "000001", model, width=16)


def test_the_records_are_listed_as_a_full_listing_sees_them(tmp_path: Path) -> None:
    """Records are listed with one scandir, no walk and no stat per file (2.9 against 0.2
    ms for 300 records, every save and resume); it must see what the walk sees (the
    oracle: ``Store.list``, through the base class's ``children``)."""
    from weightvault._vault.store.backend import Store

    vault = Vault(tmp_path)
    vault.save(build(1, width=16))
    vault.save(build(2, width=16))
    folder = tmp_path / "checkpoints"
    (folder / "sub").mkdir()
    (folder / "sub" / "000009.json").write_text("{}")  # nested: not a child
    os.symlink(folder / "000001.json", folder / "000003.json")  # a link to a record
    os.symlink(tmp_path / "nowhere", folder / "000004.json")  # a broken link
    os.symlink(folder / "sub", folder / "000005.json")  # a link to a folder
    os.mkfifo(folder / "000006.json")  # neither a file nor a folder
    store = vault.store
    seen = store.children("checkpoints")
    assert seen == Store.children(store, "checkpoints")
    assert [k.rsplit("/", 1)[1] for k in seen] == [
        "000001.json", "000002.json", "000003.json", "000006.json",
    ]  # fmt: skip
    assert store.children("nothing-here") == [] == Store.children(store, "nothing-here")
    (folder / "000006.json").unlink()  # opening a fifo would wait for a writer
    (folder / "000005.json").unlink()
    assert [r.name for r in vault.list()] == ["000001", "000003", "000002"]  # 3 is 1: its time


@pytest.mark.parametrize("key", ["../x", "objects/../../x", "/abs", "a//b", "a/./b", "a\\b", "a\0"])
def test_the_store_refuses_keys_that_leave_the_root(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="leave the vault's root"):
        check_key(key)
    with pytest.raises(ValueError, match="leave the vault's root"):
        Vault(tmp_path).store.get(key)


# -- damaged records ----------------------------------------------------------------------


def _damage(doc: dict[str, Any], how: str) -> str:
    """The record's text after damage ``how``; some damage only exists as JSON text."""
    if how == "logical_bytes 1e400":
        return json.dumps(doc).replace(
            f'"logical_bytes": {doc["logical_bytes"]}', '"logical_bytes": 1e400'
        )
    edits: dict[str, Any] = {
        "header []": ("header", "[]"),
        "header of numbers": ("header", '{"w": 1}'),
        "header offsets huge": (
            "header",
            '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1e300]}}',
        ),
        "created 1e20": ("created", 1e20),
        "created negative": ("created", -5.0),
        "created a string": ("created", "yesterday"),
        "tensors true": ("tensors", True),
        "new_bytes negative": ("new_bytes", -1),
        "stored_bytes a float": ("stored_bytes", 3.5),
        "metadata a list": ("metadata", ["a", "b"]),
        "metadata of numbers": ("metadata", {"step": 1}),
        "framework a number": ("framework", 5),
        "objects a list": ("objects", []),
    }
    if how == "created missing":
        del doc["created"]
    elif how == "version true":
        doc["version"] = True
    else:
        key, value = edits[how]
        doc[key] = value
    return json.dumps(doc)


DAMAGE = [
    "header []",
    "header of numbers",
    "header offsets huge",
    "logical_bytes 1e400",
    "created 1e20",
    "created negative",
    "created a string",
    "created missing",
    "tensors true",
    "new_bytes negative",
    "stored_bytes a float",
    "metadata a list",
    "metadata of numbers",
    "framework a number",
    "objects a list",
    "version true",
]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_record_is_reported_never_raised(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    vault = Vault(tmp_path)
    vault.save(build(1, width=32))
    second = build(2, width=32)
    vault.save(second)
    path = tmp_path / "checkpoints" / "000001.json"
    path.write_text(seal(_damage(read_record(path), how)))  # sealed: the field's check is reached

    report = vault.verify()
    assert not report.ok
    assert len(report.problems) == 1 and report.problems[0].startswith("000001: record")

    with pytest.raises(FormatError, match="000001"):
        vault.open("000001")
    # list() reads the record's fields, not its header or objects.
    in_fields = not how.startswith(("header", "objects"))
    if in_fields:
        with pytest.raises(FormatError, match="000001"):
            vault.list()
    else:
        assert [r.name for r in vault.list()] == ["000001", "000002"]
    loads_exactly(vault, "000002", second, width=32)  # the other checkpoint is unaffected

    # The CLI names the record and exits 3 (1 for verify); no traceback escapes main().
    assert run("vault", str(tmp_path), "verify")[0] == 1
    assert run("vault", str(tmp_path), "log")[0] == (3 if in_fields else 0)
    for verb in (["show", "000001"], ["export", "000001", str(tmp_path / "x")]):
        code, _ = run("vault", str(tmp_path), *verb)
        assert code == 3, verb
    err = capsys.readouterr().err
    assert "000001" in err and "Traceback" not in err

    # A damaged record can still be removed, after which everything is healthy again.
    vault.delete("000001")
    assert vault.verify().ok
    vault.gc()
    loads_exactly(vault, "000002", second, width=32)


def test_a_folder_where_a_record_belongs_is_refused_not_crashed_on(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    vault.save(build(1, width=16))
    (tmp_path / "checkpoints" / "000002.json").mkdir()
    with pytest.raises(FormatError, match=r"000002\.json: checkpoint record is a folder"):
        vault.open("000002")
    assert vault.verify().ok  # not a checkpoint: only files are


# -- gc stalled or killed -----------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [src, env.get("PYTHONPATH")] if p)
    return env


def _stopped_gc(root: Path, stale: float, when: str) -> subprocess.Popen[str]:
    """A real gc process that has stopped itself (SIGSTOP) around its first object move."""
    proc = subprocess.Popen(
        [sys.executable, WORKERS, "gc-stop", str(root), str(stale), when],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "stopping", proc.communicate(timeout=30)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the gc did not stop"
        time.sleep(0.01)
    return proc


def _unreferenced_vault(root: Path, models: list[Any]) -> Vault:
    """A vault holding the objects of ``models`` with no checkpoint naming them."""
    vault = Vault(root)
    for model in models:
        vault.save(model)
    for record in vault.list():
        vault.delete(record.name)
    return vault


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states")
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_gc_stalled_past_its_staleness_window_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """gc picks every object to delete, then stalls (SIGSTOP) past the window in which its
    marker counts as alive; saves meanwhile reuse those objects and commit. Resumed, gc
    must delete none of them (the old gc deleted all, and every checkpoint lost objects)."""
    stale = 1.0
    monkeypatch.setattr(_gc, "GC_STALE_SECONDS", stale)
    root = tmp_path / "v"
    models = [build(seed, width=64) for seed in range(3)]
    vault = _unreferenced_vault(root, models)
    gc = _stopped_gc(root, stale, when)
    try:
        time.sleep(stale * 1.5)  # the marker's heartbeat is now stale: saves stop waiting
        started = time.monotonic()
        records = [vault.save(m) for m in models]
        assert time.monotonic() - started < 20
        assert sum(r.new_bytes for r in records) < sum(r.stored_bytes for r in records)
        for record, model in zip(records, models, strict=True):
            loads_exactly(vault, record.name, model)  # readable during the stall too
        os.kill(gc.pid, signal.SIGCONT)
        out, err = gc.communicate(timeout=120)
    finally:
        if gc.poll() is None:
            gc.kill()
            gc.communicate()
    assert gc.returncode == 0, err
    assert out.split() == ["freed", "0"]  # everything it had picked is needed again

    report = Vault(root).verify()
    assert report.ok, report.problems
    for record, model in zip(records, models, strict=True):
        loads_exactly(Vault(root), record.name, model)
    assert trash_files(root) == [] and not list((root / "gc").iterdir())


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states")
def test_a_killed_gc_neither_stalls_saves_nor_loses_its_trash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc moved one object into its trash and was SIGKILLed. On this machine its marker is
    seen dead at once (its pid is gone), not after the staleness window; break_gc_lock
    puts its trash back and removes the marker."""
    monkeypatch.setattr(_gc, "GC_STALE_SECONDS", 30.0)
    root = tmp_path / "v"
    kept, gone = build(1, width=64), build(2, width=64)
    vault = Vault(root)
    vault.save(kept)
    vault.save(gone)
    vault.delete("000002")
    gc = _stopped_gc(root, 30.0, "after")
    gc.kill()
    gc.communicate(timeout=30)
    left = [f"gc/{p.name}" for p in (root / "gc").iterdir()]
    assert len(left) == 1

    started = time.monotonic()
    record = Vault(root, gc_wait=5).save(gone)  # the old code waited out gc_wait, then raised
    assert time.monotonic() - started < 4
    loads_exactly(vault, record.name, gone)

    assert len(trash_files(root)) == 1  # what the killed gc had moved, still there
    assert vault.break_gc_lock() == left
    assert trash_files(root) == [] and not list((root / "gc").iterdir())
    assert vault.verify().ok
    vault.gc()
    for name, model in (("000001", kept), (record.name, gone)):
        loads_exactly(vault, name, model)


def _marker(root: Path, *, age: float, pid: int, host: str) -> Path:
    path = root / "gc" / "other.json"
    path.parent.mkdir(exist_ok=True)
    started = _gc.process_start(pid) if host == socket.gethostname() else None
    path.write_text(
        json.dumps({"created": time.time() - age, "pid": pid, "host": host, "started": started})
    )
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_an_object_in_a_dead_gcs_trash_is_read_then_put_back(tmp_path: Path) -> None:
    """As left by a gc killed between moving an object and re-reading the checkpoints."""
    vault = Vault(tmp_path)
    model = build(1, width=32)
    vault.save(model)
    vault.wait()  # compacted: the object moved below stays as it is
    digest = json.loads((tmp_path / "checkpoints" / "000001.json").read_text())["objects"][
        "head.weight"
    ]
    trash = tmp_path / "trash" / "deadgc" / digest
    trash.parent.mkdir(parents=True)
    (tmp_path / "objects" / digest[:2] / digest).rename(trash)

    loads_exactly(vault, "000001", model, width=32)
    assert vault.verify().ok
    with vault.open("000001") as ckpt:
        assert ckpt.missing() == {}
    assert vault.gc() == 0
    assert not trash.exists() and digest in object_files(tmp_path)
    assert vault.verify().ok


def test_a_save_waiting_for_a_gc_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    vault = Vault(tmp_path, gc_wait=0.3)
    # Another live process of this host (this process's own gc is not waited for).
    marker = _marker(tmp_path, age=0, pid=os.getppid(), host=socket.gethostname())
    with (
        caplog.at_level(logging.WARNING, logger="weightvault"),
        pytest.raises(WeightvaultError, match="--break-lock"),
    ):
        vault.save(build(1, width=16))
    waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert len(waits) == 1 and "gc/other.json" in waits[0] and "0 s" in waits[0]
    assert marker.exists()


def test_break_gc_lock_refuses_a_gc_that_may_be_running(tmp_path: Path) -> None:
    vault = Vault(tmp_path)
    vault.save(build(1, width=16))
    # Another machine's marker with a fresh heartbeat: nothing can prove that gc dead.
    marker = _marker(tmp_path, age=0, pid=1, host="elsewhere.invalid")
    (tmp_path / "trash" / "other").mkdir(parents=True)
    with pytest.raises(WeightvaultError, match=r"gc/other\.json: a gc may still be running"):
        vault.break_gc_lock()
    code, _ = run("vault", str(tmp_path), "gc", "--break-lock")
    assert code == 5 and marker.exists()  # refused while the other gc may be alive

    # The same marker once its heartbeat is older than the window: broken, gc then runs.
    old = time.time() - _gc.GC_STALE_SECONDS - 1
    os.utime(marker, (old, old))
    code, out = run("vault", str(tmp_path), "gc", "--break-lock", "--json")
    assert code == 0 and json.loads(out)["broken_locks"] == ["gc/other.json"]
    assert not marker.exists()
    assert vault.break_gc_lock() == []
