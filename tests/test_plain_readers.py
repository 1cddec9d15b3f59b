"""Every reader sees the same model: a default weightvault file read by plain safetensors
readers, transformers and torch DCP gives what weightvault gives, and no save or load
is silently wrong (issue 8).

Models are built from tiny configs with random weights (nothing is downloaded), trained
one step, and given a duplicated block: block 1 is an exact copy of block 0, as in depth
up-scaling. Such copies are separate tensors with equal bytes, the case plain readers
cannot see unless the file stores them.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
st_torch = pytest.importorskip("safetensors.torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault.numpy as wvn  # noqa: E402
import weightvault.torch as wv  # noqa: E402
from weightvault._base.dtypes import ITEMSIZE  # noqa: E402

transformers.logging.set_verbosity_error()
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _gpt2() -> Any:
    c = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=100, bos_token_id=0
    )
    return transformers.GPT2LMHeadModel(c), lambda m: m.transformer.h


def _llama() -> Any:
    c = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(c), lambda m: m.model.layers


def _t5() -> Any:
    c = transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
    )
    return transformers.T5ForConditionalGeneration(c), lambda m: m.encoder.block


def _vit() -> Any:
    c = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=8,
        num_labels=3,
    )
    return transformers.ViTForImageClassification(c), lambda m: m.vit.layers


def _resnet() -> Any:
    c = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 8], depths=[2, 1], num_labels=3
    )
    return transformers.ResNetForImageClassification(c), lambda m: m.resnet.encoder.stages[0].layers


MODELS: dict[str, Callable[[], Any]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "t5": _t5,
    "vit": _vit,
    "resnet": _resnet,
}


def _inputs(key: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    if key in ("vit", "resnet"):
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    ids = torch.randint(1, 100, (2, 8), generator=g)
    if key == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :4]}
    return {"input_ids": ids}


def _trained_with_duplicated_block(key: str) -> Any:
    torch.manual_seed(0)
    model, blocks = MODELS[key]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(**_inputs(key))
    out.logits.float().pow(2).mean().backward()
    opt.step()
    # Block 1 becomes an exact copy of block 0: separate tensors, equal bytes.
    with torch.no_grad():
        first = blocks(model)[0].state_dict()
        for name, dst in blocks(model)[1].state_dict().items():
            dst.copy_(first[name])  # T5's block 0 alone holds the relative position bias
    return model.eval()


def _logits(model: Any, key: str) -> Any:
    with torch.no_grad():
        return model(**_inputs(key)).logits


def _untied_state(model: Any) -> dict[str, Any]:
    """The model's state dict with each tied tensor under its first name only."""
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t.detach()
    return out


@pytest.mark.parametrize("key", list(MODELS))
def test_plain_readers_see_the_whole_model(tmp_path: Path, key: str) -> None:
    model = _trained_with_duplicated_block(key)
    expected = _logits(model, key)
    folder = tmp_path / key
    model.config.save_pretrained(folder)
    report = wv.save(model, folder / "model.safetensors")
    assert report.copies == {}
    assert report.duplicates, "block 1 is a copy of block 0: the save must find it"
    info = weightvault.inspect(folder / "model.safetensors")
    assert info.dedupe_savings == report.dedupe_savings > 0

    # transformers: nothing missing beyond the names it ties itself, identical logits.
    auto = type(model)
    loaded, loading = auto.from_pretrained(folder, output_loading_info=True)
    tied = set(report.aliases)
    assert set(loading["missing_keys"]) <= tied, loading["missing_keys"]
    assert not loading["unexpected_keys"] and not loading["mismatched_keys"]
    assert torch.equal(_logits(loaded.eval(), key), expected)

    # safetensors' own loader: no missing key, same values.
    fresh = MODELS[key]()[0]
    missing, unexpected = st_torch.load_model(fresh, str(folder / "model.safetensors"))
    assert missing == set() and unexpected == []
    assert torch.equal(_logits(fresh.eval(), key), expected)

    # torch DCP reading the Hugging Face layout, every key required.
    target = {k: torch.zeros_like(v) for k, v in _untied_state(model).items()}
    dcp.load(
        target,
        storage_reader=dcp.HuggingFaceStorageReader(str(folder)),
        planner=dcp.DefaultLoadPlanner(allow_partial_load=False),
        no_dist=True,
    )
    for name, value in _untied_state(model).items():
        assert torch.equal(target[name], value), name

    # With dedupe_copies=True the file is smaller and plain readers miss the copies.
    small = tmp_path / "small.safetensors"
    smaller = wv.save(model, small, dedupe_copies=True)
    assert smaller.stored_bytes == report.stored_bytes - report.dedupe_savings
    missing, _ = st_torch.load_model(MODELS[key]()[0], str(small), strict=False)
    assert missing and missing <= set(smaller.copies)


