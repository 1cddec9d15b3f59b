"""The compactor: saves write raw bytes, compaction keeps the newest checkpoint whole and
turns older ones into deltas on their tensors' anchors (whole objects of an older
checkpoint), so any checkpoint reads at most two objects per tensor, safely under
crashes, concurrent loads, gcs and compactors, damaged objects, and vaults of earlier
versions.

The oracles are the tensors themselves (every checkpoint loads bitwise and ``verify``
re-derives every object's blake3), the object files (which frames point where), and for
the forward-delta fixture the SHA-256 PyTorch's bytes had when issue 20's code saved them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("blosc2")

from torch import nn  # noqa: E402

import weightvault._vault.upkeep.compact as compact_module  # noqa: E402
import weightvault._vault.upkeep.policy as policy_module  # noqa: E402
import weightvault._vault.upkeep.records_cache as records_cache  # noqa: E402
import weightvault._vault.upkeep.reencode as reencode_module  # noqa: E402
from _vault_workers import assert_bitwise  # noqa: E402
from test_vault_crash import worker_env  # noqa: E402
from weightvault import Vault  # noqa: E402
from weightvault._vault.objects.frame import HEADER_SIZE, MAGIC, parse_frame_header  # noqa: E402

# These tests poke objects/ by path: packs have their own (test_vault_packs.py).
pytestmark = pytest.mark.usefixtures("loose_saves")

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "delta_vault"
WORKERS = str(HERE / "_compaction_workers.py")
#: No child process or thread is waited on longer than this (seconds).
BOUND = 120


def digests(root: Path, name: str) -> dict[str, str]:
    return json.loads((root / "checkpoints" / f"{name}.json").read_text())["objects"]


def frame(root: Path, digest: str) -> Any:
    """The object's frame header, or ``None`` for raw bytes."""
    head = (root / "objects" / digest[:2] / digest).read_bytes()[:HEADER_SIZE]
    return parse_frame_header(memoryview(head)) if head[:8] == MAGIC else None


def whole(root: Path, digest: str) -> bool:
    """Whether the object is stored whole: raw bytes or a full frame, not a delta."""
    f = frame(root, digest)
    return f is None or f.base is None


