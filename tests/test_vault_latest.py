"""Which checkpoint "latest" names, read from the start of each record.

A resume loads "latest". Reading every record whole to find it made a resume cost 0.3
ms per checkpoint the vault holds (85 KB of JSON each for a 70-tensor model with its
AdamW): 60 ms more after 300 checkpoints. :func:`creation_order` reads the first bytes of
each record and the newest one whole. These tests pin that it names what reading every
record whole names (the oracle: :func:`list_records`), for records written by this
library, by hand (other key orders, spaces, a repeated key) and damaged ones, and that
one record is read whole.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from _records import read as read_record, seal
from weightvault import CheckpointNotFoundError, FormatError, Vault
from weightvault._vault.records.names import record_key
from weightvault._vault.records.order import creation_order, head_fields, resolve
from weightvault._vault.records.reading import list_records
from weightvault._vault.store.backend import LocalStore


def _vault(root: Path, n: int) -> Vault:
    vault = Vault(root)
    for i in range(n):
        vault.save({"w": np.full(4, i, np.float32), "b": np.arange(3, dtype=np.float32)})
    vault.wait()  # no compactor reads records behind the tests' backs
    return vault


def _write(root: Path, name: str, doc: dict[str, Any], style: str) -> None:
    """Record ``name`` as ``doc`` in one of the ways a writer could lay it out."""
    if style == "compact":
        text = json.dumps(doc, separators=(",", ":"))
    elif style == "spaced":
        text = json.dumps(doc, indent=2)
    elif style == "created last":
        rest = {k: v for k, v in doc.items() if k != "created"}
        text = json.dumps({**rest, "created": doc["created"]})
    else:  # "repeated": the start says one time, the key repeated later says another
        head = json.dumps({"version": doc["version"], "created": 1.0}, separators=(",", ":"))
        rest = json.dumps(doc, separators=(",", ":"))[1:]
        text = head[:-1] + "," + rest
    (root / "checkpoints" / f"{name}.json").write_text(seal(text))  # loads as a writer's


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A vault of one real checkpoint, and its record as JSON."""
    root = tmp_path_factory.mktemp("latest") / "vault"
    _vault(root, 1)
    return root, read_record(root / "checkpoints" / "000001.json")


_STYLES = st.sampled_from(["compact", "spaced", "created last", "repeated"])


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    times=st.lists(
        st.tuples(
            # Ties on purpose: then the name decides, as list_records orders them.
            st.sampled_from([0.0, 1.5, 1e9, 1796463754.6029701, 253402128000.0, 7]),
            _STYLES,
        ),
        min_size=1,
        max_size=6,
    ),
    names=st.permutations(["000001", "000002", "best", "step-10", "a", "z.9"]),
)
def test_latest_is_what_reading_every_record_whole_gives(
    template: tuple[Path, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
    times: list[tuple[float, str]],
    names: list[str],
) -> None:
    src, doc = template
    root = tmp_path_factory.mktemp("case") / "vault"
    shutil.copytree(src, root)
    (root / "checkpoints" / "000001.json").unlink()
    for name, (created, style) in zip(names, times, strict=False):
        _write(root, name, {**doc, "created": created}, style)
    store = LocalStore(str(root))
    oracle = list_records(store)
    # Each record is placed by the time its start gives: a repeated key's first (1.0).
    styles = dict(zip(names, (style for _, style in times), strict=False))
    starts = {
        n: 1.0 if styles[n] == "repeated" else c for n, (c, _) in zip(names, times, strict=False)
    }
    order = sorted((t, n) for n, t in starts.items())
    assert creation_order(store) == order
    # The newest is read whole: if its start was not its time, every record is.
    newest = order[-1][1]
    expected = oracle[-1].name if styles[newest] == "repeated" else newest
    assert resolve(store, "latest") == expected
    if "repeated" not in styles.values():
        assert expected == oracle[-1].name
    shutil.rmtree(root)


def test_resolve_reads_only_the_newest_record_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vault = _vault(tmp_path / "v", 12)
    whole: list[str] = []
    ranged: list[tuple[str, int, int]] = []
    get, get_range = LocalStore.get, LocalStore.get_range

    def counted_get(self: LocalStore, key: str) -> bytes:
        whole.append(key)
        return get(self, key)

    def counted_range(self: LocalStore, key: str, start: int, end: int) -> bytes:
        ranged.append((key, start, end))
        return get_range(self, key, start, end)

    monkeypatch.setattr(LocalStore, "get", counted_get)
    monkeypatch.setattr(LocalStore, "get_range", counted_range)
    assert vault.resolve("latest") == "000012"
    assert [k for k in whole if k.startswith("checkpoints/")] == [record_key("000012")]
    assert len(ranged) == 12 and all(end - start <= 512 for _, start, end in ranged)
    # And a load of "latest" reads the records no more than that (and the newest again).
    whole.clear()
    out = {"w": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)}
    vault.load(out)
    assert out["w"].tolist() == [11.0] * 4
    assert [k for k in whole if k.startswith("checkpoints/")] == [record_key("000012")] * 2


