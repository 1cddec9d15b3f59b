"""DCP checkpoints travel between vaults: a sharded save on 2 gloo ranks, pushed to
another vault and pulled into an empty one, loads there bit for bit on 1 and 2 ranks.

The ranks are ``tests/_dcp_workers.py``'s (a tiny GPT-2 with a tied head, a frozen block
and AdamW state, sharded by FSDP2); ``load_fsdp`` compares against the gathered state
``save_fsdp`` wrote beside the vault. Each spawn costs seconds, so one test covers both
directions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

from safetensors.torch import load_file  # noqa: E402

import _dcp_workers as W  # noqa: E402
from weightvault import Vault  # noqa: E402


def _objects(vault: Vault, name: str) -> dict[str, str]:
    with vault.open(name) as ckpt:
        return dict(ckpt.objects)


def _object_files(vault: Vault) -> set[str]:
    return {b.key.rsplit("/", 1)[-1] for b in vault.store.list("objects")}


def test_a_dcp_checkpoint_pushed_or_pulled_loads_bitwise_on_any_number_of_ranks(
    tmp_path: Path,
) -> None:
    src, dst, one = tmp_path / "src", tmp_path / "dst", tmp_path / "one"
    oracle = str(tmp_path / "oracle")
    W.run_ranks(W.save_fsdp, 2, str(src), oracle, "s1", timeout=180)
    source = Vault(src, compaction=None)
    assert [r.name for r in source.list()] == ["s1", "s1-next"]
    source_objects = _objects(source, "s1")
    # Every chunk and both ranks' chunk tables are objects: a transfer sends them all.
    assert sum(label.startswith("chunk table of rank ") for label in source_objects) == 2

    report = source.push(dst, ["s1"])
    assert report.checkpoints == report.committed == ["s1"]
    assert report.damaged == [] and report.bytes_skipped == 0
    dest = Vault(dst, compaction=None)
    assert [r.name for r in dest.list()] == ["s1"]
    assert _objects(dest, "s1") == source_objects
    assert set(source_objects.values()) <= _object_files(dest)
    assert dest.verify().ok
    again = source.push(dst, ["s1"])
    assert (again.objects_sent, again.bytes_sent, again.committed) == (0, 0, [])

    # Resharded on load: the receiver's copy fills 2 ranks and 1 rank alike.
    W.run_ranks(W.load_fsdp, 2, str(dst), oracle, "s1", str(tmp_path / "r2.json"), timeout=180)
    assert len(json.loads((tmp_path / "r2.json").read_text())) == 2

    # Pulled alone by name into an empty vault, it brings what it needs to load.
    empty = Vault(one, compaction=None)
    pulled = empty.pull(src, ["s1"])
    assert pulled.checkpoints == pulled.committed == ["s1"] and pulled.damaged == []
    assert [r.name for r in empty.list()] == ["s1"]
    assert _objects(empty, "s1") == source_objects
    assert set(source_objects.values()) <= _object_files(empty)
    assert empty.verify().ok
    W.run_ranks(W.load_fsdp, 1, str(one), oracle, "s1", str(tmp_path / "r1.json"), timeout=180)
    assert len(json.loads((tmp_path / "r1.json").read_text())) == 1

    # The same pulled copy loads in one plain process (no process group) too.
    model = W.gpt2(11)
    report_load = empty.load(model, "s1", restore_frozen=True)
    assert not report_load.missing and not report_load.unexpected
    want = load_file(oracle + ".safetensors")
    for key, value in model.state_dict().items():
        assert torch.equal(
            value.view(-1).view(torch.uint8), want[f"model.{key}"].view(-1).view(torch.uint8)
        ), key
