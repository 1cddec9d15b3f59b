"""`weightvault vault SRC push DEST` and `weightvault vault DEST pull SRC`."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _transfer_workers import check_loads, finetune  # noqa: E402
from weightvault import Vault  # noqa: E402
from weightvault._cli.app import main  # noqa: E402


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return main(list(argv), out=out), out.getvalue()


def test_push_then_pull_by_name_with_json_and_exit_codes(tmp_path: Path) -> None:
    src = Vault(tmp_path / "src", compaction="after-save")
    expected = finetune(src, 3)
    code, out = run("vault", str(tmp_path / "src"), "push", str(tmp_path / "dst"))
    assert code == 0, out
    assert out.startswith(f"pushed 3 checkpoints to {tmp_path / 'dst'} (3 new): ")
    assert "0 B already there" in out
    code, out = run("vault", str(tmp_path / "src"), "push", str(tmp_path / "dst"), "--json")
    doc = json.loads(out)
    assert (doc["bytes_sent"], doc["committed"]) == (0, [])
    assert doc["checkpoints"] == list(expected)

    # 000002 is a delta on 000003 (the oldest and the newest are whole): it comes whole.
    code, out = run("vault", str(tmp_path / "one"), "pull", str(tmp_path / "dst"), "000002")
    assert code == 0 and "pulled 1 checkpoint from" in out and "sent whole" in out
    check_loads(Vault(tmp_path / "one"), {"000002": expected["000002"]})

    # A name taken with other content: refused (5); no vault at SRC: unreadable (3).
    other = Vault(tmp_path / "other")
    finetune(other, 1, seed=9)
    code, out = run("vault", str(tmp_path / "other"), "push", str(tmp_path / "dst"))
    assert code == 5
    code, out = run("vault", str(tmp_path / "none"), "push", str(tmp_path / "dst"))
    assert code == 3
    code, out = run("vault", str(tmp_path / "x"), "pull", str(tmp_path / "none"))
    assert code == 3
