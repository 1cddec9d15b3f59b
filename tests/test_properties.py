"""Property tests of the core with PyTorch: whatever is saved comes back exactly.

Random dicts of tensors and random module trees, with ties (one object under several
names), copies (equal values in separate memory) and views (several layouts over one
storage), in every supported dtype including 0-d and zero-size shapes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault.torch as wvt  # noqa: E402

DTYPES = [
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
]
FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64]
#: Dtypes a tensor of each item size may be reinterpreted as (never as bool: a bool view
#: of arbitrary bytes holds values other than 0 and 1).
SAME_SIZE = {
    1: [torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2],
    2: [torch.int16, torch.uint16, torch.float16, torch.bfloat16],
    4: [torch.int32, torch.uint32, torch.float32],
    8: [torch.int64, torch.uint64, torch.float64, torch.complex64],
}

SETTINGS = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def bits(t: Any) -> Any:
    """The raw bytes of ``t`` in logical order: equality without NaN != NaN."""
    # A fresh 1-D copy: ``contiguous()`` keeps odd strides of size-1 dims, which ``view``
    # with another item size refuses.
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


def same_value(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(bits(a), bits(b)))


def layout(t: Any) -> tuple[Any, ...]:
    """What makes two names one tensor: the same memory read the same way."""
    if t.numel() == 0:
        return ("object", id(t))
    ptr = t.untyped_storage().data_ptr()
    return (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def storage(t: Any) -> int:
    return int(t.untyped_storage().data_ptr())


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)


@dataclass(frozen=True)
class Spec:
    """A tensor's dtype, shape and bytes; ``make()`` builds a fresh tensor from it."""

    dtype: Any
    shape: tuple[int, ...]
    raw: bytes

    def make(self, *, invert: bool = False) -> Any:
        if not self.raw:
            return torch.zeros(self.shape, dtype=self.dtype)
        data = bytes(b ^ 0xFF for b in self.raw) if invert else self.raw
        u8 = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
        if self.dtype == torch.bool:
            u8 = u8 % 2
        return u8.view(self.dtype).reshape(self.shape)


@st.composite
def specs(draw: st.DrawFn, dtypes: list[Any] = DTYPES) -> Spec:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes)
    n = 1
    for d in shape:
        n *= d
    size = n * torch.empty((), dtype=dtype).element_size()
    # Small alphabets make equal tensors (dedup as copies) likely; random bytes give NaNs.
    raw = draw(st.binary(min_size=size, max_size=size) | st.just(bytes(size)))
    return Spec(dtype, shape, raw)


#: View kinds: the first six start at the base's first element, the last two past it.
VIEW_KINDS = ["prefix", "strided", "transpose", "flat", "column", "dtype", "suffix", "middle"]


def make_view(base: Any, kind: str, k: int, dtype_pick: int) -> Any | None:
    """A view of ``base`` (contiguous, non-empty), or ``None`` if ``kind`` does not apply."""
    n = base.numel()
    flat = base.reshape(-1)
    if kind == "prefix":
        return flat[: 1 + k % n]
    if kind == "strided":
        return flat[:: 2 + k % 3] if n > 1 else None
    if kind == "transpose":
        return base.transpose(0, -1) if base.dim() >= 2 else None
    if kind == "flat":
        return flat if base.dim() != 1 else None
    if kind == "column":
        return flat.reshape(n, 1)
    if kind == "dtype":
        options = [d for d in SAME_SIZE[base.element_size()] if d != base.dtype]
        if base.dtype == torch.bool:
            return None
        return base.view(options[dtype_pick % len(options)])
    if kind == "suffix":
        return flat[1 + k % (n - 1) :] if n > 1 else None
    if kind == "middle":
        return flat[1 : n - 1] if n > 2 else None
    raise AssertionError(kind)


@dataclass
class Case:
    """A dict of tensors and what each name is: a root, a tie, a copy or a view."""

    tensors: dict[str, Any] = field(default_factory=dict)
    kind: dict[str, str] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)  # tie/copy/view -> its source


