"""Property tests of Vault.push and Vault.pull between local vaults, on numpy arrays.

Random runs of saves (tensors kept, nudged or replaced between checkpoints, some names
tied to one array, some copies, several dtypes), compacted at random points so that the
source holds raw objects, compressed ones and deltas, then random subsets of names
pushed twice each. The receiver must end with exactly the names pushed, each loading the
arrays that were saved, and every report must account for the objects the receiver
lacked (see the report's fields in ``weightvault._vault.travel.transfer``).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import weightvault.numpy as wvn  # noqa: E402
from weightvault import Vault  # noqa: E402
from weightvault._vault.objects.address import object_key  # noqa: E402
from weightvault._vault.objects.file import object_file  # noqa: E402
from weightvault._vault.store.pack import read_index  # noqa: E402

DTYPES = ["float32", "float16", "float64", "int8", "uint8", "int32", "int64", "bool"]

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Run:
    """What a property saves: one ``{name: array}`` per checkpoint, and when to compact."""

    saves: list[dict[str, Any]]
    compact_after: list[bool]
    pushes: list[list[int]]  # checkpoint indices, one list per push
    compact_before_push: list[bool]
    pulled: int


def _values(rng: Any, dtype: str, shape: tuple[int, ...], noise: bool) -> Any:
    """Random values: few distinct ones, which the compactor's frames and deltas shrink
    well below raw, or noise, which no frame shrinks, so an old checkpoint's delta chain
    outweighs its tensor and a pull of it alone sends the tensor whole."""
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if not noise:
        return rng.integers(-3, 4, size=shape).astype(dtype)
    if dtype.startswith("float"):
        return rng.standard_normal(size=shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def _nudged(rng: Any, a: Any) -> Any:
    """A copy of ``a`` with one item changed: the next checkpoint's value of a trained
    tensor, which makes the older one a delta once compacted."""
    out = a.copy()
    flat = out.reshape(-1)
    i = int(rng.integers(0, flat.size))
    # 5 and 7 fit every dtype drawn, and differ from each other.
    flat[i] = not flat[i] if out.dtype == bool else (5 if flat[i] == 7 else 7)
    return out


@st.composite
def runs(draw: st.DrawFn) -> Run:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    slots: list[tuple[str, tuple[int, ...], bool, Any]] = []
    for _ in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        # No zero-size shapes: they fail to load (see test_a_zero_size_array_travels_...).
        shape = tuple(draw(st.lists(st.integers(1, 64), max_size=2)))
        noise = draw(st.booleans())
        slots.append((dtype, shape, noise, _values(rng, dtype, shape, noise)))
    saves: list[dict[str, Any]] = []
    for i in range(draw(st.integers(1, 5))):
        if i:
            for j, (dtype, shape, noise, a) in enumerate(slots):
                how = draw(st.sampled_from(["keep", "nudge", "new"]))
                if how == "nudge":
                    slots[j] = (dtype, shape, noise, _nudged(rng, a))
                elif how == "new":
                    slots[j] = (dtype, shape, noise, _values(rng, dtype, shape, noise))
        arrays = {f"t{j}": slot[-1] for j, slot in enumerate(slots)}
        for j in draw(st.sets(st.integers(0, len(slots) - 1), max_size=2)):
            arrays[f"tied{j}"] = arrays[f"t{j}"]  # one array under two names: an alias
        if draw(st.booleans()):
            arrays["copy0"] = arrays["t0"].copy()  # equal bytes, separate memory
        saves.append(arrays)
    n = len(saves)
    pushes = draw(
        st.lists(
            st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True),
            min_size=1,
            max_size=3,
        )
    )
    return Run(
        saves=saves,
        compact_after=[draw(st.booleans()) for _ in saves],
        pushes=pushes,
        compact_before_push=[draw(st.booleans()) for _ in pushes],
        pulled=draw(st.integers(0, n - 1)),
    )


def _files(vault: Vault) -> dict[str, int]:
    """``{digest: file size}`` of every object of ``vault``: its file, or its bytes in a
    save's pack (read from the pack's own index, which the vault never wrote back)."""
    out = {}
    for blob in vault.store.list("packs"):
        out.update({d: p.size for d, p in read_index(vault.store, blob.key).items()})
    for blob in vault.store.list("objects"):
        out[blob.key.rsplit("/", 1)[-1]] = blob.size
    return out


def _objects(vault: Vault, name: str) -> dict[str, str]:
    with vault.open(name) as ckpt:
        return dict(ckpt.objects)


def _assert_loads(vault: Vault, name: str, want: dict[str, Any]) -> None:
    """Checkpoint ``name`` of ``vault`` reads back ``want`` bit for bit (hashes checked)."""
    with vault.open(name) as ckpt:
        got = wvn.load_file(ckpt, verify=True)
    assert sorted(got) == sorted(want), name
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, (name, key)
        assert got[key].tobytes() == value.tobytes(), (name, key)


@SETTINGS
@given(runs())
def test_push_and_pull_send_what_the_receiver_lacks_and_everything_loads(run: Run) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        # No background compactor on either side: object files change only when the test
        # compacts, so what the reports count can be read off the folders.
        source = Vault(root / "src", compaction=None)
        names = []
        for arrays, compact in zip(run.saves, run.compact_after, strict=True):
            names.append(source.save(arrays).name)
            if compact:
                source.compact()
        saved = dict(zip(names, run.saves, strict=True))
        dest = Vault(root / "dst", compaction=None)
        held: set[str] = set()

        for indices, compact in zip(run.pushes, run.compact_before_push, strict=True):
            if compact:
                source.compact()  # re-encodes source objects the receiver may hold raw
            asked = [names[i] for i in indices]
            ordered = [n for n in names if n in asked]  # oldest first, as reported
            before = _files(dest)
            src_files = _files(source)
            tops = {h for n in asked for h in _objects(source, n).values()}

            report = source.push(dest, asked)
            after = _files(dest)
            new = set(after) - set(before)
            assert report.checkpoints == ordered
            assert report.committed == [n for n in ordered if n not in held]
            assert report.damaged == []
            # Every object it names that the receiver lacked was sent; the rest that was
            # sent are delta bases the source holds.
            assert tops - set(before) <= new <= set(src_files)
            assert report.objects_sent == len(new)
            assert report.bytes_sent == sum(after[h] for h in new)
            assert report.bytes_skipped == sum(src_files[h] for h in tops & set(before))
            # As stored, except the objects sent whole instead of as a long chain.
            changed = [
                h
                for h in new
                if dest.store.get(object_key(h)) != bytes(object_file(source.store, h))
            ]
            assert len(changed) <= report.whole <= len(new)
            held |= set(asked)

            again = source.push(dest, asked)
            assert (again.objects_sent, again.bytes_sent, again.committed) == (0, 0, [])
            assert again.checkpoints == ordered
            assert again.bytes_skipped == sum(src_files[h] for h in tops)
            assert _files(dest) == after

        assert [r.name for r in dest.list()] == [n for n in names if n in held]
        assert dest.verify().ok
        for name in held:
            assert _objects(dest, name) == _objects(source, name)  # the same records
            _assert_loads(dest, name, saved[name])

        one = names[run.pulled]
        empty = Vault(root / "one", compaction=None)
        pulled = empty.pull(root / "src", [one])
        assert pulled.checkpoints == pulled.committed == [one]
        assert [r.name for r in empty.list()] == [one]
        assert empty.verify().ok
        _assert_loads(empty, one, saved[one])
        # What it holds is what the checkpoint needs: its objects and their bases.
        assert set(_objects(empty, one).values()) <= set(_files(empty)) <= set(_files(source))


def test_a_zero_size_array_travels_and_loads_with_its_hashes_checked(tmp_path: Path) -> None:
    """A zero-size array is an object like any other: it loads, travels and loads there."""
    source = Vault(tmp_path / "src", compaction=None)
    want = {"empty": np.zeros((0, 3), np.float32), "w": np.arange(4, dtype=np.int32)}
    name = source.save(want).name
    into = {"empty": np.ones((0, 3), np.float32), "w": np.zeros(4, np.int32)}
    assert source.load(into, name).missing == []  # raises here, before any transfer
    report = source.push(tmp_path / "dst")
    assert report.committed == [name]
    dest = Vault(tmp_path / "dst", compaction=None)
    assert dest.verify().ok
    _assert_loads(dest, name, want)
