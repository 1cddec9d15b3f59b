"""Marking the best checkpoint: ``Vault.mark``, ``unmark``, ``marks`` and ``"best"``."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault.torch as wv  # noqa: E402
from _records import read, rewrite  # noqa: E402
from weightvault._cli.app import main  # noqa: E402
from weightvault._vault.records import marks as marks_module  # noqa: E402


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    wv.freeze(m, "0")
    return m


def train(vault: weightvault.Vault, m: nn.Module, n: int, **save: Any) -> list[str]:
    """``n`` checkpoints, each with a different head."""
    names = []
    for _ in range(n):
        with torch.no_grad():
            m[1].weight.add_(torch.randn_like(m[1].weight))
        names.append(vault.save(m, **save).name)
    return names


def record(root: Path, name: str) -> dict[str, Any]:
    return read(root / "checkpoints" / f"{name}.json")


@pytest.fixture
def run(tmp_path: Path) -> tuple[weightvault.Vault, nn.Module, list[str]]:
    vault = weightvault.Vault(tmp_path / "v", compaction=None)
    m = model()
    return vault, m, train(vault, m, 4)


def test_mark_moves_the_label_and_unmark_takes_it_off(run, tmp_path):
    vault, _, names = run
    root = tmp_path / "v"
    assert vault.marks() == {}
    vault.mark(names[1])
    assert vault.marks() == {"best": names[1]}
    assert [r.labels for r in vault.list()] == [(), ("best",), (), ()]
    vault.mark(names[2], "best")
    assert vault.marks() == {"best": names[2]}
    assert "labels" not in record(root, names[1])  # taken off, the field with it
    assert list(record(root, names[2])["labels"]) == ["best"]
    vault.mark(names[2])  # marked already: nothing is rewritten
    assert vault.unmark() == names[2]
    assert vault.marks() == {} and vault.unmark() is None
    assert all(r.labels == () for r in vault.list())
    vault.mark("latest")
    assert vault.marks() == {"best": names[-1]}
    with pytest.raises(ValueError, match="is not a label; the labels are best"):
        vault.mark(names[0], "worst")
    with pytest.raises(weightvault.CheckpointNotFoundError, match="no checkpoint named 'nope'"):
        vault.mark("nope")


def test_best_resolves_opens_and_loads_bitwise(run, tmp_path):
    vault, _, names = run
    vault.mark(names[1])
    assert vault.resolve("best") == names[1]
    with vault.open("best") as ckpt:
        assert ckpt.record.name == names[1]
    by_label, by_name = model(), model()
    with torch.no_grad():
        for p in [*by_label.parameters(), *by_name.parameters()]:
            p.zero_()
    vault.load(by_label, "best")
    vault.load(by_name, names[1])
    for (n, a), b in zip(by_label.state_dict().items(), by_name.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert vault.export("best", tmp_path / "best.safetensors") > 0
    assert weightvault.diff(tmp_path / "best.safetensors", vault.open(names[1])).identical


def test_best_without_a_mark_names_the_marks_and_the_fix(run):
    vault, m, _ = run
    with pytest.raises(weightvault.CheckpointNotFoundError) as e:
        vault.load(m, "best")
    text = str(e.value)
    assert "it has no checkpoint marked 'best'; marks: none" in text
    assert "vault.mark(name, 'best')" in text


def test_best_is_no_new_name_and_an_old_checkpoint_named_best_still_reads(run, tmp_path):
    vault, m, names = run
    with pytest.raises(weightvault.CheckpointNameError, match="'best' is a label"):
        vault.save(m, "best")
    # A checkpoint saved as "best" before labels existed: its record under that name.
    root = tmp_path / "v"
    (root / "checkpoints" / f"{names[0]}.json").rename(root / "checkpoints" / "best.json")
    assert vault.resolve("best") == "best"  # no mark: the old checkpoint stands for it
    assert "best" in [r.name for r in vault.list()]
    vault.mark(names[2])
    assert vault.resolve("best") == names[2]  # a mark wins
    vault.delete("best")  # deleted by its name, as before
    assert "best" not in [r.name for r in vault.list()]
    assert vault.resolve("best") == names[2]


def test_retain_keeps_the_marked_checkpoint_and_delete_removes_it(run):
    vault, _, names = run
    vault.mark(names[0])
    assert vault.retain(keep_last=1) == names[1:3]
    assert [r.name for r in vault.list()] == [names[0], names[3]]
    vault.delete(names[0])  # by name: it goes
    assert vault.marks() == {}
    assert vault.retain(keep_last=1) == []


def test_training_state_last_drops_the_state_and_keeps_the_mark(tmp_path):
    vault = weightvault.Vault(tmp_path / "v", compaction=None)
    m = model()
    opt = torch.optim.SGD(wv.trainable(m), lr=0.1, momentum=0.9)
    names = []
    for _ in range(3):
        m(torch.randn(2, 32)).sum().backward()
        opt.step()
        names.append(vault.save(m, optimizer=opt).name)
    vault.mark(names[0])
    vault.retain(training_state_last=1)
    (first,) = [r for r in vault.list() if r.name == names[0]]
    assert first.weights_only and first.labels == ("best",)
    assert vault.marks() == {"best": names[0]}
    fresh = model()
    vault.load(fresh, "best")  # the weights stay
    with pytest.raises(weightvault.TrainingStateError):
        vault.load(fresh, "best", optimizer=torch.optim.SGD(wv.trainable(fresh), lr=0.1))


def test_a_crash_between_the_two_writes_leaves_the_new_mark(run, tmp_path, monkeypatch):
    vault, _, names = run
    vault.mark(names[3])
    real = marks_module._set
    calls = []

    def first_only(store, name, label, when):
        calls.append(name)
        if len(calls) > 1:
            raise KeyboardInterrupt("killed between the two writes")
        return real(store, name, label, when)

    monkeypatch.setattr(marks_module, "_set", first_only)
    with pytest.raises(KeyboardInterrupt):
        vault.mark(names[0])  # an older checkpoint: its creation time does not decide
    monkeypatch.setattr(marks_module, "_set", real)
    root = tmp_path / "v"
    assert "best" in record(root, names[0])["labels"] and "best" in record(root, names[3])["labels"]
    assert vault.marks() == {"best": names[0]}  # the later mark names it
    assert vault.resolve("best") == names[0]
    assert vault.retain(keep_last=1) == names[1:3]  # the stale one is not protected
    assert vault.unmark() == names[0]
    assert "labels" not in record(root, names[0]) and "labels" not in record(root, names[3])


def test_a_mark_made_by_a_clock_behind_still_wins(run, monkeypatch):
    vault, _, names = run
    vault.mark(names[1])
    monkeypatch.setattr(marks_module.time, "time", lambda: 1.0)  # 1970
    vault.mark(names[2])
    assert vault.marks() == {"best": names[2]}


def test_ties_between_two_records_resolve_by_creation_then_name(run, tmp_path):
    vault, _, names = run
    root = tmp_path / "v"
    for name in names[:2]:  # the same mark time on two records, as no writer makes it
        doc = record(root, name)
        rewrite(root / "checkpoints" / f"{name}.json", marks_module._relabelled(doc, {"best": 5.0}))
    assert vault.marks() == {"best": names[1]}  # the later-created one


HOSTILE = [
    "best",
    ["best"],
    {"BEST": 1.0},
    {"best": "yesterday"},
    {"best": -1.0},
    {"best": 1e300},
    {"best": True},
    {"": 1.0},
    {"best\n": 1.0},
    {f"l{i}": 1.0 for i in range(9)},
]


@pytest.mark.parametrize("labels", HOSTILE, ids=repr)
def test_hostile_labels_are_format_errors_naming_the_field(run, tmp_path, labels):
    vault, m, names = run
    root = tmp_path / "v"
    doc = record(root, names[1])
    doc = {**{k: doc[k] for k in ("version", "created")}, "labels": labels, **doc}
    rewrite(root / "checkpoints" / f"{names[1]}.json", doc)
    with pytest.raises(weightvault.FormatError, match="field 'labels'"):
        vault.list()
    with pytest.raises(weightvault.FormatError, match="field 'labels'"):
        vault.marks()  # which checkpoint is marked is unknown
    with pytest.raises(weightvault.FormatError, match="field 'labels'"):
        vault.retain(keep_last=1)  # so nothing is deleted
    assert len(list((root / "checkpoints").iterdir())) == 4
    with pytest.raises(weightvault.FormatError, match="field 'labels'"):
        vault.load(m, names[1])
    report = vault.verify()
    assert not report.ok and any("labels" in p for p in report.problems)
    vault.load(m, names[2])  # the others load


def test_labels_after_an_object_are_refused(run, tmp_path):
    """``marks()`` reads only each record's start, so ``labels`` must come before every
    object: a record carrying it later would be marked for a whole read only."""
    vault, _, names = run
    root = tmp_path / "v"
    doc = record(root, names[1])
    rewrite(root / "checkpoints" / f"{names[1]}.json", {**doc, "labels": {"best": 2.0}})
    with pytest.raises(weightvault.FormatError, match="'labels' comes after 'metadata'"):
        vault.list()


def test_marks_reads_only_the_marked_records_whole(run, monkeypatch):
    vault, _, names = run
    vault.mark(names[2])
    whole = []
    real = marks_module.read_doc
    monkeypatch.setattr(marks_module, "read_doc", lambda s, n: whole.append(n) or real(s, n))
    assert vault.marks() == {"best": names[2]}
    assert whole == [names[2]]


def test_push_and_pull_carry_the_mark(run, tmp_path):
    vault, _, names = run
    vault.mark(names[1])
    dest = weightvault.Vault(tmp_path / "mirror", compaction=None)
    vault.push(dest)
    assert dest.marks() == {"best": names[1]}
    vault.mark(names[3])  # after the push: the records there are as they were
    vault.push(dest)  # the same checkpoints: not refused as other content
    assert dest.marks() == {"best": names[3]}
    evaluation = weightvault.Vault(tmp_path / "eval", compaction=None)
    assert evaluation.pull(vault, ["best"]).checkpoints == [names[3]]
    assert evaluation.marks() == {"best": names[3]}


def cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_cli_log_shows_the_mark_and_mark_moves_it(run, tmp_path):
    _, _, names = run
    root = str(tmp_path / "v")
    code, out = cli("vault", root, "log")
    assert code == 0 and "mark" not in out.splitlines()[0].split()  # no column unmarked
    assert cli("vault", root, "mark", names[1]) == (0, f"marked {names[1]} 'best'\n")
    code, out = cli("vault", root, "log")
    head, *rows = out.splitlines()
    assert head.split()[6:9] == ["disk/raw", "mark", "metadata"]
    assert [r.split()[-1] for r in rows[:4]] == ["-", "best", "-", "-"]  # no metadata
    doc = json.loads(cli("vault", root, "log", "--json")[1])
    assert [c["labels"] for c in doc["checkpoints"]] == [[], ["best"], [], []]
    assert cli("vault", root, "mark", "latest") == (
        0,
        f"marked {names[3]} 'best' (was {names[1]})\n",
    )
    assert cli("vault", root, "mark") == (0, f"best: {names[3]}\n")
    doc = json.loads(cli("vault", root, "mark", "--json")[1])
    assert doc == {"label": "best", "checkpoint": names[3], "before": names[3]}
    code, out = cli("vault", root, "show", "best")
    assert code == 0 and out.startswith(f"{names[3]}: created")
    assert cli("vault", root, "mark", "--remove")[0] == 0
    code, out = cli("vault", root, "show", "best")
    assert code == 3
    assert cli("vault", root, "mark", "nope")[0] == 3


# -- the property: a marked checkpoint goes only by name -----------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.just(0)),
        st.tuples(st.just("mark"), st.integers(0, 7)),
        st.tuples(st.just("unmark"), st.just(0)),
        st.tuples(st.just("retain"), st.integers(1, 3)),
        st.tuples(st.just("every"), st.integers(2, 3)),
        st.tuples(st.just("delete"), st.integers(0, 7)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_any_sequence_keeps_the_marked_checkpoint_unless_deleted_by_name(ops):
    with tempfile.TemporaryDirectory() as folder:
        vault = weightvault.Vault(folder, create=True, compaction=None, compression=None)
        data = {"w": torch.zeros(4)}
        marked: str | None = None
        for op, arg in [("save", 0)] * 3 + ops:
            names = [r.name for r in vault.list()]
            if op == "save":
                data["w"] += 1
                vault.save(data)
            elif op == "mark" and names:
                marked = names[arg % len(names)]
                vault.mark(marked)
            elif op == "unmark":
                assert vault.unmark() == marked
                marked = None
            elif op == "retain":
                assert marked not in vault.retain(keep_last=arg)
            elif op == "every":
                assert marked not in vault.retain(keep_every=arg)
            elif op == "delete" and names:
                gone = names[arg % len(names)]
                vault.delete(gone)
                marked = None if gone == marked else marked
            assert vault.marks() == ({"best": marked} if marked else {})
            if marked:
                assert marked in [r.name for r in vault.list()]
                assert vault.resolve("best") == marked


def test_marking_a_record_from_before_seals_rewrites_it_sealed(tmp_path):
    import shutil

    root = tmp_path / "legacy"
    shutil.copytree(Path(__file__).parent / "fixtures" / "legacy_vault", root)
    vault = weightvault.Vault(root, compaction=None)
    assert json.loads((root / "checkpoints" / "step-2.json").read_text())["version"] == 1
    with vault.open("step-2") as ckpt:
        before = {s: bytes(ckpt.read(s)) for s in ckpt.stored}
    for name in ("dcp", "step-2"):  # a DCP record and a plain one
        vault.mark(name)
        assert vault.marks() == {"best": name}
    assert json.loads((root / "checkpoints" / "step-2.json").read_text())["version"] == 2
    assert vault.verify().ok
    with vault.open("best") as ckpt:
        assert {s: bytes(ckpt.read(s)) for s in ckpt.stored} == before
