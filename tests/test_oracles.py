"""safetensors as an oracle, both ways.

* Files weightvault writes open with the reference reader, with equal values, the
  ``"format": "pt"`` entry and the de facto ``{alias: kept}`` metadata.
* Files the reference writer produces (``save_file``, ``save_model``, hand-written alias
  metadata, chains) read back with weightvault, aliases as one tensor again.
* For tensors without any sharing, the bytes of each tensor in our data section are the
  bytes safetensors writes for it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
st = pytest.importorskip("safetensors.torch")

from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault.torch as wv  # noqa: E402


def _bitwise_equal(a: Any, b: Any) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    ua = a.detach().contiguous().reshape(-1).view(torch.uint8)
    ub = b.detach().contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(ua, ub))


def _sections(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The header of a safetensors file and each tensor's bytes, parsed by hand."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        out[name] = data[start:end]
    return header, out


def _varied(seed: int = 0) -> dict[str, Any]:
    """One tensor of every dtype both libraries store, plus the awkward shapes."""
    g = torch.Generator().manual_seed(seed)
    f32 = torch.randn(3, 5, generator=g)
    return {
        "f64": torch.randn(4, 3, generator=g, dtype=torch.float64),
        "f32": f32,
        "f16": torch.randn(7, generator=g).half(),
        "bf16": torch.randn(2, 3, 4, generator=g).bfloat16(),
        "f8_e4m3": (torch.randn(6, 2, generator=g) * 4).to(torch.float8_e4m3fn),
        "f8_e5m2": (torch.randn(5, generator=g) * 4).to(torch.float8_e5m2),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "i64": torch.randint(-(2**62), 2**62, (4,), generator=g, dtype=torch.int64),
        "i32": torch.randint(-(2**31), 2**31 - 1, (3, 2), generator=g, dtype=torch.int32),
        "i16": torch.randint(-(2**15), 2**15 - 1, (5,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (2, 2), generator=g, dtype=torch.uint8),
        "u16": torch.randint(0, 2**15, (3,), generator=g, dtype=torch.int32).to(torch.uint16),
        "u32": torch.randint(0, 2**31 - 1, (3,), generator=g, dtype=torch.int64).to(torch.uint32),
        "u64": torch.randint(0, 2**62, (2,), generator=g, dtype=torch.int64).to(torch.uint64),
        "bool": torch.rand(11, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "scalar_i64": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "empty_bf16": torch.empty(3, 0, dtype=torch.bfloat16),
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]),
    }


class Tied(nn.Module):
    """An embedding and a head that share one weight, like a language model."""

    def __init__(self, seed: int = 0, tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: Any) -> Any:
        return self.head(self.body(self.embed(ids)))


# --- our files, read by safetensors -------------------------------------------------------


def test_safe_open_reads_our_varied_dtypes(tmp_path: Path) -> None:
    tensors = _varied()
    path = tmp_path / "ours.safetensors"
    wv.save(tensors, path)

    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "pt"
        assert set(f.keys()) == set(tensors)
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            assert _bitwise_equal(f.get_tensor(name), tensors[name]), name
    loaded = st.load_file(path)
    assert set(loaded) == set(tensors)
    for name, t in loaded.items():
        assert _bitwise_equal(t, tensors[name]), name


def test_safetensors_sees_our_alias_metadata(tmp_path: Path) -> None:
    model = Tied()
    path = tmp_path / "tied.safetensors"
    report = wv.save(model, path)
    assert report.aliases == {"head.weight": "embed.weight"}

    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "pt"
        assert meta["head.weight"] == "embed.weight"  # the de facto {alias: kept}
        assert "weightvault" in meta
        json.loads(meta["weightvault"])  # the manifest is plain JSON for any reader
        assert set(f.keys()) == {"embed.weight", "body.weight", "body.bias"}
        kept = f.get_tensor(meta["head.weight"])
    assert _bitwise_equal(kept, model.head.weight)

    state = model.state_dict()
    for name, t in st.load_file(path).items():
        assert _bitwise_equal(t, state[name]), name


def test_safetensors_load_model_fills_a_tied_model_from_our_file(tmp_path: Path) -> None:
    model = Tied(seed=0)
    path = tmp_path / "tied.safetensors"
    wv.save(model, path)
    fresh = Tied(seed=1)
    missing, unexpected = st.load_model(fresh, path)
    assert not missing and not unexpected
    for name, t in model.state_dict().items():
        assert _bitwise_equal(fresh.state_dict()[name], t), name


def test_metadata_alias_entries_cover_every_alias(tmp_path: Path) -> None:
    # Three names for one tensor, plus a buffer alias: every alias names the kept tensor
    # directly (no chains), so the simplest reader resolves it in one step.
    w = torch.randn(3, 3)
    b = torch.arange(4.0)
    tensors = {"a": w, "b": w, "c": w, "buf": b, "buf2": b, "other": torch.randn(2)}
    path = tmp_path / "aliases.safetensors"
    wv.save(tensors, path)
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        stored = set(f.keys())
    assert stored == {"a", "buf", "other"}
    assert {k: meta[k] for k in ("b", "c", "buf2")} == {"b": "a", "c": "a", "buf2": "buf"}
    reserved = ("format", "weightvault", "weightvault.header_sum")
    assert all(v in stored for k, v in meta.items() if k not in reserved)


def test_user_metadata_is_visible_and_not_taken_for_aliases(tmp_path: Path) -> None:
    # safetensors users read their metadata with safe_open; weightvault reads ties from
    # its manifest, so a value that happens to be a tensor name is not an alias.
    path = tmp_path / "meta.safetensors"
    wv.save({"w": torch.ones(2)}, path, metadata={"note": "w", "step": "10"})
    with safetensors.safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["note"] == "w" and meta["step"] == "10" and meta["format"] == "pt"
    assert weightvault.inspect(path).metadata == {"note": "w", "step": "10"}
    assert weightvault.inspect(path).aliases == {}
    assert list(wv.load_file(path)) == ["w"]


# --- safetensors files, read by weightvault -----------------------------------------------


def test_we_read_save_file_output(tmp_path: Path) -> None:
    tensors = _varied(seed=1)
    path = tmp_path / "ref.safetensors"
    st.save_file(tensors, str(path), metadata={"step": "3"})

    loaded = wv.load_file(path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert _bitwise_equal(loaded[name], t), name
    mapped = wv.load_file(path, mmap=True)
    for name, t in tensors.items():
        assert _bitwise_equal(mapped[name], t), name

    info = weightvault.inspect(path)
    assert info.aliases == {} and info.copies == {}
    assert info.metadata == {"step": "3"}
    assert info.format_version is None  # not ours
    assert info.stored_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert weightvault.verify(path).ok


def test_we_read_e8m0_both_ways(tmp_path: Path) -> None:
    t = torch.tensor([0.5, 1.0, 2.0, 1024.0]).to(torch.float8_e8m0fnu)
    ours, ref = tmp_path / "ours.safetensors", tmp_path / "ref.safetensors"
    wv.save({"scale": t}, ours)
    st.save_file({"scale": t}, str(ref))
    assert _bitwise_equal(st.load_file(ours)["scale"], t)
    assert _bitwise_equal(wv.load_file(ref)["scale"], t)


def test_save_model_output_round_trips_aliases(tmp_path: Path) -> None:
    model = Tied(seed=0)
    path = tmp_path / "ref.safetensors"
    st.save_model(model, str(path))
    # safetensors keeps the sorted-first name and records the other as an alias.
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert "head.weight" not in f.keys()  # noqa: SIM118
        assert f.metadata()["head.weight"] == "embed.weight"

    info = weightvault.inspect(path)
    assert info.aliases == {"head.weight": "embed.weight"}
    assert info.tensors["head.weight"].kind == "alias"
    assert set(info.names) == set(model.state_dict())

    tensors = wv.load_file(path)
    assert tensors["head.weight"] is tensors["embed.weight"]
    assert _bitwise_equal(tensors["embed.weight"], model.embed.weight)


def test_save_model_output_fills_a_tied_model(tmp_path: Path) -> None:
    model = Tied(seed=0)
    path = tmp_path / "ref.safetensors"
    st.save_model(model, str(path))
    fresh = Tied(seed=1)
    report = wv.load(fresh, path)
    assert report.ok, report
    assert report.untied == [] and report.tied == []
    assert fresh.head.weight is fresh.embed.weight
    for name, t in model.state_dict().items():
        assert _bitwise_equal(fresh.state_dict()[name], t), name


def test_save_model_output_fills_an_untied_model(tmp_path: Path) -> None:
    model = Tied(seed=0)
    path = tmp_path / "ref.safetensors"
    st.save_model(model, str(path))

    untied = Tied(seed=1, tie=False)
    report = wv.load(untied, path)
    assert report.ok, report
    assert report.untied == [("embed.weight", "head.weight")]
    assert untied.head.weight is not untied.embed.weight
    assert _bitwise_equal(untied.head.weight, model.embed.weight)
    assert _bitwise_equal(untied.embed.weight, model.embed.weight)

    retied = Tied(seed=2, tie=False)
    report = wv.load(retied, path, tie=True)
    assert report.tied == [("embed.weight", "head.weight")]
    assert retied.head.weight is retied.embed.weight
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids), retied(ids))


def test_save_model_alias_chosen_as_sorted_first_name(tmp_path: Path) -> None:
    # Here safetensors keeps "a.weight" although the model registered "z" first: the
    # kept name on disk need not be the model's first name.
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.z = nn.Linear(3, 3, bias=False)
            self.a = nn.Linear(3, 3, bias=False)
            self.a.weight = self.z.weight

    model = M()
    path = tmp_path / "ref.safetensors"
    st.save_model(model, str(path))
    assert weightvault.inspect(path).aliases == {"z.weight": "a.weight"}
    fresh = M()
    report = wv.load(fresh, path)
    assert report.ok, report
    assert fresh.a.weight is fresh.z.weight
    assert _bitwise_equal(fresh.z.weight, model.z.weight)


def test_hand_written_alias_chain_is_followed(tmp_path: Path) -> None:
    w = torch.randn(4, 2)
    path = tmp_path / "chain.safetensors"
    st.save_file(
        {"stored": w, "other": torch.zeros(1)},
        str(path),
        metadata={"format": "pt", "a": "b", "b": "stored", "note": "hello"},
    )
    info = weightvault.inspect(path)
    assert info.aliases == {"a": "stored", "b": "stored"}
    assert info.metadata == {"format": "pt", "note": "hello"}
    assert set(info.names) == {"stored", "other", "a", "b"}

    tensors = wv.load_file(path)
    assert tensors["a"] is tensors["b"] is tensors["stored"]
    assert _bitwise_equal(tensors["a"], w)

    class Three(nn.Module):
        def __init__(self, tie: bool) -> None:
            super().__init__()
            self.stored = nn.Parameter(torch.empty(4, 2))
            self.other = nn.Parameter(torch.empty(1))
            self.a = self.stored if tie else nn.Parameter(torch.empty(4, 2))
            self.b = self.stored if tie else nn.Parameter(torch.empty(4, 2))

    tied = Three(tie=True)
    report = wv.load(tied, path)
    assert report.ok, report
    assert _bitwise_equal(tied.stored, w)

    apart = Three(tie=False)
    report = wv.load(apart, path)
    assert report.ok, report
    assert len(report.untied) == 1 and set(report.untied[0]) == {"stored", "a", "b"}
    for p in (apart.stored, apart.a, apart.b):
        assert _bitwise_equal(p, w)


def test_metadata_that_names_no_tensor_is_plain_metadata(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    st.save_file(
        {"w": torch.ones(2)}, str(path), metadata={"format": "pt", "x": "nowhere", "y": "x"}
    )
    info = weightvault.inspect(path)
    assert info.aliases == {}
    assert info.names == ["w"]
    assert info.metadata == {"format": "pt", "x": "nowhere", "y": "x"}
    assert list(wv.load_file(path)) == ["w"]


# --- byte-level compatibility -------------------------------------------------------------


def test_tensor_bytes_match_what_safetensors_writes(tmp_path: Path) -> None:
    tensors = _varied(seed=2)
    ours, ref = tmp_path / "ours.safetensors", tmp_path / "ref.safetensors"
    report = wv.save(tensors, ours)
    st.save_file(tensors, str(ref))
    assert report.aliases == {} and report.copies == {} and report.views == []

    our_header, our_bytes = _sections(ours)
    ref_header, ref_bytes = _sections(ref)
    assert set(our_bytes) == set(ref_bytes) == set(tensors)
    for name in tensors:
        ours_entry, ref_entry = our_header[name], ref_header[name]
        assert ours_entry["dtype"] == ref_entry["dtype"], name
        assert ours_entry["shape"] == ref_entry["shape"], name
        assert our_bytes[name] == ref_bytes[name], name
    # The data sections differ only in order: the same multiset of tensor bytes.
    assert sum(map(len, our_bytes.values())) == sum(map(len, ref_bytes.values()))

    # And each library reads the other's file to the same values.
    a, b = wv.load_file(ref), st.load_file(ours)
    for name, t in tensors.items():
        assert _bitwise_equal(a[name], t) and _bitwise_equal(b[name], t), name


def test_non_contiguous_and_offset_tensors_are_written_as_safetensors_would(
    tmp_path: Path,
) -> None:
    # Transposes and slices of separate storages: no sharing, so each is stored as the
    # contiguous bytes that safetensors (after .contiguous()) writes.
    g = torch.Generator().manual_seed(3)
    tensors = {
        "t": torch.randn(4, 6, generator=g).t(),
        "s": torch.randn(10, 3, generator=g)[2:7],
        "step": torch.randn(12, generator=g)[::3],
    }
    ours, ref = tmp_path / "ours.safetensors", tmp_path / "ref.safetensors"
    wv.save(tensors, ours)
    st.save_file({k: v.contiguous() for k, v in tensors.items()}, str(ref))
    _, our_bytes = _sections(ours)
    _, ref_bytes = _sections(ref)
    assert our_bytes == ref_bytes
    for name, t in st.load_file(ours).items():
        assert _bitwise_equal(t, tensors[name]), name


@pytest.mark.parametrize("meta", [{"k": "k"}, {"x": "y", "y": "x"}], ids=["self", "pair"])
def test_metadata_cycle_that_names_no_tensor_is_plain_metadata(
    tmp_path: Path, meta: dict[str, str]
) -> None:
    path = tmp_path / "cycle.safetensors"
    st.save_file({"w": torch.ones(2)}, str(path), metadata=meta)
    with safetensors.safe_open(str(path), framework="pt") as f:  # the oracle opens it
        assert f.metadata() == meta
    assert list(wv.load_file(path)) == ["w"]
    info = weightvault.inspect(path)
    assert info.aliases == {}
    assert info.metadata == meta