def history(
    vault: Vault, saves: int, *, tensors: int = 6, n: int = 1 << 14, resumable: bool = False
) -> list[dict[str, torch.Tensor]]:
    """``saves`` checkpoints of tensors that drift a little each time, as trained weights
    do; returns what each checkpoint holds. ``resumable`` saves an optimizer's state
    too (SGD momentum of ``t0``), as a run one resumes from does: the compactor keeps the
    oldest of those whole, and turns a weights-only oldest into deltas."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(n, generator=g) * 0.02 for i in range(tensors)}
    state["frozen"] = torch.randn(n, generator=g)
    opt = torch.optim.SGD([state["t0"].requires_grad_()], lr=0.0, momentum=0.9)
    out = []
    for _ in range(saves):
        with torch.no_grad():
            for k, v in state.items():
                if k != "frozen":
                    v.add_(torch.randn(n, generator=g) * 1e-5)
        if resumable:
            state["t0"].grad = torch.randn(n, generator=g)
            opt.step()  # lr 0: the weights stay, the momentum changes
            vault.save(state, optimizer=opt)
        else:
            vault.save(state)
        out.append({k: v.detach().clone() for k, v in state.items()})
    return out


class Holder(nn.Module):
    """A module with a zeroed buffer for each tensor of ``like``: what a load fills."""

    def __init__(self, like: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for k, v in like.items():
            self.register_buffer(k, torch.zeros_like(v))


def loads_exactly(vault: Vault, expected: list[dict[str, torch.Tensor]]) -> None:
    """Every checkpoint loads (checksums verified) to exactly what was saved."""
    records = vault.list()
    assert len(records) == len(expected)
    for rec, want in zip(records, expected, strict=True):
        got = Holder(want)
        assert vault.load(got, rec.name).missing == []
        assert_bitwise(dict(got.state_dict()), want)


# -- the layout -----------------------------------------------------------------------------


@pytest.mark.parametrize("resumable", [True, False])
def test_the_newest_and_the_anchors_are_whole_and_the_rest_are_deltas_on_an_anchor(
    tmp_path: Path, resumable: bool
) -> None:
    vault = Vault(tmp_path, delta_chain=2)
    expected = history(vault, 6, resumable=resumable)
    vault.wait()
    names = [r.name for r in vault.list()]

    def kinds() -> list[list[Any]]:
        return [[frame(tmp_path, digests(tmp_path, n)[f"t{i}"]) for n in names] for i in range(6)]

    # The background compactor leaves the newest's new objects raw (a resume copies them)
    # and its marker for later. What it shares with the one before ("frozen", random
    # floats that compress to about 0.9) stays raw too: every resume of either reads it,
    # and compression saves too little of it (test_vault_shared_raw.py).
    assert all(per_tensor[-1] is None for per_tensor in kinds())
    assert compact_module.pending(vault.store) == ["000006"]
    assert frame(tmp_path, digests(tmp_path, "000006")["frozen"]) is None
    loads_exactly(vault, expected)
    vault.compact()  # settles: the newest compressed too
    assert compact_module.pending(vault.store) == []
    for per_tensor in kinds():
        # 1 (the first anchor), 2 and 3 deltas on it (K = 2 deltas on one anchor), 4 (the
        # next anchor), 5 a delta on it, 6 (the newest, whole), resumable or not. Trained
        # weights of about 0.9 stay raw: every read of a delta reads its anchor too.
        assert [f is not None and f.base is not None for f in per_tensor] == [
            False, True, True, False, True, False,
        ]  # fmt: skip
        assert all(f is None for i, f in enumerate(per_tensor) if i in (0, 3, 5))
    for i in range(6):
        t = digests(tmp_path, names[0])[f"t{i}"], digests(tmp_path, names[3])[f"t{i}"]
        bases = [frame(tmp_path, digests(tmp_path, n)[f"t{i}"]).base for n in names[1:5:3]]
        assert bases == [t[0], t[1]]  # each delta on the nearest anchor before it
        assert frame(tmp_path, digests(tmp_path, names[2])[f"t{i}"]).base == t[0]
    # The unchanged tensor is one object for all six, whole.
    assert len({digests(tmp_path, n)["frozen"] for n in names}) == 1
    loads_exactly(vault, expected)
    assert vault.verify().ok


def test_a_load_reads_one_object_per_tensor_from_the_newest_and_an_anchor_and_two_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vault = Vault(tmp_path, delta_chain=3)
    history(vault, 5, tensors=1, resumable=True)
    vault.wait()
    reads: list[str] = []
    real = vault.store.local_path  # every object file a read opens is looked up here
    monkeypatch.setattr(vault.store, "local_path", lambda key: reads.append(key) or real(key))
    opened = {}
    for rec in vault.list():
        reads.clear()
        with vault.open(rec.name) as ckpt:
            ckpt.raw("t0")
        opened[rec.name] = len([k for k in reads if k.startswith("objects/")])
    # The resume and the anchor (the oldest) read one object; K = 3 deltas on the anchor
    # read it and themselves.
    assert opened == {"000001": 1, "000002": 2, "000003": 2, "000004": 2, "000005": 1}


@pytest.mark.parametrize("how", ["retain", "delete"])
def test_a_delta_checkpoint_that_becomes_the_oldest_is_made_whole_again(
    tmp_path: Path, how: str
) -> None:
    vault = Vault(tmp_path, delta_chain=8)
    expected = history(vault, 5, resumable=True)
    vault.compact()
    first, second = digests(tmp_path, "000001"), digests(tmp_path, "000002")
    assert all(frame(tmp_path, second[f"t{i}"]).base is not None for i in range(6))
    if how == "retain":
        assert vault.retain(keep_last=4) == ["000001"]
        assert vault.gc() > 0  # gc compacts first, then frees 000001's objects
    else:
        vault.delete("000001")
        assert vault.compact().damaged == []
    assert [r.name for r in vault.list()] == ["000002", "000003", "000004", "000005"]
    for i in range(6):
        assert whole(tmp_path, second[f"t{i}"]), i
    # The rest stay deltas on the deleted checkpoint's anchor, which stays as their base
    # (rewriting them onto a new anchor would cost a decode and an encode each).
    third = frame(tmp_path, digests(tmp_path, "000003")["t0"])
    assert third.base == first["t0"] and (tmp_path / "objects" / first["t0"][:2]).exists()
    loads_exactly(vault, expected[1:])
    assert vault.verify().ok
    again = vault.compact()  # nothing left: the oldest is whole
    assert again.full == 0 and again.deltas == 0


def test_a_damaged_delta_that_becomes_the_oldest_is_reported_and_left(tmp_path: Path) -> None:
    vault = Vault(tmp_path, delta_chain=8, compaction=None)  # this thread's compact() finds it
    history(vault, 4, resumable=True)
    vault.compact()
    vault.delete("000001")
    victim = tmp_path / "objects" / digests(tmp_path, "000002")["t3"][:2]
    path = victim / digests(tmp_path, "000002")["t3"]
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    report = vault.compact()
    assert len(report.damaged) == 1 and "000002: t3" in report.damaged[0]
    assert path.read_bytes() == bytes(data)  # left as it was found
    assert whole(tmp_path, digests(tmp_path, "000002")["t0"])  # the others were made whole


def test_saves_write_raw_and_log_shows_what_is_not_compacted(tmp_path: Path) -> None:
    from weightvault._cli.app import main as cli

    vault = Vault(tmp_path, compaction=None)
    history(vault, 3, tensors=2, resumable=True)
    assert all(frame(tmp_path, d) is None for d in digests(tmp_path, "000002").values())
    assert sorted(compact_module.pending(vault.store)) == ["000001", "000002", "000003"]
    out = tmp_path / "log.txt"
    with out.open("w") as f:
        import contextlib

        with contextlib.redirect_stdout(f):
            assert cli(["vault", str(tmp_path), "log"]) == 0
    text = out.read_text()
    assert "~ not compacted yet" in text and text.count("~  ") + text.count("~ ") >= 2
    # A new process picks the work up: gc compacts first.
    Vault(tmp_path).gc()
    assert compact_module.pending(vault.store) == []
    assert frame(tmp_path, digests(tmp_path, "000002")["t0"]).base is not None
    assert whole(tmp_path, digests(tmp_path, "000001")["t0"])  # the oldest: the anchor


def test_wait_and_the_context_manager_wait_for_the_compactor(tmp_path: Path) -> None:
    with Vault(tmp_path) as vault:
        history(vault, 3, tensors=2)
    assert compact_module.pending(vault.store) == ["000003"]  # the newest, left raw
    vault.save({"t0": torch.ones(1 << 14)})
    reports = vault.wait()
    assert reports and "000003" in [n for r in reports for n in r.checkpoints]
    assert compact_module.pending(vault.store) == ["000004"]
    with pytest.raises(ValueError, match="compaction='soon'"):
        Vault(tmp_path, compaction="soon")


def test_the_compactor_yields_while_a_save_or_load_runs(tmp_path: Path) -> None:
    """The pause it is given blocks while this Vault saves or loads."""
    vault = Vault(tmp_path, compaction=None)
    compactor = vault._compactor
    entered, release = threading.Event(), threading.Event()
    passed: list[float] = []

    def work(pause: Any, stop: Any) -> Any:
        entered.set()
        pause()
        passed.append(time.monotonic())
        return compact_module.CompactReport()

    compactor._work = work
    with compactor.busy():
        compactor.kick()
        assert entered.wait(BOUND)
        time.sleep(0.2)
        assert passed == []  # held back while "the save" runs
        left = time.monotonic()
        release.set()
    compactor.wait()
    assert passed and passed[0] >= left


# -- training state ---------------------------------------------------------------------------


def _train(vault: Vault, saves: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(saves):
        model(torch.randn(8, 128)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        vault.save(model, optimizer=opt)


def _files(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (root / "objects").rglob("*") if p.is_file()}


def test_retain_afterwards_leaves_the_disk_of_the_vault_option(tmp_path: Path) -> None:
    """retain(training_state_last=1) after the run frees what Vault(training_state_last=1)
    never kept: training state is never a delta, so no kept object is built on dropped
    state."""
    option = Vault(tmp_path / "option", training_state_last=1)
    _train(option, 5)
    option.wait()
    option.gc()
    later = Vault(tmp_path / "later")
    _train(later, 5)
    later.wait()
    later.retain(training_state_last=1)
    later.gc()
    assert _files(tmp_path / "later") == _files(tmp_path / "option")
    assert [r.weights_only for r in later.list()] == [True] * 4 + [False]
    # The oldest is the anchor the deltas after it point at: whole, weights only or not.
    for root in (tmp_path / "later", tmp_path / "option"):
        oldest, second = digests(root, "000001"), digests(root, "000002")
        for n in ("0.weight", "2.weight"):
            assert whole(root, oldest[n]) and frame(root, second[n]).base == oldest[n]
    assert later.verify().ok and option.verify().ok


def test_a_weights_only_oldest_is_looked_at_again_only_when_a_retain_marked_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retain that drops the oldest's training state marks it; only that pass looks at
    turning it into deltas (here it stays whole: the anchor of the deltas after it).
    Later passes leave it alone: an object whose delta does not pay would otherwise be
    decoded and hashed again by every one of them."""
    vault = Vault(tmp_path, compaction=None)
    expected = history(vault, 3, tensors=2, resumable=True)
    vault.compact()
    assert whole(tmp_path, digests(tmp_path, "000001")["t0"])  # resumable: whole
    calls: list[str] = []
    real = policy_module.delta_oldest
    monkeypatch.setattr(policy_module, "delta_oldest", lambda *a: calls.append(a[2]) or real(*a))
    vault.retain(training_state_last=1)
    assert compact_module.pending(vault.store) == ["000001"]
    vault.compact()
    assert calls == ["000001"]
    assert whole(tmp_path, digests(tmp_path, "000001")["t0"])  # the anchor of 000002
    vault.save({k: v.detach() + 1e-5 for k, v in expected[-1].items()})
    vault.compact()
    assert calls == ["000001"]  # not looked at again
    loads_exactly(vault, [*expected, {k: v + 1e-5 for k, v in expected[-1].items()}])
    assert vault.verify().ok


