"""Pack files: a save's small objects in one file, taken apart by the compactor (issue 27).

Each test checks what is on disk (which files exist, what the pack's own index says) and
that every checkpoint still loads bit for bit with its checksums checked; gc and hostile
packs are driven through the real code paths, never mocked.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")

import weightvault.numpy as wvn  # noqa: E402
from _dcp_s3 import moto_s3  # noqa: E402
from _vault_workers import assert_bitwise, build, snapshot  # noqa: E402
from weightvault import FormatError, Vault  # noqa: E402
from weightvault._vault.objects.address import content_hash  # noqa: E402
from weightvault._vault.records.usage import vault_usage  # noqa: E402
from weightvault._vault.store import pack as P  # noqa: E402
from weightvault._vault.store.backend import LocalStore  # noqa: E402
from weightvault._vault.upkeep.gc import collect  # noqa: E402

# -- helpers ---------------------------------------------------------------------------


def packs(root: Path) -> list[Path]:
    folder = root / "packs"
    return sorted(p for p in folder.iterdir() if P.is_pack(p.name)) if folder.exists() else []


def loose(root: Path) -> set[str]:
    folder = root / "objects"
    return {p.name for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")}


def index_of(pack: Path) -> dict[str, P.Packed]:
    return P.read_index(LocalStore(str(pack.parent.parent)), f"packs/{pack.name}")


def arrays(seed: int, n: int = 12) -> dict[str, np.ndarray]:
    """``n`` small float32 tensors of a few shapes (one of them empty)."""
    rng = np.random.default_rng(seed)
    out = {f"t{i}": rng.standard_normal((i % 4 + 1, 17)).astype(np.float32) for i in range(n)}
    out["empty"] = np.zeros((0, 3), np.float32)
    return out


def trained_saves(vault: Vault, n: int) -> Any:
    """A small model's AdamW, after a step before each of ``n`` saves of both into ``vault``."""
    model = build(0, width=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(n):
        model(torch.randn(2, 32)).sum().backward()
        opt.step()
        vault.save(model, optimizer=opt)
    return opt


def assert_loads(vault: Vault, name: str, want: dict[str, np.ndarray]) -> None:
    with vault.open(name) as ckpt:
        got = wvn.load_file(ckpt, verify=True)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].tobytes() == value.tobytes(), key


# -- the format ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=12))
def test_a_pack_holds_each_object_at_an_aligned_offset_and_reads_back(blobs: list[bytes]) -> None:
    objects = [(content_hash(b), b) for b in blobs]
    key, parts = P.pack_parts(objects)
    data = b"".join(bytes(p) for p in parts)
    size = len(data)
    tail = data[-16:]
    length = P.index_length(tail, size, key)
    index = P.parse_index(tail, data[size - 16 - length : size - 16], size, key)
    assert set(index) == {d for d, _ in objects}
    for digest, blob in objects:
        where = index[digest]
        assert where.offset % P.ALIGN == 0 and where.pack == key.rsplit("/", 1)[-1]
        assert data[where.offset : where.offset + where.size] == blob
    assert data.startswith(b"WVPACK01")


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.integers(min_value=0, max_value=10_000),
    st.binary(min_size=1, max_size=8),
    st.sampled_from(["flip", "truncate", "splice"]),
)
def test_a_hostile_pack_is_refused_with_a_format_error_or_read_within_its_bounds(
    tmp_path: Path, at: int, junk: bytes, how: str
) -> None:
    objects = [(content_hash(bytes([i]) * 100), bytes([i]) * 100) for i in range(3)]
    _, parts = P.pack_parts(objects)
    data = bytearray(b"".join(bytes(p) for p in parts))
    at %= len(data)
    if how == "flip":
        data[at] ^= junk[0] or 1
    elif how == "truncate":
        del data[at:]
    else:
        data[at : at + len(junk)] = junk
    name = f"{uuid.uuid4().hex}.pack"
    folder = tmp_path / "packs"
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(bytes(data))
    store = LocalStore(str(tmp_path))
    try:
        index = P.read_index(store, f"packs/{name}")
    except FormatError as e:
        assert name in str(e)
        return
    end = len(data) - 16
    for where in index.values():
        assert P.ALIGN <= where.offset <= where.offset + where.size <= end


