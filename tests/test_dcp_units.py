"""weightvault.dcp's parts in one process: the record's layout (grids, per-rank chunk tables),
ranged reads into destination tensors, and reading only the tables a rank needs.

No process group: the pieces are driven directly, with numpy slicing as the oracle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import weightvault  # noqa: E402
from weightvault._dcp.index import ChunkIndex  # noqa: E402
from weightvault._dcp.ranged import read_box, span  # noqa: E402
from weightvault._vault.objects.address import content_hash, object_key  # noqa: E402
from weightvault._vault.records.dcp_layout import Chunk, encode_table, encode_tensor, parse_layout  # noqa: E402
from weightvault._vault.store.backend import LocalStore  # noqa: E402

D = "0" * 64


def _rows(n: int, ranks: int) -> list[tuple[tuple[int, int], tuple[int, int], str, int]]:
    per = -(-n // ranks)
    out = []
    for r in range(ranks):
        start = min(r * per, n)
        out.append(((start, 0), (min(per, n - start), 8), f"{r:064x}", r))
    return out


def test_fsdp_rows_on_1024_ranks_are_one_small_grid() -> None:
    entry = encode_tensor("BF16", (128256, 8), _rows(128256, 1024))
    assert entry["grid"] == [126, 8]
    assert entry["tables"] == {"start": 0, "strides": [1, 0]}
    assert len(json.dumps(entry)) < 120  # against ~90 KB for 1,024 inline chunks
    layout = parse_layout({"version": 2, "tables": [D] * 1024, "tensors": {"w": entry}}, "v")
    grid = layout.tensors["w"].grid
    assert grid is not None and grid.count() == 1018  # trailing ranks hold no rows
    cell = grid.cell_at((126 * 5, 0))
    assert cell == (5, 0) and grid.table_of(cell) == 5
    assert grid.box((1017, 0)) == ((1017 * 126, 0), (128256 - 1017 * 126, 8))
    assert list(grid.overlapping((125, 0), (2, 8))) == [(0, 0), (1, 0)]


def test_grids_keep_irregular_table_orders_and_refuse_non_grids() -> None:
    two_d = [((0, 0), (3, 2), D, 0), ((0, 2), (3, 2), D, 3), ((3, 0), (2, 2), D, 1),
             ((3, 2), (2, 2), D, 2)]  # fmt: skip
    entry = encode_tensor("F32", (5, 4), two_d)
    assert entry["grid"] == [3, 2] and entry["tables"] == [0, 3, 1, 2]
    ragged = [((0, 0), (3, 4), D, 0), ((3, 0), (2, 2), D, 1), ((3, 2), (2, 2), D, 2)]
    assert "chunks" in encode_tensor("F32", (5, 4), ragged)  # not a grid: inline
    assert "chunks" in encode_tensor("F32", (5, 4), [((0, 0), (5, 4), D, 0)])  # one chunk


@pytest.mark.parametrize(
    "section",
    [
        {"version": 3, "tensors": {}},
        {"version": 2, "tables": [D], "tensors": {"w": {"dtype": "F32", "shape": [4],
                                                        "grid": [2], "tables": [0]}}},
        {"version": 2, "tables": [D], "tensors": {"w": {"dtype": "F32", "shape": [4],
                                                        "grid": [2], "tables": {"start": 0,
                                                                                "strides": [1]}}}},
        {"version": 2, "tables": [D], "tensors": {"w": {"dtype": "F32", "shape": [4],
                                                        "grid": [[0, 3, 1]], "tables": [0, 0, 0]}}},
    ],
)  # fmt: skip
def test_a_damaged_layout_is_a_format_error(section: dict[str, Any]) -> None:
    with pytest.raises(weightvault.FormatError, match="v:"):
        parse_layout(section, "v")


def _stored(tmp_path: Path, array: np.ndarray) -> tuple[LocalStore, Chunk]:
    store = LocalStore(str(tmp_path))
    raw = array.tobytes()
    digest = content_hash(raw)
    store.put(object_key(digest), raw)
    return store, Chunk((0,) * array.ndim, array.shape, digest)


def test_span_of_a_box_is_the_run_that_covers_it() -> None:
    assert span((4, 6), (1, 0), (2, 6), 4).contiguous  # whole rows: one run
    s = span((4, 6), (1, 2), (2, 3), 4)
    assert not s.contiguous and (s.start, s.end) == ((6 + 2) * 4, (2 * 6 + 5) * 4)


def test_boxes_read_straight_into_contiguous_tensors_and_any_other_kind(tmp_path: Path) -> None:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    store, chunk = _stored(tmp_path, a)
    rows = torch.empty(2, 6)
    assert read_box(store, "w", "F32", chunk, (1, 0), (2, 6), rows) == 48
    assert np.array_equal(rows.numpy(), a[1:3])
    whole = torch.empty(4, 6)
    read_box(store, "w", "F32", chunk, (0, 0), (4, 6), whole)  # checked against its hash
    assert np.array_equal(whole.numpy(), a)
    big = torch.zeros(4, 8)
    strided = big[1:3, 2:5]  # a non-contiguous destination of a non-contiguous box
    read_box(store, "w", "F32", chunk, (1, 2), (2, 3), strided)
    assert np.array_equal(big[1:3, 2:5].numpy(), a[1:3, 2:5]) and big[0].sum() == 0
    wide = torch.empty(2, 6, dtype=torch.float64)  # another dtype: converted, not raw bytes
    read_box(store, "w", "F32", chunk, (1, 0), (2, 6), wide)
    assert np.array_equal(wide.numpy(), a[1:3].astype(np.float64))


def test_a_short_or_corrupt_object_is_a_format_error(tmp_path: Path) -> None:
    a = np.arange(6, dtype=np.float32)
    store, chunk = _stored(tmp_path, a)
    path = tmp_path / object_key(chunk.digest)
    path.write_bytes(path.read_bytes()[::-1])  # same size, other bytes
    with pytest.raises(weightvault.FormatError, match="corrupt"):
        read_box(store, "w", "F32", chunk, (0,), (6,), torch.empty(6))
    path.write_bytes(path.read_bytes()[:8])
    with pytest.raises(weightvault.FormatError, match="ended before"):
        read_box(store, "w", "F32", chunk, (2,), (4,), torch.empty(4))


def test_a_rank_reads_only_the_tables_its_chunks_are_in(tmp_path: Path) -> None:
    """Four ranks' tables; a reader of rows 4-7 reads table 1 only."""
    store = LocalStore(str(tmp_path))
    chunks, tables = [], []
    for r in range(4):
        raw = np.full((4, 2), r, dtype=np.float32).tobytes()
        digest = content_hash(raw)
        store.put(object_key(digest), raw)
        table = encode_table({"w": [((4 * r, 0), (4, 2), digest)]})
        tables.append(content_hash(table))
        store.put(object_key(tables[-1]), table)
        chunks.append(((4 * r, 0), (4, 2), digest, r))
    section = {"version": 2, "tables": tables, "table_sizes": [10] * 4,
               "tensors": {"w": encode_tensor("F32", (16, 2), chunks)}}  # fmt: skip
    index = ChunkIndex(store, parse_layout(section, "v"), {"alias": "w"}, "v")
    md = index.metadata({}, {})
    index.fill(md, {"w": [((5, 0), (2, 2))]})
    assert [tuple(c.offsets) for c in md.state_dict_metadata["w"].chunks] == [(4, 0)]
    assert md.state_dict_metadata["alias"].chunks == []  # this rank does not load it
    assert index.tables_for([("w", (4, 0)), ("alias", (4, 0))]) == {1}
    dtype, chunk = index.chunk("alias", (4, 0))  # a tie reads its canonical's chunks
    assert (dtype, chunk.digest) == ("F32", chunks[1][2]) and index.table_bytes == 10
    (tmp_path / object_key(tables[2])).write_bytes(b"{}")
    with pytest.raises(weightvault.FormatError, match=r"table of rank 2 .* corrupt"):
        index.chunk("w", (8, 0))