def test_a_pass_orders_the_checkpoints_from_record_starts_and_reads_few_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each pass ordered the checkpoints by reading every record whole: 52 ms a pass at
    300 records of 85 KB (docs/benchmarks.md, section 26). It reads their starts now, and
    whole only the records whose tensors it handles; the order is what the records say
    (the oracle: ``list()``, which reads each one whole)."""
    whole: list[str] = []
    real = records_cache.read_doc

    def counted(store: Any, name: str) -> Any:
        whole.append(name)
        return real(store, name)

    monkeypatch.setattr(records_cache, "read_doc", counted)
    vault = Vault(tmp_path, delta_chain=2)
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(1 << 12, generator=g) for i in range(3)}
    reads: dict[int, int] = {}
    for n in range(1, 15):
        state = {k: v + torch.randn(v.shape, generator=g) * 1e-4 for k, v in state.items()}
        whole.clear()
        vault.save(state)
        vault.wait()
        reads[n] = len(whole)
    # The records back to the anchor (K = 2 deltas on it), the ends, the newest: bounded
    # by K, not by the vault's length.
    assert max(reads.values()) <= 7, sorted(reads.items())
    assert records_cache.Records(vault.store).names == [r.name for r in vault.list()]
    got = Holder(state)
    vault.load(got)
    assert_bitwise(dict(got.state_dict()), state)
    assert vault.verify().ok


@pytest.mark.parametrize("damage", ["past its start", "at its start"])
def test_a_damaged_record_is_left_and_the_others_compact(tmp_path: Path, damage: str) -> None:
    """A record cut short past its start is still ordered by it, one damaged at its start
    is left out; either way its own objects stay, no pass fails, every other checkpoint
    loads bitwise and verify reports the damaged one."""
    vault = Vault(tmp_path)
    expected = history(vault, 3, tensors=2)
    vault.wait()
    path = tmp_path / "checkpoints" / "000003.json"  # the newest, still to compact
    text = path.read_text()
    path.write_text(text[: len(text) // 2] if damage == "past its start" else "not json")
    later = {k: v + 1e-5 for k, v in expected[-1].items()}
    vault.save(later)
    vault.wait()
    vault.compact()
    for name, want in (("000001", expected[0]), ("000002", expected[1]), ("000004", later)):
        got = Holder(want)
        vault.load(got, name)
        assert_bitwise(dict(got.state_dict()), want)
    report = vault.verify()
    assert not report.ok and "000003" in str(report.problems)


# -- damage, crashes and concurrency -------------------------------------------------------------


def test_a_damaged_object_is_reported_and_left_as_it_is(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compaction=None)
    history(vault, 3, tensors=2)
    bad = tmp_path / "objects" / digests(tmp_path, "000002")["t1"][:2]
    bad = bad / digests(tmp_path, "000002")["t1"]
    data = bytearray(bad.read_bytes())
    data[100] ^= 0x40
    bad.write_bytes(bytes(data))
    report = vault.compact()
    assert len(report.damaged) == 1 and bad.name in report.damaged[0]
    assert "000002: t1" in report.damaged[0]
    assert bad.read_bytes() == bytes(data)  # left exactly as found
    assert frame(tmp_path, digests(tmp_path, "000002")["t0"]).base is not None  # the rest done
    problems = vault.verify().problems
    assert len(problems) == 1 and "t1" in problems[0]


def test_an_object_a_gc_freed_meanwhile_is_not_reported_as_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retention deletes a checkpoint, or drops its training state, while the compactor
    works on it, and a gc frees the objects only that checkpoint named: gone, not damaged
    (the mirror of a Trainer run logged such warnings for every tensor of one checkpoint)."""
    vault = Vault(tmp_path, compaction=None)
    history(vault, 3, tensors=2)
    gone = digests(tmp_path, "000002")["t1"]
    real = reencode_module.read_object

    def freed(store: Any, digest: str, nbytes: int, **options: Any) -> Any:
        if digest == gone:
            raise FileNotFoundError(digest)  # what a gc that freed it leaves a reader
        return real(store, digest, nbytes, **options)

    monkeypatch.setattr(reencode_module, "read_object", freed)
    report = vault.compact()
    assert report.damaged == []
    assert frame(tmp_path, digests(tmp_path, "000002")["t0"]).base is not None  # the rest done
    monkeypatch.undo()
    loads_exactly(vault, history(Vault(tmp_path / "again", compaction=None), 3, tensors=2))


