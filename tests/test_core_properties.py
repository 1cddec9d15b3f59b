"""Properties of the core planners, on plain bytes: no framework is imported.

``plan`` (what to write) and ``plan_load`` (what to copy where) only see
:class:`Source` and :class:`Target` records, so they are tested here on records built
from bytes: ties become aliases, equal bytes become copies (or duplicates), and loading
the plan back assigns every name the bytes it was saved with.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings, strategies as st

from weightvault._file.checkpoint import MemoryCheckpoint
from weightvault._file.sharing import Source, plan
from weightvault._load.plan import LoadOptions, Target, plan_load

DTYPES = {"U8": 1, "F16": 2, "F32": 4}


@st.composite
def models(draw: st.DrawFn) -> list[tuple[str, str, tuple[int, ...], bytes, int]]:
    """``(name, dtype, shape, bytes, identity)`` records; later ones may tie or copy."""
    out: list[tuple[str, str, tuple[int, ...], bytes, int]] = []
    for i in range(draw(st.integers(1, 8))):
        how = draw(st.sampled_from(["new", "tie", "copy"])) if out else "new"
        if how == "new":
            dtype = draw(st.sampled_from(sorted(DTYPES)))
            shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
            n = DTYPES[dtype]
            for d in shape:
                n *= d
            out.append((f"t{i}", dtype, shape, draw(st.binary(min_size=n, max_size=n)), i))
        else:
            _, dtype, shape, data, identity = draw(st.sampled_from(out))
            out.append((f"t{i}", dtype, shape, data, identity if how == "tie" else i))
    return out


def _sources(model: list[tuple[str, str, tuple[int, ...], bytes, int]]) -> list[Source]:
    return [
        Source(name, dtype, shape, identity, lambda d=data: memoryview(d))
        for name, dtype, shape, data, identity in model
    ]


@settings(max_examples=150, deadline=None)
@given(models(), st.booleans())
def test_plan_stores_each_distinct_tensor_once(
    model: list[tuple[str, str, tuple[int, ...], bytes, int]], dedupe: bool
) -> None:
    p = plan(_sources(model), dedupe_copies=dedupe)
    first_of: dict[int, str] = {}
    kept: dict[tuple[str, tuple[int, ...], bytes], str] = {}
    aliases, copies, stored = {}, {}, []
    for name, dtype, shape, data, identity in model:
        if identity in first_of:
            aliases[name] = first_of[identity]
            continue
        first_of[identity] = name
        key = (dtype, shape, data)
        if key in kept and dedupe:
            copies[name] = kept[key]
        else:
            stored.append(name)
            kept.setdefault(key, name)
    assert p.names == [m[0] for m in model]
    assert p.aliases == aliases
    assert p.copies == copies
    assert [s.name for s in p.stored] == stored
    assert p.stored_bytes == sum(len(m[3]) for m in model if m[0] in stored)


@settings(max_examples=150, deadline=None)
@given(models(), st.booleans())
def test_plan_load_gives_every_name_its_saved_bytes(
    model: list[tuple[str, str, tuple[int, ...], bytes, int]], dedupe: bool
) -> None:
    p = plan(_sources(model), dedupe_copies=dedupe)
    by_name = {m[0]: m for m in model}
    ckpt = MemoryCheckpoint(
        "memory",
        {s.name: (s.dtype, s.shape, s.data()) for s in p.stored},
        p.manifest(),
    )
    targets = [Target(name, identity, dtype, shape) for name, dtype, shape, _, identity in model]
    lp = plan_load(ckpt, targets, LoadOptions(strict=True))
    assigned = {n: a.source for a in lp.assignments for n in a.names}
    assert sorted(assigned) == sorted(by_name)
    assert sorted(lp.report.loaded) == sorted(by_name)
    for name, source in assigned.items():
        e = ckpt.entry(source)
        assert bytes(ckpt.raw(e.stored)) == by_name[name][3], name
    # A tie in the model is one assignment: its names are filled once, together.
    for a in lp.assignments:
        assert len({by_name[n][4] for n in a.names}) == 1


def test_the_core_needs_no_framework() -> None:
    code = (
        "import sys, weightvault._load.plan, weightvault._file.sharing\n"
        "import weightvault._file.checkpoint\n"
        "print(sorted({'torch', 'keras', 'jax', 'numpy'} & set(sys.modules)))"
    )
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