@st.composite
def cases(draw: st.DrawFn, view_kinds: list[str] = VIEW_KINDS, tie_any: bool = False) -> Case:
    """``tie_any``: a tie may name a copy or a view too, not only a root tensor."""
    case = Case()
    roots: list[str] = []
    for i in range(draw(st.integers(1, 8))):
        name = f"t{i}"
        op = "root" if not case.tensors else draw(st.sampled_from(["root", "tie", "copy", "view"]))
        if op == "view":
            viewable = [r for r in roots if case.tensors[r].numel() > 0]
            if not viewable:
                op = "root"
        if op == "root":
            case.tensors[name] = draw(specs()).make()
            roots.append(name)
        elif op in ("tie", "copy"):
            pool = list(case.tensors) if op == "copy" or tie_any else roots
            src = draw(st.sampled_from(pool))
            t = case.tensors[src]
            case.tensors[name] = t if op == "tie" else t.clone()
            case.source[name] = src
        else:
            src = draw(st.sampled_from(viewable))
            kind = draw(st.sampled_from(view_kinds))
            v = make_view(case.tensors[src], kind, draw(st.integers(0, 99)), draw(st.integers()))
            if v is None:  # the kind does not apply to this base: tie the base instead
                op = "tie"
                v = case.tensors[src]
            case.tensors[name] = v
            case.source[name] = src
        case.kind[name] = op
    return case


# ---------------------------------------------------------------------------------------
# Dicts of tensors
# ---------------------------------------------------------------------------------------


def expected_stored_bytes(tensors: dict[str, Any]) -> int:
    """Each distinct tensor once: a storage read through several layouts counts once (its
    base covers the others), and separate tensors with equal dtype, shape and bytes count
    once."""
    by_storage: dict[int, list[Any]] = {}
    distinct: dict[tuple[Any, ...], Any] = {}
    for t in tensors.values():
        distinct.setdefault(layout(t), t)
    for t in distinct.values():
        if t.numel() > 0:
            by_storage.setdefault(storage(t), []).append(t)
    total = 0
    values: set[tuple[Any, ...]] = set()
    for members in by_storage.values():
        if len(members) > 1:
            size = max(m.untyped_storage().nbytes() for m in members)
            total += size
            # Every tensor of a shared storage is placed (the base stored, the rest views),
            # and a separate tensor equal to any of them is a copy of it.
            for m in members:
                values.add((m.dtype, tuple(m.shape), bytes(bits(m).numpy())))
    for t in distinct.values():
        if t.numel() > 0 and len(by_storage[storage(t)]) > 1:
            continue  # part of a storage with views: counted once above
        key = (t.dtype, tuple(t.shape), bytes(bits(t).numpy()))
        if key not in values:
            values.add(key)
            total += t.numel() * t.element_size()
    return total


def check_round_trip(case: Case, path: Path) -> None:
    tensors = case.tensors
    wvt.save(tensors, path)
    out = wvt.load_file(path)

    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert same_value(out[name], t), name

    for name, kind in case.kind.items():
        if kind == "root":
            continue
        src = case.source[name]
        if kind == "tie":
            assert out[name] is out[src], name
        elif kind == "copy":
            assert out[name] is not out[src], name
            assert same_value(out[name], out[src]), name
            if out[name].numel() > 0:
                assert storage(out[name]) != storage(out[src]), name
        else:
            assert storage(out[name]) == storage(out[src]), name
            if out[name].numel() > 0:
                assert out[name].stride() == tensors[name].stride(), name

    # The same object in, the same object out; otherwise separate objects.
    ids = {name: id(t) for name, t in tensors.items()}
    for a in tensors:
        for b in tensors:
            if ids[a] == ids[b]:
                assert out[a] is out[b], (a, b)

    info = weightvault.inspect(path)
    assert info.names == list(tensors)
    # Copies stay stored by default, and inspect knows exactly what deduping them saves.
    assert info.stored_bytes - info.dedupe_savings == expected_stored_bytes(tensors)
    assert info.logical_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert weightvault.verify(path).ok

    again = path.with_name("again.safetensors")
    wvt.save(tensors, again)
    assert again.read_bytes() == path.read_bytes()

    deduped = path.with_name("deduped.safetensors")
    wvt.save(tensors, deduped, dedupe_copies=True)
    assert weightvault.inspect(deduped).stored_bytes == expected_stored_bytes(tensors)
    assert list(wvt.load_file(deduped)) == list(tensors)

    mapped = wvt.load_file(path, mmap=True)
    for name, t in tensors.items():
        assert same_value(mapped[name], t), name