def _compact_child(root: Path, delay: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKERS, "compact", str(root), str(delay)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(),
    )  # fmt: skip


def test_sigkill_during_compaction_loses_nothing(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compaction=None, delta_chain=2)
    expected = history(vault, 6, tensors=8)
    for k in range(12):
        if not compact_module.pending(vault.store):
            break
        child = _compact_child(tmp_path, 0.01)
        time.sleep(0.6 + 0.15 * k)  # the import takes about half a second
        child.kill()
        child.wait(BOUND)
        loads_exactly(vault, expected)  # every checkpoint, verified, after every kill
        report = vault.verify()
        assert report.ok, report.problems
    vault.compact()  # what the kills left is picked up
    assert compact_module.pending(vault.store) == []
    loads_exactly(vault, expected)
    assert vault.verify().ok
    kept = {k: v for k, v in _files(tmp_path).items() if not k.startswith(".")}
    # The oldest and the newest whole and raw (they compress too little), the rest
    # deltas on a whole object (an anchor) of an older checkpoint. The children compact
    # with the default K, so which ones are anchors depends on where the kills fell.
    ends = {d for n in ("000001", "000006") for d in digests(tmp_path, n).values()}
    assert all(frame(tmp_path, d) is None for d in ends)
    for d in kept:
        f = frame(tmp_path, d)
        assert f is None or (f.base is not None and frame(tmp_path, f.base) is None), d
    assert sum(kept.values()) < 0.75 * (6 * 8 + 1) * (1 << 16)