def test_packs_split_at_their_byte_cap_and_keep_zero_size_objects() -> None:
    sizes = [("a" * 64, 0), ("b" * 64, P.PACK_BYTES - 5), ("c" * 64, 10), ("d" * 64, 0)]
    groups = P.pack_groups(sizes)
    assert groups == [["a" * 64, "b" * 64], ["c" * 64, "d" * 64]]


# -- saves, loads, the compactor -------------------------------------------------------


def test_a_save_of_small_tensors_is_one_pack_file_and_loads_bitwise(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compaction=None)
    want = arrays(0)
    record = vault.save(want)
    assert loose(tmp_path) == set()
    (pack,) = packs(tmp_path)
    with vault.open(record.name) as ckpt:
        assert set(ckpt.objects.values()) == set(index_of(pack))
    assert_loads(vault, record.name, want)
    assert vault.verify().ok
    # The checkpoint's usage counts its packed objects at their raw size, the vault's
    # object bytes the pack file whole.
    use = vault_usage(vault.store)
    assert use.checkpoints[0].disk_bytes == sum(a.nbytes for a in want.values())
    assert use.object_bytes == pack.stat().st_size


@pytest.mark.parametrize("compression", ["blosc2", None])
def test_large_objects_stay_files_with_or_without_compression(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compression: str | None
) -> None:
    # Creating a file per small tensor cost a vault without compression's saves 1.7-2.6x
    # of plain files: it packs them too.
    monkeypatch.setattr(P, "PACK_OBJECT", 200)  # t0 (68 B) and t4 are packed, larger not
    vault = Vault(tmp_path, compression=compression, compaction=None)
    want = arrays(1, n=8)
    vault.save(want)
    (pack,) = packs(tmp_path)
    small = {content_hash(a.tobytes()) for a in want.values() if a.nbytes < 200}
    big = {content_hash(a.tobytes()) for a in want.values() if a.nbytes >= 200}
    assert set(index_of(pack)) == small and loose(tmp_path) == big
    assert_loads(vault, "000001", want)
    assert vault.verify().ok


def test_a_vault_without_compression_packs_its_saves_then_takes_the_packs_apart(
    tmp_path: Path,
) -> None:
    vault = Vault(tmp_path, compression=None)
    opt = trained_saves(vault, 3)
    vault.wait()
    # Each save wrote one pack; the compactor, which compresses nothing, took them apart
    # (left in place, a resume in a new process would read every one's index).
    for name in ("000001", "000002", "000003"):
        doc = json.loads((tmp_path / "checkpoints" / f"{name}.json").read_text())
        assert len(doc["packs"]) == 1
    assert packs(tmp_path) == []
    assert loose(tmp_path) == {
        d for n in ("000001", "000002", "000003") for d in vault.open(n).objects.values()
    }
    weights = {n: snapshot(_loaded(vault, n)) for n in ("000001", "000002", "000003")}
    before = vault.disk_bytes()
    vault.retain(training_state_last=1)
    vault.gc()
    assert vault.disk_bytes() < before  # the dropped state's bytes, freed or repacked
    for name, want in weights.items():
        assert_bitwise(snapshot(_loaded(vault, name)), want)
    vault.delete("000001")
    vault.delete("000002")
    vault.gc()
    assert loose(tmp_path) == set(vault.open("000003").objects.values())  # nothing dead
    other = build(7, width=32)
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
    vault.load(other, "000003", optimizer=opt2)
    assert_bitwise(snapshot(other), weights["000003"])
    assert [s["step"] for s in opt2.state_dict()["state"].values()] == [
        s["step"] for s in opt.state_dict()["state"].values()
    ]
    assert vault.verify().ok