def test_a_damaged_older_record_does_not_stop_a_resume_but_a_damaged_newest_does(
    tmp_path: Path,
) -> None:
    root = tmp_path / "v"
    vault = _vault(root, 3)
    second = root / "checkpoints" / "000002.json"
    text = second.read_text()
    second.write_text(text[: len(text) // 2])  # cut: its start still says when
    assert vault.resolve("latest") == "000003"
    with pytest.raises(FormatError, match="000002"):
        vault.list()  # a listing still reports every damaged record
    newest = root / "checkpoints" / "000003.json"
    text = newest.read_text()
    newest.write_text(text[: len(text) // 2])
    with pytest.raises(FormatError, match="000003"):
        vault.resolve("latest")
    # A record whose start says nothing is read whole, and its damage reported.
    newest.write_text(text)
    second.write_text("not json at all")
    with pytest.raises(FormatError, match="000002"):
        vault.resolve("latest")


@pytest.mark.parametrize(
    "head",
    [
        b"",
        b"{",
        b"[1,2]",
        b'{"version":1,"created":17964637',  # cut inside the number
        b'{"version":1,"created":"1796463754"}',  # a string, not a time
        b'{"version":1,"created":-5}',
        b'{"version":1,"created":1e999}',
        b'{"version":1,"created":true}',
        b'{"version":3,"created":5}',  # a version no weightvault writes yet
        b'{"version":01,"created":5}',  # not JSON
        b'{"version":1,"name":"\xff\xfe","created":5}',
        b'{"version":1,"created":5' + b" " * 600 + b"}",
        b"\x00" * 512,
    ],
)
def test_a_record_whose_start_does_not_say_when_is_read_whole(tmp_path: Path, head: bytes) -> None:
    root = tmp_path / "v"
    vault = _vault(root, 2)
    (root / "checkpoints" / "000003.json").write_bytes(head)
    with pytest.raises(FormatError, match="000003"):
        vault.resolve("latest")
    with pytest.raises(FormatError, match="000003"):
        creation_order(LocalStore(str(root)))


def test_an_empty_vault_has_no_latest(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no checkpoints"):
        Vault(tmp_path / "v", create=True).resolve("latest")


def test_head_fields_stop_at_the_first_value_that_is_not_a_plain_scalar() -> None:
    assert head_fields(b'{"version":1,"created":1.5,"header":"{\\"a') == {
        "version": 1,
        "created": 1.5,
    }
    assert head_fields(b'{ "version" : 1 , "metadata": {"x": 1}, "created": 2}') == {"version": 1}
    assert head_fields(b'{"created":3,"created":4}') == {"created": 3}
    assert head_fields(b'{"version":1}') == {"version": 1}


def test_a_save_with_training_state_last_reads_only_the_new_records_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropping old training state at each save read every record whole (3 ms each for
    a 70-tensor model with its AdamW, per save); the Vault remembers the ones done."""
    whole: list[str] = []
    get = LocalStore.get

    def counted_get(self: LocalStore, key: str) -> bytes:
        if key.startswith("checkpoints/") and threading.current_thread() is main:
            whole.append(key)  # the save's own reads, not its compactor's
        return get(self, key)

    main = threading.current_thread()
    monkeypatch.setattr(LocalStore, "get", counted_get)
    vault = Vault(tmp_path / "v", training_state_last=1)
    reads = []
    for i in range(12):
        whole.clear()
        vault.save({"w": np.full(4, i, np.float32)})
        vault.wait()
        reads.append(len(whole))
    assert max(reads[1:]) <= 2, reads  # the one that just lost its newest place


_PLAIN = st.text(
    alphabet=st.characters(blacklist_characters='"\\', blacklist_categories=("Cc", "Cs")),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(
    doc=st.dictionaries(
        st.from_regex(r"[A-Za-z_]{1,8}", fullmatch=True),
        st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.booleans()
        | st.none()
        | _PLAIN,
        max_size=6,
    ),
    spaced=st.booleans(),
    cut=st.integers(min_value=0, max_value=400),
)
def test_head_fields_read_scalars_as_json_does(doc: dict[str, Any], spaced: bool, cut: int) -> None:
    text = json.dumps(doc, ensure_ascii=False, **({} if spaced else {"separators": (",", ":")}))
    data = text.encode()
    assert head_fields(data) == doc
    # A cut start gives the fields before the cut, each as JSON reads it.
    got = head_fields(data[:cut])
    assert list(got) == list(doc)[: len(got)]
    assert all(type(v) is type(doc[k]) and v == doc[k] for k, v in got.items())