def compact_in_two_processes(root: Path) -> list[str]:
    """Two child processes compacting the vault at ``root`` at once; what each printed."""
    children = [_compact_child(root, 0.002) for _ in range(2)]
    outs = [c.communicate(timeout=BOUND) for c in children]
    assert [c.returncode for c in children] == [0, 0], outs
    return [o for o, _ in outs]


def test_two_processes_compacting_lose_nothing(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compaction=None)
    expected = history(vault, 5, tensors=8)
    said = [o.strip().split() for o in compact_in_two_processes(tmp_path)]
    # One compacted everything, or one found the other at work (busy) and left it.
    assert sum(int(s[1]) for s in said) == 5
    assert compact_module.pending(vault.store) == []
    loads_exactly(vault, expected)
    assert vault.verify().ok


def loads_and_gcs_during_compaction(root: Path, writer: Vault, expected: list[Any]) -> Vault:
    """Compact ``writer``'s vault in a thread while another ``Vault`` on ``root`` loads
    every checkpoint and runs gc in a loop; that reader, once all has passed."""
    done = threading.Event()
    errors: list[BaseException] = []

    def compact() -> None:
        try:
            compact_module.compact(writer.store, writer.storage, pause=lambda: time.sleep(0.003))
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=compact)
    thread.start()
    reader = Vault(root)
    rounds = 0
    while not done.is_set() or rounds == 0:
        loads_exactly(reader, expected)
        reader.gc()  # finds the compactor busy, collects what no checkpoint needs
        rounds += 1
    thread.join(BOUND)
    assert not thread.is_alive() and not errors and rounds >= 1
    loads_exactly(reader, expected)
    assert reader.verify().ok
    return reader