@SETTINGS
@given(case=cases())
def test_dict_round_trip(tmp_path: Path, case: Case) -> None:
    check_round_trip(case, tmp_path / "d.safetensors")


@settings(SETTINGS, derandomize=True)
@given(case=cases(tie_any=True))
def test_dict_round_trip_full_generality(tmp_path: Path, case: Case) -> None:
    check_round_trip(case, tmp_path / "d.safetensors")


@SETTINGS
@given(spec=specs())
def test_single_tensor_any_dtype_and_shape(tmp_path: Path, spec: Spec) -> None:
    t = spec.make()
    path = tmp_path / "one.safetensors"
    wvt.save({"x": t}, path)
    out = wvt.load_file(path)["x"]
    assert same_value(out, t)
    assert weightvault.inspect(path).stored_bytes == t.numel() * t.element_size()


@SETTINGS
@given(specs=st.lists(specs(), min_size=1, max_size=6))
def test_dedupe_off_stores_every_separate_tensor(tmp_path: Path, specs: list[Spec]) -> None:
    tensors = {f"t{i}": s.make() for i, s in enumerate(specs)}
    path = tmp_path / "nodedupe.safetensors"
    wvt.save(tensors, path, dedupe_copies=False)
    info = weightvault.inspect(path)
    assert info.copies == {}
    assert set(info.stored) == set(tensors)
    assert info.stored_bytes == info.logical_bytes
    out = wvt.load_file(path)
    for name, t in tensors.items():
        assert same_value(out[name], t), name


def test_zero_offset_views_read_their_own_bytes(tmp_path: Path) -> None:
    a = torch.arange(10, dtype=torch.float32)
    path = tmp_path / "v.safetensors"
    wvt.save({"a": a, "b": a[:3], "c": a.reshape(2, 5).t()}, path)
    out = wvt.load_file(path)
    assert torch.equal(out["b"], a[:3])
    assert torch.equal(out["c"], a.reshape(2, 5).t())


@pytest.mark.parametrize("mmap", [False, True])
def test_offset_view_reads_its_own_bytes(tmp_path: Path, mmap: bool) -> None:
    """Regression: views past their base's first byte were read from the first byte
    (``as_strided(..., storage_offset=0)``)."""
    a = torch.arange(10, dtype=torch.float32)
    path = tmp_path / "v.safetensors"
    wvt.save({"a": a, "b": a[2:5]}, path)
    assert weightvault.inspect(path).views == ["b"]
    out = wvt.load_file(path, mmap=mmap)
    assert torch.equal(out["b"], a[2:5]), out["b"]


def test_overlapping_slices_without_cover(tmp_path: Path) -> None:
    base = torch.arange(10, dtype=torch.int64)
    path = tmp_path / "v.safetensors"
    wvt.save({"x": base[1:6], "y": base[3:9]}, path)
    out = wvt.load_file(path)
    assert torch.equal(out["x"], base[1:6])
    assert torch.equal(out["y"], base[3:9]), out["y"]


# ---------------------------------------------------------------------------------------
# Module trees
# ---------------------------------------------------------------------------------------


@dataclass
class ModuleSpec:
    """A module tree: nodes, parameters, buffers, ties, copies and buffer views."""

    parents: list[int]  # parent node of node i+1; node 0 is the root
    items: list[tuple[Any, ...]]  # (op, node, *args), applied in order


