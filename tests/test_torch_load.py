"""Load semantics of weightvault.torch: groups, ties both ways, rules, strictness, atomicity."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

safetensors = pytest.importorskip("safetensors")
st_torch = pytest.importorskip("safetensors.torch")

import weightvault  # noqa: E402
import weightvault.rules  # noqa: E402
import weightvault.torch as wv  # noqa: E402


class Tied(nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.emb.weight


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, snap: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())


def test_tied_file_into_untied_model_fills_both_and_reports_untied(tmp_path):
    src = Tied()
    path = tmp_path / "t.safetensors"
    wv.save(src, path)
    dst = Tied(tie=False)
    report = wv.load(dst, path)
    assert report.untied == [("emb.weight", "head.weight")]
    assert torch.equal(dst.head.weight, src.emb.weight)
    assert torch.equal(dst.emb.weight, src.emb.weight)
    assert dst.head.weight is not dst.emb.weight


def test_tie_true_makes_the_model_share_one_parameter(tmp_path):
    path = tmp_path / "t.safetensors"
    wv.save(Tied(), path)
    dst = Tied(tie=False)
    report = wv.load(dst, path, tie=True)
    assert dst.head.weight is dst.emb.weight
    assert report.tied == [("emb.weight", "head.weight")] and report.untied == []
    assert len(list(dst.parameters())) == 1


def test_model_tie_with_different_values_on_disk_is_a_conflict(tmp_path):
    path = tmp_path / "u.safetensors"
    wv.save(Tied(tie=False), path)  # two different tensors
    dst = Tied()
    snap = _snapshot(dst)
    with pytest.raises(weightvault.TieConflictError, match=r"emb\.weight / head\.weight") as e:
        wv.load(dst, path)
    assert isinstance(e.value, ValueError)
    assert _unchanged(dst, snap)


def test_model_tie_with_equal_values_on_disk_loads(tmp_path):
    src = Tied(tie=False)
    with torch.no_grad():
        src.head.weight.copy_(src.emb.weight)
    path = tmp_path / "eq.safetensors"
    report = wv.save(src, path, dedupe_copies=True)
    assert report.copies == {"head.weight": "emb.weight"}
    dst = Tied()
    assert wv.load(dst, path).loaded == ["emb.weight", "head.weight"]
    assert torch.equal(dst.emb.weight, src.emb.weight)


def test_alias_name_of_a_loaded_tensor_is_never_unexpected(tmp_path):
    path = tmp_path / "t.safetensors"
    wv.save(Tied(), path)

    class EmbOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)

    report = wv.load(EmbOnly(), path)
    assert report.unexpected == [] and report.missing == []


def test_copies_load_as_separate_tensors(tmp_path):
    src = Pair()
    src.b = copy.deepcopy(src.a)
    path = tmp_path / "c.safetensors"
    report = wv.save(src, path, dedupe_copies=True)
    assert report.copies == {"b.weight": "a.weight", "b.bias": "a.bias"}
    assert report.stored_bytes == (9 + 3) * 4
    dst = Pair()
    wv.load(dst, path)
    assert torch.equal(dst.b.weight, src.a.weight) and dst.b.weight is not dst.a.weight
    tensors = wv.load_file(path)
    assert tensors["a.weight"] is not tensors["b.weight"]
    assert tensors["a.weight"].data_ptr() != tensors["b.weight"].data_ptr()


def test_copies_are_kept_for_plain_readers_by_default(tmp_path):
    src = Pair()
    src.b = copy.deepcopy(src.a)
    path = tmp_path / "c.safetensors"
    report = wv.save(src, path)
    assert report.copies == {} and len(report.stored) == 4
    assert report.duplicates == {"b.weight": "a.weight", "b.bias": "a.bias"}
    info = weightvault.inspect(path)
    assert info.duplicates == report.duplicates
    assert info.dedupe_savings == report.dedupe_savings == (9 + 3) * 4
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["a.bias", "a.weight", "b.bias", "b.weight"]
    dst = Pair()
    missing, unexpected = st_torch.load_model(dst, str(path))
    assert missing == set() and unexpected == []
    assert torch.equal(dst.b.weight, src.b.weight)


def test_strict_false_reports_and_loads_what_matches(tmp_path):
    path = tmp_path / "p.safetensors"
    src = Pair()
    wv.save(src, path)

    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.c = nn.Linear(3, 3)

    dst = Other()
    report = wv.load(dst, path, strict=False)
    assert report.loaded == ["a.weight", "a.bias"]
    assert report.missing == ["c.weight", "c.bias"]
    assert report.unexpected == ["b.weight", "b.bias"]
    assert not report.ok
    assert torch.equal(dst.a.weight, src.a.weight)


def test_shape_mismatch_raises_and_leaves_model_untouched(tmp_path):
    path = tmp_path / "p.safetensors"
    wv.save(nn.Linear(3, 4), path)
    dst = nn.Linear(3, 5)
    snap = _snapshot(dst)
    with pytest.raises(weightvault.ShapeMismatchError, match=r"F32\[4, 3\] on disk, F32\[5, 3\]"):
        wv.load(dst, path)
    assert _unchanged(dst, snap)
    report = wv.load(dst, path, strict=False)
    assert [m[0] for m in report.mismatched] == ["weight", "bias"]


def test_dtype_mismatch_needs_cast(tmp_path):
    path = tmp_path / "h.safetensors"
    src = nn.Linear(3, 3).half()
    wv.save(src, path)
    dst = nn.Linear(3, 3)
    with pytest.raises(weightvault.ShapeMismatchError, match="cast=True"):
        wv.load(dst, path)
    wv.load(dst, path, cast=True)
    assert torch.equal(dst.weight, src.weight.float())


def test_rules_with_captures_and_drops(tmp_path):
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
            self.register_buffer("mask", torch.ones(2))

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])

    src = Block()
    path = tmp_path / "b.safetensors"
    wv.save(src, path)
    dst = Wrapped()
    report = wv.load(dst, path, rules=[("h.*", "blocks.*"), ("mask", None)])
    assert ("h.2.bias", "blocks.2.bias") in report.renamed
    assert report.unexpected == []
    assert torch.equal(dst.blocks[2].bias, src.h[2].bias)


def test_rules_auto_pairs_unambiguous_names(tmp_path):
    src = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 4))
    path = tmp_path / "s.safetensors"
    wv.save(src, path)

    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(2, 3)
            self.second = nn.Linear(3, 4)

    dst = Named()
    report = wv.load(dst, path, rules="auto")
    assert ("0.weight", "first.weight") in report.renamed
    assert torch.equal(dst.second.weight, src[1].weight)


def test_rules_auto_refuses_ambiguous_pairing(tmp_path):
    path = tmp_path / "s.safetensors"
    wv.save(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), path)
    dst = nn.ModuleDict({"x": nn.Linear(2, 2)})
    with pytest.raises(weightvault.RuleError, match=r"F32\[2, 2\]: 1 unmatched in the model"):
        wv.load(dst, path, rules="auto")


def test_colliding_rules_are_refused(tmp_path):
    path = tmp_path / "p.safetensors"
    wv.save(Pair(), path)
    with pytest.raises(weightvault.RuleError, match="map both"):
        wv.load(Pair(), path, rules=[("*.weight", "a.weight")], strict=False)


def test_bad_rule_is_explained():
    with pytest.raises(weightvault.RuleError, match="more '\\*' on the right"):
        weightvault.rules.check([("a", "b.*")])
    with pytest.raises(weightvault.RuleError, match="pair"):
        weightvault.rules.check(["a"])


def test_restore_frozen_and_frozen_names_through_aliases(tmp_path):
    src = Tied()
    assert wv.freeze(src, "head.weight") == ["emb.weight", "head.weight"]
    assert not src.emb.weight.requires_grad
    path = tmp_path / "f.safetensors"
    assert wv.save(src, path).frozen == ["emb.weight", "head.weight"]
    dst = Tied(tie=False)
    wv.load(dst, path)
    assert dst.emb.weight.requires_grad  # not restored unless asked
    report = wv.load(dst, path, restore_frozen=True)
    assert sorted(report.frozen) == ["emb.weight", "head.weight"]
    assert not dst.emb.weight.requires_grad and not dst.head.weight.requires_grad


def test_freeze_patterns_module_names_and_errors():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert wv.freeze(model, "0") == ["0.weight", "0.bias"]
    assert wv.trainable(model) == [model[1].weight, model[1].bias]
    assert wv.unfreeze(model, "*.bias") == ["0.bias", "1.bias"]
    with pytest.raises(weightvault.RuleError, match=r"Did you mean '1\.weight'"):
        wv.freeze(model, "1.weigth")


def test_freeze_removes_optimizer_state_so_weight_decay_never_moves_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    assert model[0].weight in opt.state
    wv.freeze(model, "0.*", optimizer=opt)
    assert model[0].weight not in opt.state and model[0].weight.grad is None
    frozen = model[0].weight.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    assert torch.equal(model[0].weight, frozen)
    assert all(p.requires_grad for p in wv.trainable(model))


def test_trainable_lists_each_tied_tensor_once():
    model = Tied()
    assert wv.trainable(model) == [model.emb.weight]


def test_mmap_load_is_zero_copy_and_copy_on_write(tmp_path):
    src = nn.Linear(64, 64)
    path = tmp_path / "m.safetensors"
    wv.save(src, path)
    raw = path.read_bytes()
    dst = nn.Linear(64, 64)
    wv.load(dst, path, mmap=True)
    assert torch.equal(dst.weight, src.weight)
    with torch.no_grad():
        dst.weight.add_(1)
    assert path.read_bytes() == raw
    assert weightvault.verify(path).ok


def test_load_file_views_and_aliases(tmp_path):
    base = torch.arange(12, dtype=torch.float32)
    tensors = {"base": base, "head": base[:4], "tail_t": base[4:].view(2, 4).t(), "again": base}
    path = tmp_path / "v.safetensors"
    report = wv.save(tensors, path)
    assert report.stored == ["base"] and report.aliases == {"again": "base"}
    assert sorted(report.views) == ["head", "tail_t"]
    out = wv.load_file(path)
    assert out["again"] is out["base"]
    assert torch.equal(out["tail_t"], tensors["tail_t"])
    assert out["head"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()


def test_views_without_a_covering_tensor_store_the_shared_storage(tmp_path):
    base = torch.arange(10, dtype=torch.int64)
    tensors = {"x": base[0:6], "y": base[4:10]}
    path = tmp_path / "v.safetensors"
    report = wv.save(tensors, path)
    assert report.stored_bytes == 80
    out = wv.load_file(path)
    assert torch.equal(out["x"], base[0:6]) and torch.equal(out["y"], base[4:10])
    info = weightvault.inspect(path)
    assert info.names == ["x", "y"]


def test_non_tensor_state_is_skipped_and_reported(tmp_path):
    class Extra(nn.Linear):
        def get_extra_state(self):
            return {"note": 1}

        def set_extra_state(self, state):
            pass

    report = wv.save(Extra(2, 2), tmp_path / "e.safetensors")
    assert report.skipped == ["_extra_state"]


def test_unsupported_dtype_is_a_clear_error(tmp_path):
    with pytest.raises(TypeError, match=r"complex128.*\.to\(torch.float32\)"):
        wv.save({"z": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "z.safetensors")


def test_save_is_deterministic(tmp_path):
    model = Tied()
    wv.save(model, tmp_path / "a.safetensors", metadata={"k": "v"})
    wv.save(model, tmp_path / "b.safetensors", metadata={"k": "v"})
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
