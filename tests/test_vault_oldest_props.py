"""Property: whatever saves, deletions, retains and compactions a run makes, once
compaction settles the newest checkpoint is whole, so is the oldest when it holds training
state (one resumes from it), every other object is whole or one delta on a whole object
(an anchor: a load reads at most two objects per tensor), training state is never a
delta, at most ``delta_chain`` deltas of a tensor (and an oldest made history) point at
one anchor, and every
checkpoint loads exactly what was saved.

Three kinds of run: every checkpoint resumable, ``Vault(training_state_last=1)`` (the oldest
weights-only from the second save on), and every checkpoint resumable until a
``retain(training_state_last=1)`` at the end; retains of either kind may come in
between."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from weightvault import Vault  # noqa: E402
from weightvault._file.layout import is_training  # noqa: E402
from weightvault._vault.objects.file import object_file  # noqa: E402
from weightvault._vault.objects.frame import HEADER_SIZE, is_frame, parse_frame_header  # noqa: E402

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
def runs(draw: Any) -> tuple[int, str, list[Step]]:
    k = draw(st.integers(1, 3))
    mode = draw(st.sampled_from(["resumable", "training_state_last", "retain afterwards"]))
    steps: list[Step] = [("save",)]
    for _ in range(draw(st.integers(2, 12))):
        steps.append(
            draw(
                st.one_of(
                    st.just(("save",)),
                    st.tuples(st.just("delete"), st.integers(0, 20)),
                    st.just(("compact",)),
                    st.tuples(
                        st.just("retain"),
                        st.sampled_from(["keep_last", "training_state_last"]),
                        st.integers(1, 4),
                    ),
                )
            )
        )
    return k, mode, steps


@SETTINGS
@given(runs())
def test_every_checkpoint_reads_at_most_two_objects_per_tensor_whatever_was_deleted(
    run: tuple[int, str, list[Step]],
) -> None:
    k, mode, steps = run
    rng = np.random.default_rng(0)
    weights = {
        f"t{i}": torch.from_numpy((rng.standard_normal(N) * 0.02).astype(np.float32))
        for i in range(3)
    }
    weights["t0"].requires_grad_()
    opt = torch.optim.SGD([weights["t0"]], lr=0.0, momentum=0.9)  # state to resume from
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        last = 1 if mode == "training_state_last" else None
        vault = Vault(root, delta_chain=k, training_state_last=last)
        saved: dict[str, dict[str, Any]] = {}
        for step in steps:
            if step[0] == "save":
                with torch.no_grad():
                    for v in weights.values():
                        v += torch.from_numpy((rng.standard_normal(N) * 1e-5).astype(np.float32))
                weights["t0"].grad = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
                opt.step()
                name = vault.save(weights, optimizer=opt).name
                saved[name] = {n: v.detach().numpy().copy() for n, v in weights.items()}
            elif step[0] == "delete" and len(saved) > 1:
                name = sorted(saved)[step[1] % len(saved)]
                vault.delete(name)
                del saved[name]
            elif step[0] == "compact":
                vault.compact()
            elif step[0] == "retain":
                for name in vault.retain(**{step[1]: step[2]}):
                    del saved[name]
        if mode == "retain afterwards":
            vault.retain(training_state_last=1)
        vault.compact()  # settles
        records = vault.list()
        names = [r.name for r in records]
        assert names == sorted(saved)
        objects = {}
        for n in names:
            with vault.open(n) as ckpt:
                objects[n] = dict(ckpt.objects)
        whole = [names[-1]]
        if any(is_training(t) for t in objects[names[0]]):
            whole.append(names[0])  # resumable: kept whole
        else:
            dropped = any(s[:2] == ("retain", "training_state_last") for s in steps)
            assert mode != "resumable" or len(names) == 1 or dropped
        for name in whole:
            for tensor, digest in objects[name].items():
                assert base_of(vault, digest) is None, (name, tensor)
        on_anchor: dict[tuple[str, str], set[str]] = {}
        for name in names:
            for tensor, digest in objects[name].items():
                base = base_of(vault, digest)
                if base is None:
                    continue
                assert not is_training(tensor), (name, tensor)
                assert base_of(vault, base) is None, (name, tensor)  # two objects at most
                on_anchor.setdefault((tensor, base), set()).add(digest)
        # K deltas of the checkpoints after an anchor, and a weights-only oldest made
        # history on the anchor of the one after it.
        assert all(len(d) <= k + 1 for d in on_anchor.values()), on_anchor
        for name in names:
            with vault.open(name) as ckpt:
                for tensor, want in saved[name].items():
                    raw = np.frombuffer(bytes(ckpt.raw(tensor)), np.float32)
                    assert np.array_equal(raw, want), (name, tensor)
        assert vault.verify().ok