@st.composite
def module_specs(
    draw: st.DrawFn, view_kinds: list[str] = VIEW_KINDS, tie_any: bool = False
) -> ModuleSpec:
    parents: list[int] = []
    for i in range(draw(st.integers(0, 4))):
        parents.append(draw(st.integers(0, i)))
    nodes = len(parents) + 1
    items: list[tuple[Any, ...]] = []
    params: list[int] = []  # indices into items
    root_params: list[int] = []
    buffers: list[int] = []
    for i in range(draw(st.integers(1, 8))):
        node = draw(st.integers(0, nodes - 1))
        ops = ["param", "buffer"]
        if params:
            ops += ["tie", "param_copy"]
        if buffers:
            ops += ["buffer_view", "buffer_copy"]
        op = draw(st.sampled_from(ops))
        if op == "param":
            spec = draw(specs())
            trainable = spec.dtype in FLOATS and draw(st.booleans())
            items.append(("param", node, spec, trainable))
            params.append(i)
            root_params.append(i)
        elif op == "buffer":
            items.append(("buffer", node, draw(specs())))
            buffers.append(i)
        elif op == "tie":
            items.append((op, node, draw(st.sampled_from(params if tie_any else root_params))))
        elif op == "param_copy":
            items.append((op, node, draw(st.sampled_from(params))))
            params.append(i)
        elif op == "buffer_copy":
            items.append((op, node, draw(st.sampled_from(buffers))))
            buffers.append(i)
        else:
            items.append(
                (
                    op,
                    node,
                    draw(st.sampled_from(buffers)),
                    draw(st.sampled_from(view_kinds)),
                    draw(st.integers(0, 99)),
                    draw(st.integers()),
                )
            )
            buffers.append(i)
    return ModuleSpec(parents, items)


def build(spec: ModuleSpec, *, invert: bool = False) -> nn.Module:
    """The module ``spec`` describes; ``invert`` gives the same structure, other values."""
    nodes = [nn.Module()]
    for i, parent in enumerate(spec.parents):
        child = nn.Module()
        nodes[parent].add_module(f"m{i + 1}", child)
        nodes.append(child)
    made: dict[int, Any] = {}
    for i, (op, node, *args) in enumerate(spec.items):
        owner, attr = nodes[node], f"t{i}"
        if op == "param":
            tspec, trainable = args
            value = nn.Parameter(tspec.make(invert=invert), requires_grad=trainable)
            owner.register_parameter(attr, value)
        elif op == "buffer":
            value = args[0].make(invert=invert)
            owner.register_buffer(attr, value)
        elif op == "tie":
            value = made[args[0]]
            owner.register_parameter(attr, value)
        elif op == "param_copy":
            value = copy.deepcopy(made[args[0]])
            owner.register_parameter(attr, value)
        elif op == "buffer_copy":
            value = made[args[0]].clone()
            owner.register_buffer(attr, value)
        else:
            src, kind, k, pick = args
            base = made[src]
            # A view of an empty buffer, or of a kind that does not apply, is a tie.
            value = make_view(base, kind, k, pick) if base.numel() else None
            if value is None:
                value = base
            owner.register_buffer(attr, value)
        made[i] = value
    return nodes[0]