_PEAK = """
import os, re, sys, torch
import weightvault.dcp as wdcp
def kib(f):
    return int(re.search(f + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
model = torch.nn.Linear(2048, 4096, bias=False)            # 32 MiB, one chunk
wdcp.save(model, sys.argv[1], "a")
fresh = torch.nn.Linear(2048, 4096, bias=False)
wdcp.load(fresh, sys.argv[1], "a")                          # warm: imports, threads
open("/proc/self/clear_refs", "w").write("5")
before = kib("VmRSS")
wdcp.load(fresh, sys.argv[1], "a")
assert torch.equal(fresh.weight, model.weight)
print((kib("VmHWM") - before) / 1024)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux peak RSS")
@pytest.mark.parametrize("remote", [False, True])
def test_a_load_holds_no_copy_beyond_the_destination(tmp_path: Path, remote: bool) -> None:
    """Loading a 32 MiB tensor: locally its bytes go straight into the parameter (before,
    a fresh buffer and a copy of it: 64 MiB more); over fsspec only the response is held."""
    root = "memory://peak" if remote else str(tmp_path / "v")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", _PEAK, root], env=env, check=True,
                         capture_output=True, text=True)  # fmt: skip
    peak = float(out.stdout.strip().splitlines()[-1])
    assert peak <= (33 if remote else 2), peak  # MiB beyond what the process held


# -- plan caching ---------------------------------------------------------------------------


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The cache key of every global plan actually built (not taken from a cache)."""
    from weightvault._dcp.planner import VaultSavePlanner

    keys: list[str | None] = []
    real = VaultSavePlanner._global_plan

    def spy(self: Any, plans: Any) -> Any:
        keys.append(self.cache_key)
        return real(self, plans)

    monkeypatch.setattr(VaultSavePlanner, "_global_plan", spy)
    return keys


