"""Property: whatever saves, deletions and compactions a run makes, once compaction settles
the oldest checkpoint and the newest are whole, no chain is longer than ``delta_chain``,
and every checkpoint loads exactly what was saved."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from weightvault import Vault  # noqa: E402
from weightvault._vault.frame import HEADER_SIZE, is_frame, parse_frame_header  # noqa: E402
from weightvault._vault.objects import object_file  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
N = 4096  # floats per tensor: one block


def base_of(vault: Vault, digest: str) -> str | None:
    """The digest a delta object is built on; None for a full or raw object (loose or in
    a pack)."""
    head = bytes(object_file(vault.store, digest)[:HEADER_SIZE])
    if not is_frame(head):
        return None
    return parse_frame_header(memoryview(head)).base


#: One step of a run: ("save",) drifts the weights and saves; ("delete", i) removes the
#: i-th checkpoint (mod how many there are); ("compact",) settles the vault.
Step = tuple[Any, ...]


@st.composite
def runs(draw: Any) -> tuple[int, list[Step]]:
    k = draw(st.integers(1, 3))
    steps: list[Step] = [("save",)]
    for _ in range(draw(st.integers(2, 12))):
        steps.append(
            draw(
                st.one_of(
                    st.just(("save",)),
                    st.tuples(st.just("delete"), st.integers(0, 20)),
                    st.just(("compact",)),
                )
            )
        )
    return k, steps


@SETTINGS
@given(runs())
def test_the_oldest_is_whole_whatever_was_deleted(run: tuple[int, list[Step]]) -> None:
    k, steps = run
    rng = np.random.default_rng(0)
    weights = {f"t{i}": (rng.standard_normal(N) * 0.02).astype(np.float32) for i in range(3)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        vault = Vault(root, delta_chain=k)
        saved: dict[str, dict[str, Any]] = {}
        for step in steps:
            if step[0] == "save":
                for v in weights.values():
                    v += (rng.standard_normal(N) * 1e-5).astype(np.float32)
                saved[vault.save(weights).name] = {n: v.copy() for n, v in weights.items()}
            elif step[0] == "delete" and len(saved) > 1:
                name = sorted(saved)[step[1] % len(saved)]
                vault.delete(name)
                del saved[name]
            elif step[0] == "compact":
                vault.compact()
        vault.compact()  # settles
        names = [r.name for r in vault.list()]
        assert names == sorted(saved)
        objects = {}
        for n in names:
            with vault.open(n) as ckpt:
                objects[n] = dict(ckpt.objects)
        for name in (names[0], names[-1]):
            for tensor, digest in objects[name].items():
                assert base_of(vault, digest) is None, (name, tensor)
        for name in names:
            for tensor, digest in objects[name].items():
                links = 0
                while (digest := base_of(vault, digest)) is not None:  # type: ignore[assignment]
                    links += 1
                    assert links <= k, (name, tensor, links)
            with vault.open(name) as ckpt:
                for tensor, want in saved[name].items():
                    raw = np.frombuffer(bytes(ckpt.raw(tensor)), np.float32)
                    assert np.array_equal(raw, want), (name, tensor)
        assert vault.verify().ok