def check_module_round_trip(spec: ModuleSpec, tmp_path: Path) -> None:
    model = build(spec)
    path = tmp_path / "m.safetensors"
    report = wvt.save(model, path)
    state = model.state_dict(keep_vars=True)
    assert report.skipped == []

    info = weightvault.inspect(path)
    assert info.names == list(state)
    frozen = [n for n, t in state.items() if isinstance(t, nn.Parameter) and not t.requires_grad]
    assert info.frozen == frozen
    assert weightvault.verify(path).ok

    fresh = build(spec, invert=True)
    loaded = wvt.load(fresh, path)
    assert loaded.missing == [] and loaded.unexpected == []
    fresh_state = fresh.state_dict(keep_vars=True)
    assert list(fresh_state) == list(state)
    for name, t in state.items():
        assert same_value(fresh_state[name], t), name
    # Loading fills in place: the fresh model's own ties are still ties.
    for a, ta in fresh_state.items():
        for b, tb in fresh_state.items():
            if state[a] is state[b]:
                assert ta is tb, (a, b)

    out = wvt.load_file(path)
    for name, t in state.items():
        assert same_value(out[name], t), name

    again = tmp_path / "again.safetensors"
    wvt.save(model, again)
    assert again.read_bytes() == path.read_bytes()


@SETTINGS
@given(spec=module_specs())
def test_module_round_trip(tmp_path: Path, spec: ModuleSpec) -> None:
    check_module_round_trip(spec, tmp_path)


@settings(SETTINGS, derandomize=True)
@given(spec=module_specs(tie_any=True))
def test_module_round_trip_full_generality(tmp_path: Path, spec: ModuleSpec) -> None:
    check_module_round_trip(spec, tmp_path)


def test_module_offset_view_buffer(tmp_path: Path) -> None:
    def build() -> nn.Module:
        m = nn.Module()
        m.register_buffer("base", torch.zeros(8))
        m.register_buffer("tail", m.base[4:])
        return m

    model = build()
    model.base.copy_(torch.arange(8, dtype=torch.float32))
    path = tmp_path / "m.safetensors"
    wvt.save(model, path)
    fresh = build()
    wvt.load(fresh, path)
    assert torch.equal(fresh.base, torch.arange(8, dtype=torch.float32)), fresh.base
    assert torch.equal(fresh.tail, torch.arange(4, 8, dtype=torch.float32)), fresh.tail
    assert fresh.tail.untyped_storage().data_ptr() == fresh.base.untyped_storage().data_ptr()
    out = wvt.load_file(path)
    assert torch.equal(out["tail"], torch.arange(4, 8, dtype=torch.float32))
    assert storage(out["tail"]) == storage(out["base"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_one_element_tensor_with_odd_stride(tmp_path: Path, dtype: Any) -> None:
    x = torch.arange(2).to(dtype)[::2]  # shape [1], stride [2]
    assert x.stride() == (2,) and x.is_contiguous()
    path = tmp_path / "s.safetensors"
    wvt.save({"x": x}, path)
    assert same_value(wvt.load_file(path)["x"], x)


# ---------------------------------------------------------------------------------------
# Ties of copies and of views: the kept name of an alias must be stored
# ---------------------------------------------------------------------------------------


def test_tie_of_a_copy_is_readable(tmp_path: Path) -> None:
    x = torch.arange(6.0)
    c = x.clone()
    path = tmp_path / "c.safetensors"
    wvt.save({"a": x, "b": c, "c": c}, path)
    out = wvt.load_file(path)
    assert out["c"] is out["b"] and out["b"] is not out["a"]


def test_tie_of_a_view_is_readable(tmp_path: Path) -> None:
    x = torch.arange(6.0).reshape(2, 3)
    v = x.t()
    path = tmp_path / "v.safetensors"
    wvt.save({"a": x, "v": v, "w": v}, path)
    out = wvt.load_file(path)
    assert out["w"] is out["v"] and torch.equal(out["v"], v)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_deepcopy_of_a_tied_model_round_trips(tmp_path: Path) -> None:
    """An EMA or teacher copy of a tied model: the copy's embedding is deduped as a copy,
    and its head is an alias of that copy."""
    student = TiedLM()
    pair = nn.ModuleDict({"student": student, "ema": copy.deepcopy(student)})
    path = tmp_path / "pair.safetensors"
    wvt.save(pair, path)
    fresh = nn.ModuleDict({"student": TiedLM(), "ema": TiedLM()})
    wvt.load(fresh, path)
    assert torch.equal(fresh.ema.head.weight, student.emb.weight)