def _equal(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))  # fmt: skip


def test_two_checkpointers_in_one_process_keep_their_own_plan_cache(
    tmp_path: Path, planned: list[str | None]
) -> None:
    """A model and another model saved in turn: each second save reuses its own plan.
    DCP keys its cache by class name, so its two planners would share one."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    import weightvault.dcp as wdcp

    assert (DefaultSavePlanner(enable_plan_caching=True)._cached_plans_key
            == DefaultSavePlanner(enable_plan_caching=True)._cached_plans_key)  # fmt: skip
    mine = [wdcp.VaultSavePlanner(enable_plan_caching=True) for _ in range(2)]
    assert mine[0].cache_key != mine[1].cache_key
    a, b = _tiny(1), torch.nn.Sequential(torch.nn.Linear(3, 5))
    for step in range(2):
        wdcp.save(a, tmp_path / "a", f"s{step}")
        wdcp.save(b, tmp_path / "b", f"s{step}")
    assert len(planned) == 2 and planned[0] != planned[1]  # planned once per checkpointer
    for model, root in ((a, "a"), (b, "b")):
        fresh = _tiny(9) if model is a else torch.nn.Sequential(torch.nn.Linear(3, 5))
        wdcp.load(fresh, tmp_path / root, "s1")
        assert _equal(fresh, model)
    doc = json.loads((tmp_path / "a" / "checkpoints" / "s1.json").read_text())
    assert doc["dcp"]["ties"] == {"model.1.weight": "model.0.weight"}  # kept from the cache


def test_a_plan_that_changes_only_in_its_ties_is_planned_again(
    tmp_path: Path, planned: list[str | None]
) -> None:
    """Untying the head changes no write item, only the planner data that carries ties;
    DCP's comparison would reuse the cached plan and record a tie that no longer holds."""
    import weightvault.dcp as wdcp

    model = _tiny(1)
    wdcp.save(model, tmp_path, "tied")
    model[1].weight = torch.nn.Parameter(model[0].weight.detach() + 1)
    wdcp.save(model, tmp_path, "untied")
    assert len(planned) == 2
    doc = json.loads((tmp_path / "checkpoints" / "untied.json").read_text())
    assert doc["dcp"]["ties"] == {}
    fresh = _tiny(5)
    fresh[1].weight = torch.nn.Parameter(torch.zeros_like(fresh[1].weight))
    wdcp.load(fresh, tmp_path, "untied")
    assert _equal(fresh, model)


def _tiny(seed: int) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(6, 4), torch.nn.Linear(4, 6, bias=False))
    model[1].weight = model[0].weight
    return model


# -- async_save within a host memory budget -------------------------------------------------

_STAGING = """
import re, sys, torch
import weightvault.dcp as wdcp
from weightvault import Vault
def kib(f):
    return int(re.search(f + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
def build():
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 4096, bias=False) for _ in range(8)])
torch.manual_seed(0)
model = build()                                        # 8 x 16 MiB = 128 MiB
wdcp.save(model, sys.argv[1], "warm")                  # one-time costs of a first save
for budget in (32 << 20, None):
    want = {k: v.clone() for k, v in model.state_dict().items()}
    open("/proc/self/clear_refs", "w").write("5")
    before = kib("VmRSS")
    pending = wdcp.async_save(model, sys.argv[1], staging_bytes=budget)
    for p in model.parameters():
        p.data.add_(1)                                 # training goes on
    rec = pending.result()
    print((kib("VmHWM") - before) / 1024, flush=True)
    fresh = build()
    Vault(sys.argv[1]).load(fresh, rec.name)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items()), rec.name
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux peak RSS")
def test_async_save_holds_at_most_its_staging_budget(tmp_path: Path) -> None:
    """A 128 MiB state saved with staging_bytes=32 MiB holds at most 32 MiB + 10% more
    while the call returns and the save finishes; without a budget it holds a copy of
    the whole state, as DCP's own stager does. Parameters changed right after the call
    returns are not in the checkpoint."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _STAGING, str(tmp_path)],
                         env=env, check=True, capture_output=True, text=True)  # fmt: skip
    bounded, whole = (float(x) for x in out.stdout.split())
    assert bounded <= 32 * 1.1, bounded
    assert whole >= 120, whole  # the whole state, staged at once