def test_vault_export_keeps_copies_for_plain_readers(tmp_path: Path) -> None:
    src = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    src[1].load_state_dict(src[0].state_dict())
    vault = weightvault.Vault(tmp_path / "v")
    vault.save(src, "a", metadata={"step": "7"})
    assert vault.open("a").manifest.copies, "the vault stores copies once"
    vault.export("a", tmp_path / "full.safetensors")
    dst = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    missing, unexpected = st_torch.load_model(dst, str(tmp_path / "full.safetensors"))
    assert missing == set() and unexpected == []
    assert torch.equal(dst[1].weight, src[0].weight)
    with safetensors.safe_open(str(tmp_path / "full.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "7"
    vault.export("a", tmp_path / "small.safetensors", dedupe_copies=True)
    assert weightvault.inspect(tmp_path / "small.safetensors").copies


# --- metadata and reserved names ------------------------------------------------------


def test_user_metadata_shows_in_safe_open(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    wv.save(nn.Linear(2, 2), path, metadata={"step": "100"})
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata()["step"] == "100"
    assert weightvault.inspect(path).metadata == {"step": "100"}


@pytest.mark.parametrize("key", ["weight", "format", "weightvault", "__metadata__"])
def test_metadata_key_clashing_with_a_name_or_reserved_key_is_refused(
    tmp_path: Path, key: str
) -> None:
    path = tmp_path / "m.safetensors"
    with pytest.raises(weightvault.ReservedNameError, match=repr(key)):
        wv.save(nn.Linear(2, 2), path, metadata={key: "x"})
    assert not path.exists()


def test_tensor_named_metadata_is_refused(tmp_path: Path) -> None:
    with pytest.raises(weightvault.ReservedNameError, match="__metadata__"):
        wv.save({"__metadata__": torch.ones(2)}, tmp_path / "m.safetensors")
    with pytest.raises(weightvault.ReservedNameError, match="__metadata__"):
        wvn.save({"__metadata__": np.ones(2)}, tmp_path / "m.safetensors")


@pytest.mark.parametrize("alias", ["format", "weightvault"])
def test_alias_named_like_a_reserved_key_never_replaces_it(tmp_path: Path, alias: str) -> None:
    t = torch.arange(3.0)
    other = torch.ones(2)
    path = tmp_path / "a.safetensors"
    wv.save({"w": t, alias: t, "v": other, "v2": other}, path)
    with safetensors.safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and "weightvault" in meta
    assert meta["v2"] == "v"  # the other tie is still visible to plain readers
    out = wv.load_file(path)
    assert out[alias] is out["w"] and out["v2"] is out["v"]
    assert weightvault.inspect(path).framework == "pt"


# --- lazily conjugated and negated tensors --------------------------------------------


def test_lazy_conj_and_neg_round_trip_with_their_values(tmp_path: Path) -> None:
    c = torch.tensor([1 + 2j, 3 - 4j, -5 + 6j], dtype=torch.complex64)
    x = torch.arange(4.0)
    tensors = {
        "c": c,
        "cc": c.conj(),
        "cc_tail": c.conj()[1:],
        "x": x,
        "neg": torch._neg_view(x),
    }
    path = tmp_path / "c.safetensors"
    report = wv.save(tensors, path)
    assert "cc" not in report.aliases and "neg" not in report.aliases
    assert "cc_tail" not in report.views
    out = wv.load_file(path)
    for name, t in tensors.items():
        assert torch.equal(out[name], t.resolve_conj().resolve_neg()), name
    with safetensors.safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("cc"), c.conj().resolve_conj())


def test_one_lazy_conj_under_two_names_stays_one_tensor(tmp_path: Path) -> None:
    cc = torch.tensor([1 + 1j, 2 - 2j], dtype=torch.complex64).conj()
    path = tmp_path / "a.safetensors"
    assert wv.save({"a": cc, "b": cc}, path).aliases == {"b": "a"}
    assert torch.equal(wv.load_file(path)["b"], cc.resolve_conj())


# --- every dtype through every adapter ------------------------------------------------

#: Dtypes a framework lacks: the pair is skipped with this reason.
_KERAS_LACKS = {
    "F8_E8M0": "Keras has no float8_e8m0fnu dtype",
    "F8_E4M3FNUZ": "Keras has no float8_e4m3fnuz dtype",
    "F8_E5M2FNUZ": "Keras has no float8_e5m2fnuz dtype",
}


def _values(dtype: str) -> Any:
    """Eight distinct bit patterns of ``dtype`` as a numpy array (ml_dtypes for fp8)."""
    np_dtype = wvn.dtype_of(dtype)
    if dtype == "BOOL":
        return np.array([True, False, True, True, False, False, True, False])
    if dtype in ("F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0", "F8_E4M3", "F8_E5M2"):
        # Bit patterns that are finite numbers in every fp8 flavour (no NaN encodings).
        return np.array([1, 2, 3, 0x30, 0x31, 0x40, 0x41, 0x42], np.uint8).view(np_dtype)
    if dtype == "C64":
        return (np.arange(8) + 1j * np.arange(8, 0, -1)).astype(np_dtype)
    return np.arange(1, 9).astype(np_dtype)


@pytest.mark.parametrize("adapter", ["torch", "numpy", "keras"])
@pytest.mark.parametrize("dtype", sorted(ITEMSIZE))
def test_every_dtype_round_trips_through_every_adapter(
    tmp_path: Path, dtype: str, adapter: str
) -> None:
    pytest.importorskip("ml_dtypes")
    values = _values(dtype)
    bits = values.view(f"<u{values.dtype.itemsize}") if dtype != "BOOL" else values
    path = tmp_path / "d.safetensors"
    if adapter == "torch":
        t = torch.from_numpy(bits.copy()).view(wv.DTYPES[dtype]) if dtype != "BOOL" else None
        t = torch.from_numpy(values.copy()) if t is None else t
        # A strided view of the same tensor as well, so views of every dtype are covered.
        wv.save({"t": t, "every_other": t[::2]}, path)
        out = wv.load_file(path)
        assert out["t"].dtype == wv.DTYPES[dtype]
        got = out["every_other"].contiguous().view(torch.uint8).numpy()
        assert got.tobytes() == t[::2].contiguous().view(torch.uint8).numpy().tobytes()
        assert out["t"].view(torch.uint8).numpy().tobytes() == bits.tobytes()
    elif adapter == "numpy":
        wvn.save({"t": values, "every_other": values[::2]}, path)
        out = wvn.load_file(path)
        assert out["t"].dtype == values.dtype and out["t"].tobytes() == values.tobytes()
        assert out["every_other"].tobytes() == values[::2].tobytes()
    else:
        if dtype in _KERAS_LACKS:
            pytest.skip(_KERAS_LACKS[dtype])
        keras = pytest.importorskip("keras")
        import weightvault.keras as wvk

        if dtype == "U64" and keras.backend.backend() == "torch":
            pytest.skip("Keras' torch backend has no uint64 dtype")
        # Keras' torch backend cannot convert ml_dtypes arrays; float8 values are exact
        # in float32, and the variable casts them back.
        init = values.astype(np.float32) if dtype.startswith("F8") else values
        var = keras.Variable(init, dtype=str(values.dtype), trainable=False)
        wvk.save({"t": var}, path)
        out = wvk.load_file(path)
        assert out["t"].tobytes() == values.tobytes()
    with safetensors.safe_open(
        str(path), "np" if dtype not in _SAFETENSORS_NP_LACKS else "pt"
    ) as f:
        assert list(f.keys())


#: safetensors' numpy backend has no numpy dtype for these; read them through torch.
_SAFETENSORS_NP_LACKS = {"BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}


# --- bad values ------------------------------------------------------------------------


def test_sparse_tensor_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(weightvault.UnsupportedValueError, match=r"'s'.*to_dense"):
        wv.save({"s": sparse}, tmp_path / "s.safetensors")
    with pytest.raises(TypeError):
        wv.save({"s": torch.eye(3).to_sparse_csr()}, tmp_path / "s.safetensors")


def test_non_tensor_in_a_dict_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    with pytest.raises(weightvault.UnsupportedValueError, match=r"'step' is a int"):
        wv.save({"w": torch.ones(2), "step": 3}, path)  # type: ignore[dict-item]
    with pytest.raises(weightvault.UnsupportedValueError, match=r"'step' is a list"):
        wvn.save({"w": np.ones(2), "step": [1, 2]}, path)  # type: ignore[dict-item]
    assert not path.exists()


# --- rules="auto" never pairs silently wrong ------------------------------------------


def test_auto_refuses_vit_legacy_names_instead_of_pairing_by_order(tmp_path: Path) -> None:
    """transformers 5 writes ViT with legacy names (attention.attention.key, query,
    value, sorted by name) while the model says q_proj, k_proj, v_proj: pairing by order
    would fill q_proj from key."""
    model, _ = _vit()
    folder = tmp_path / "vit"
    model.save_pretrained(folder)
    path = folder / "model.safetensors"
    with safetensors.safe_open(str(path), "pt") as f:
        assert "vit.encoder.layer.0.attention.attention.key.weight" in list(f.keys())
    fresh, _ = _vit()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(weightvault.RuleError, match=r"q_proj.*attention\.attention"):
        wv.load(fresh, path, rules="auto")
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_auto_pairs_names_that_differ_by_a_common_prefix(tmp_path: Path) -> None:
    src = nn.Module()
    src.layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(3)])
    path = tmp_path / "a.safetensors"
    wv.save(src, path)
    dst = nn.Module()
    dst.blocks = nn.ModuleList([nn.Linear(3, 3) for _ in range(3)])
    report = wv.load(dst, path, rules="auto")
    assert report.ok
    for i in range(3):
        assert torch.equal(dst.blocks[i].weight, src.layers[i].weight)


def test_auto_refuses_same_signature_names_that_do_not_correspond(tmp_path: Path) -> None:
    src = nn.Module()
    src.query = nn.Linear(3, 3)
    src.key = nn.Linear(3, 3)
    path = tmp_path / "a.safetensors"
    wv.save(src, path)
    dst = nn.Module()
    dst.q_proj = nn.Linear(3, 3)
    dst.k_proj = nn.Linear(3, 3)
    with pytest.raises(weightvault.RuleError, match="cannot tell"):
        wv.load(dst, path, rules="auto")


def test_proposed_rule_fixes_every_name_it_claims_or_says_partial(tmp_path: Path) -> None:
    src = nn.Module()
    src.enc = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
    src.head = nn.Linear(3, 2)
    path = tmp_path / "a.safetensors"
    wv.save(src, path)
    dst = nn.Module()
    dst.encoder = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
    dst.classifier = nn.Linear(3, 2)
    with pytest.raises(weightvault.KeyMismatchError) as info:
        wv.load(dst, path)
    err = info.value
    assert err.rule is not None
    fixed = [n for n in err.missing if n in err.rule_fixes]
    # Every name the rule renames lands on a missing name with the right shape.
    report = wv.load(dst, path, rules=[err.rule], strict=False)
    assert sorted(new for _, new in report.renamed) == sorted(fixed)
    assert not report.mismatched
    if len(err.rule_fixes) < len(err.missing):
        assert "partial" in str(err)


def test_proposed_rule_is_never_one_that_misfills_a_shape(tmp_path: Path) -> None:
    src = nn.Module()
    src.a = nn.Linear(3, 4)
    path = tmp_path / "a.safetensors"
    wv.save(src, path)
    dst = nn.Module()
    dst.b = nn.Linear(4, 3)  # same names after a rename, wrong shapes
    with pytest.raises(weightvault.KeyMismatchError) as info:
        wv.load(dst, path)
    assert info.value.rule is None


def test_deepcopy_model_default_file_reads_in_plain_safetensors(tmp_path: Path) -> None:
    student = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model = nn.ModuleDict({"student": student, "teacher": copy.deepcopy(student)})
    path = tmp_path / "st.safetensors"
    wv.save(model, path)
    fresh = nn.ModuleDict({"student": copy.deepcopy(student), "teacher": copy.deepcopy(student)})
    missing, unexpected = st_torch.load_model(fresh, str(path))
    assert missing == set() and unexpected == []