@pytest.mark.parametrize(
    "options",
    [{}, {"compression": None}, {"training_state_last": 1}],
    ids=["default", "compression=None", "training_state_last=1"],
)
def test_a_compaction_reads_the_newest_records_whole_not_every_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    """Taking packs apart once read every record whole (0.6 s a pass after 150 saves of
    a 70-tensor model); the records it reads must not grow with the run."""
    from weightvault._vault.upkeep import records_cache as C

    reads: list[str] = []
    real = C.Records._read

    def counted(self: Any, name: str) -> Any:
        reads.append(name)
        return real(self, name)

    monkeypatch.setattr(C.Records, "_read", counted)
    vault = Vault(tmp_path, delta_chain=2, **options)
    model = build(0, width=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    read: dict[int, int] = {}
    for n in range(1, 15):
        model(torch.randn(2, 32)).sum().backward()
        opt.step()
        reads.clear()
        vault.save(model, optimizer=opt)
        vault.wait()
        read[n] = len(reads)
    want = snapshot(model)
    # The newest few, the oldest, and a delta chain's length back: not all 14.
    assert max(read.values()) <= 8, sorted(read.items())
    # Nothing left packed that a record names, and the newest resumes bitwise.
    # Every object a record names is loose but the newest's (the background compactor
    # leaves them raw in their pack, for a quick resume); a pack that also holds the
    # training state a retain dropped stays until gc.
    newest = vault.list()[-1].name
    held = set(json.loads((tmp_path / "checkpoints" / f"{newest}.json").read_text())["packs"])
    named = {d for r in vault.list() for d in vault.open(r.name).objects.values()}
    left = [p for p in packs(tmp_path) if p.name not in held]
    assert all(d in loose(tmp_path) for p in left for d in set(index_of(p)) & named)
    other = build(7, width=32)
    vault.load(other, optimizer=torch.optim.AdamW(other.parameters(), lr=1e-3))
    assert_bitwise(snapshot(other), want)
    assert vault.verify().ok


def test_the_compactor_leaves_the_newest_pack_and_takes_the_older_ones_apart(
    tmp_path: Path,
) -> None:
    vault = Vault(tmp_path)
    saves = {}
    for seed in range(3):
        want = arrays(seed)
        saves[vault.save(want).name] = want
        vault.wait()
    # Only the newest checkpoint's pack is left: a resume reads it raw from there.
    (pack,) = packs(tmp_path)
    with vault.open("000003") as ckpt:
        newest = set(ckpt.objects.values())
    assert set(index_of(pack)) <= newest
    assert not set(index_of(pack)) & loose(tmp_path) - {content_hash(b"")}
    for name, want in saves.items():
        assert_loads(vault, name, want)
    report = vault.compact()  # settles: the newest's objects go loose too
    assert packs(tmp_path) == [] and report.packs_deleted == 1
    for name, want in saves.items():
        assert_loads(vault, name, want)
    assert vault.verify().ok


def test_a_model_and_its_optimizer_resume_bitwise_from_a_pack(tmp_path: Path) -> None:
    model = build(0, width=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    with Vault(tmp_path) as vault:
        vault.save(model, optimizer=opt)
    assert len(packs(tmp_path)) == 1
    other = build(5, width=32)
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
    Vault(tmp_path).load(other, optimizer=opt2)
    assert_bitwise(snapshot(other), snapshot(model))
    assert str(opt2.state_dict()["state"]) == str(opt.state_dict()["state"])


def test_loads_during_compaction_never_fail_while_packs_are_deleted(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compaction=None)
    saves = {vault.save(arrays(seed)).name: arrays(seed) for seed in range(4)}
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        reading = Vault(tmp_path, compaction=None)
        while not stop.is_set():
            for name, want in saves.items():
                try:
                    assert_loads(reading, name, want)
                except BaseException as e:
                    errors.append(e)
                    return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        vault.compact()
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive() and errors == []
    assert packs(tmp_path) == []


# -- gc --------------------------------------------------------------------------------


def test_gc_repacks_a_pack_whose_state_was_dropped_and_frees_the_rest(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compaction=None)
    trained_saves(vault, 3)
    weights = {n: snapshot(_loaded(vault, n)) for n in ("000001", "000002", "000003")}
    vault.retain(training_state_last=1)
    for name in ("000001", "000002", "000003"):
        vault.store.delete(f"compact/{name}.todo")  # as if compacted: gc's own path
    before = len(packs(tmp_path))
    freed = collect(vault.store)
    assert freed > 0 and len(packs(tmp_path)) < before
    for name, want in weights.items():
        assert_bitwise(snapshot(_loaded(vault, name)), want)
    other, opt2 = build(7, width=32), None
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
    vault.load(other, "000003", optimizer=opt2)  # the newest keeps its training state
    assert vault.verify().ok


def _loaded(vault: Vault, name: str) -> Any:
    model = build(9, width=32)
    vault.load(model, name)
    return model


def test_gc_leaves_a_pack_the_compactor_has_yet_to_take_apart(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compaction=None, training_state_last=1)
    model = build(0, width=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(2, 32)).sum().backward()
        opt.step()
        vault.save(model, optimizer=opt)  # drops 000001's state, then a paced gc
    # 000001's weights are live and only in its pack, and still to compact: kept whole.
    assert len(packs(tmp_path)) == 2
    collect(vault.store)
    assert len(packs(tmp_path)) == 2
    vault.gc()  # compacts first, then frees the dropped state with its pack
    assert packs(tmp_path) == []
    assert vault.verify().ok


def test_a_pack_in_a_dead_gcs_trash_is_read_then_put_back(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compaction=None)
    want = arrays(3)
    vault.save(want)
    (pack,) = packs(tmp_path)
    trash = tmp_path / "trash" / uuid.uuid4().hex
    trash.mkdir(parents=True)
    shutil.move(str(pack), str(trash / pack.name))  # a gc killed after its move
    assert_loads(Vault(tmp_path, compaction=None), "000001", want)
    assert vault.break_gc_lock() == []
    assert packs(tmp_path) == [pack] and not any(trash.iterdir())
    assert_loads(vault, "000001", want)


def test_a_flipped_byte_in_a_pack_names_the_tensor(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compaction=None)
    want = arrays(4)
    vault.save(want)
    (pack,) = packs(tmp_path)
    digest = content_hash(want["t5"].tobytes())
    where = index_of(pack)[digest]
    data = bytearray(pack.read_bytes())
    data[where.offset + 3] ^= 0x40
    pack.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="t5"), Vault(tmp_path).open("000001") as ckpt:
        wvn.load_file(ckpt, verify=True)
    report = vault.verify()
    assert not report.ok and any("t5" in p for p in report.problems)
    # The compactor checks the name before it takes an object out: left as it is.
    compacted = vault.compact()
    assert any(digest[:12] in line for line in compacted.damaged)
    assert digest not in loose(tmp_path) and len(packs(tmp_path)) == 1


def test_a_pack_with_a_damaged_index_is_reported_not_followed(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compaction=None)
    vault.save(arrays(5))
    (pack,) = packs(tmp_path)
    data = bytearray(pack.read_bytes())
    data[-20] ^= 0xFF  # inside the index's JSON
    pack.write_bytes(bytes(data))
    report = Vault(tmp_path).verify()
    assert not report.ok
    with pytest.raises(FormatError, match="t0"), Vault(tmp_path).open("000001") as ckpt:
        wvn.load_file(ckpt, verify=True)


# -- other stores ----------------------------------------------------------------------


def test_push_sends_packed_objects_as_files_and_a_second_push_sends_nothing(
    tmp_path: Path,
) -> None:
    source = Vault(tmp_path / "src", compaction=None)
    saves = {source.save(arrays(seed)).name: arrays(seed) for seed in range(2)}
    dest = Vault(tmp_path / "dst", compaction=None)
    report = source.push(dest)
    assert report.objects_sent == len(loose(tmp_path / "dst")) > 0
    for name, want in saves.items():
        assert_loads(dest, name, want)
    assert source.push(dest).objects_sent == 0
    # A receiver whose own save packed an object counts it as held.
    third = Vault(tmp_path / "third", compaction=None)
    third.save(arrays(0), name="mine")
    assert source.push(third, ["000001"]).objects_sent == 0


def test_an_s3_save_writes_one_object_for_its_tensors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with moto_s3(monkeypatch, tmp_path) as (url, options):
        import s3fs

        fs = s3fs.S3FileSystem(**options)
        prefix = url.removeprefix("s3://")
        vault = Vault(url, compaction=None, **options)
        want = arrays(6)
        vault.save(want)
        keys = [k.removeprefix(prefix + "/") for k in fs.find(prefix)]
        stored = [k for k in keys if k.startswith(("objects/", "packs/"))]
        assert len(stored) == 1 and stored[0].startswith("packs/")
        assert_loads(Vault(url, compaction=None, **options), "000001", want)
        vault.compact()
        fs.invalidate_cache()
        assert not [k for k in fs.find(prefix) if "/packs/" in k]
        assert_loads(vault, "000001", want)


def test_old_temporary_pack_files_are_removed_by_gc(tmp_path: Path) -> None:
    from weightvault._vault.upkeep import gc as _gc

    vault = Vault(tmp_path, compaction=None)
    vault.save(arrays(0))
    stale = tmp_path / "packs" / ".dead.tmp"
    stale.write_bytes(b"partial")
    old = _time() - _gc.STALE_SECONDS - 1
    os.utime(stale, (old, old))
    vault.gc()
    assert not stale.exists()


def _time() -> float:
    import time

    return time.time()


# -- the layout version ----------------------------------------------------------------

LEGACY = Path(__file__).parent / "fixtures" / "legacy_vault"


def test_an_older_vault_loads_and_becomes_layout_2_at_its_first_pack(tmp_path: Path) -> None:
    root = tmp_path / "legacy"
    shutil.copytree(LEGACY, root)
    assert json.loads((root / "vault.json").read_text())["version"] == 1
    vault = Vault(root, compaction=None)
    before = {r.name: _digests(vault, r.name) for r in vault.list()}
    assert vault.verify().ok  # read as it is, version 1
    vault.save(arrays(8), name="packed")
    assert json.loads((root / "vault.json").read_text())["version"] == 2
    assert len(packs(root)) == 1
    assert {n: _digests(vault, n) for n in before} == before and vault.verify().ok
    assert_loads(vault, "packed", arrays(8))


def test_a_layout_this_weightvault_does_not_know_is_refused_by_its_version(
    tmp_path: Path,
) -> None:
    vault = Vault(tmp_path, compaction=None)
    vault.save(arrays(0))
    (tmp_path / "vault.json").write_text(
        json.dumps({"format": "weightvault-vault", "version": 3, "hash": "blake3"})
    )
    with pytest.raises(FormatError, match="version 3"):
        Vault(tmp_path).list()


def _digests(vault: Vault, name: str) -> dict[str, str]:
    with vault.open(name) as ckpt:
        return dict(ckpt.objects)


def test_prefetch_reads_each_pack_once_for_all_its_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightvault._vault.objects.prefetch import prefetch

    vault = Vault(tmp_path, compaction=None)
    want = arrays(9)
    vault.save(want)
    asked: list[list[str]] = []
    real = LocalStore.get_many

    def get_many(self: LocalStore, keys: list[str]) -> dict[str, bytes]:
        asked.append(list(keys))
        return real(self, keys)

    monkeypatch.setattr(LocalStore, "get_many", get_many)
    digests = {content_hash(a.tobytes()): a.tobytes() for a in want.values()}
    got = prefetch(vault.store, list(digests))
    assert asked == [[f"packs/{packs(tmp_path)[0].name}"]]
    assert got == digests


# -- the pack written while hashing ----------------------------------------------------


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*") if p.is_file()]


def test_a_later_save_writes_its_new_objects_into_the_pack_as_it_hashes(tmp_path: Path) -> None:
    vault = Vault(tmp_path, compaction=None)
    vault.save(arrays(0))
    second = arrays(1)
    record = vault.save(second)
    # The second save's pack came from the writer (the first save had no seen objects):
    # it holds exactly the new objects, and the record names it.
    doc = json.loads((tmp_path / "checkpoints" / f"{record.name}.json").read_text())
    (mine,) = doc["packs"]
    new = {content_hash(a.tobytes()) for a in second.values()} - {content_hash(b"")}
    assert set(index_of(tmp_path / "packs" / mine)) == new
    assert temp_files(tmp_path) == []
    assert_loads(vault, record.name, second)
    assert vault.verify().ok


def test_an_object_another_writer_stored_meanwhile_is_a_harmless_second_copy_until_compacted(
    tmp_path: Path,
) -> None:
    ours = Vault(tmp_path, compaction=None)
    ours.save(arrays(0))
    theirs = Vault(tmp_path, compaction=None)
    theirs.save(arrays(2), name="theirs")  # holds what our next save will hash as new
    before = set(packs(tmp_path))
    record = ours.save(arrays(2))
    assert_loads(ours, record.name, arrays(2))
    assert_loads(ours, "theirs", arrays(2))
    # Our writer's pack is published unchecked: a second copy of what theirs stored.
    assert record.new_bytes > 0 and temp_files(tmp_path) == []
    assert len(set(packs(tmp_path)) - before) == 1
    assert ours.verify().ok
    ours.compact()  # one copy of each object stays, loose; every pack is gone
    assert packs(tmp_path) == []
    assert_loads(ours, record.name, arrays(2))
    assert_loads(ours, "theirs", arrays(2))
    assert ours.verify().ok


def test_a_save_that_fails_after_hashing_leaves_no_pack_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightvault._vault.writing import commit

    vault = Vault(tmp_path, compaction=None)
    vault.save(arrays(0))
    before = packs(tmp_path)

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(commit, "commit_record", full)
    monkeypatch.setattr("weightvault._vault.writing.save.commit_record", full)
    with pytest.raises(OSError, match="No space"):
        vault.save(arrays(3))
    assert temp_files(tmp_path) == []
    # The pack was published before the record failed: unreferenced, gc frees it.
    assert len(packs(tmp_path)) == len(before) + 1
    vault.gc()
    assert [r.name for r in vault.list()] == ["000001"]
    assert_loads(vault, "000001", arrays(0))
    assert packs(tmp_path) == []  # 000001 compacted, the orphan freed


# -- faults during compaction, with packs ----------------------------------------------


def test_sigkill_while_packs_are_taken_apart_loses_nothing(tmp_path: Path) -> None:
    from test_vault_compaction import BOUND, _compact_child, history, loads_exactly

    vault = Vault(tmp_path, compaction=None, delta_chain=2)
    expected = history(vault, 6, tensors=8)
    assert len(packs(tmp_path)) == 6
    for k in range(12):
        if not packs(tmp_path):
            break
        child = _compact_child(tmp_path, 0.01)
        time.sleep(0.6 + 0.15 * k)  # the import takes about half a second
        child.kill()
        child.wait(BOUND)
        loads_exactly(Vault(tmp_path, compaction=None), expected)  # a fresh reader each time
        assert vault.verify().ok
    vault.compact()  # what the kills left is picked up
    assert packs(tmp_path) == []  # (a killed child leaves temporary files: gc takes them)
    loads_exactly(vault, expected)
    assert vault.verify().ok


def test_two_processes_taking_packs_apart_lose_nothing(tmp_path: Path) -> None:
    from test_vault_compaction import compact_in_two_processes, history, loads_exactly

    vault = Vault(tmp_path, compaction=None)
    expected = history(vault, 5, tensors=8)
    compact_in_two_processes(tmp_path)
    assert packs(tmp_path) == []
    loads_exactly(vault, expected)
    assert vault.verify().ok


def test_loads_and_gc_while_packs_are_taken_apart_succeed(tmp_path: Path) -> None:
    from test_vault_compaction import history, loads_and_gcs_during_compaction, loads_exactly

    writer = Vault(tmp_path, compaction=None)
    expected = history(writer, 5, tensors=8)
    writer.delete("000003")  # its pack holds only what no checkpoint names now
    del expected[2]
    reader = loads_and_gcs_during_compaction(tmp_path, writer, expected)
    reader.gc()
    assert packs(tmp_path) == []
    loads_exactly(reader, expected)


def test_an_intent_emptied_by_a_power_loss_does_not_stop_gc(tmp_path: Path) -> None:
    # Intents are not fsynced; after a crash one may be an empty file.
    vault = Vault(tmp_path, compaction=None)
    vault.save(arrays(0))
    vault.delete("000001")
    empty = tmp_path / "intents" / f"{uuid.uuid4().hex}.json"
    empty.parent.mkdir(exist_ok=True)
    empty.write_bytes(b"")
    assert vault.gc() > 0
    assert not empty.exists() and packs(tmp_path) == []