def test_loads_and_gc_during_compaction_succeed(tmp_path: Path) -> None:
    writer = Vault(tmp_path, compaction=None)
    expected = history(writer, 5, tensors=8)
    writer.delete("000003")
    del expected[2]
    loads_and_gcs_during_compaction(tmp_path, writer, expected)


# -- vaults of earlier versions -------------------------------------------------------------------


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def _fixture_check(vault: Vault) -> None:
    expected = json.loads(FIXTURE.with_name("delta_vault.expected.json").read_text())
    for name, want in expected.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        vault.load(model, name, optimizer=opt)
        got = {f"model/{k}": _sha(v) for k, v in model.state_dict().items()}
        for i, st in opt.state_dict()["state"].items():
            got.update({f"optim/{i}/{k}": _sha(v) for k, v in st.items()})
        assert got == want, name


def test_a_forward_delta_vault_of_issue_20_loads_bitwise_and_compacts(tmp_path: Path) -> None:
    root = tmp_path / "old"
    shutil.copytree(FIXTURE, root)
    vault = Vault(root)
    assert any(  # the fixture does hold forward chains: newer objects on older bases
        (f := frame(root, d)) is not None and f.version == 1 and f.base is not None
        for d in digests(root, "000006").values()
    ) or any(
        (f := frame(root, d)) is not None and f.version == 1 and f.base is not None
        for d in digests(root, "000005").values()
    )
    assert vault.verify().ok
    _fixture_check(vault)
    # New saves into it, compacted: the old checkpoints still load bitwise.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
    with torch.no_grad():
        model[0].weight.add_(1e-4)
    vault.save(model)
    vault.wait()
    assert vault.gc() >= 0
    _fixture_check(vault)
    assert vault.verify().ok


def test_the_end_of_training_settles_quietly_and_a_run_that_saved_nothing_stays_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from weightvault.integrations._common import settle

    with caplog.at_level(logging.WARNING, logger="weightvault"):
        settle(Vault(tmp_path / "never"))  # a run whose loop never saved
        vault = Vault(tmp_path / "run")
        history(vault, 2, tensors=1)
        settle(vault)
    assert not (tmp_path / "never").exists()
    assert compact_module.pending(vault.store) == []  # the newest settled too
    assert whole(tmp_path / "run", digests(tmp_path / "run", "000002")["t0"])
    assert [r.getMessage() for r in caplog.records] == []
