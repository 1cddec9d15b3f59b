"""Real transformers models (random weights, built from small configs, nothing downloaded).

Every model is perturbed with noise first, so that no two tensors hold equal values by
accident (LayerNorm weights start as ones, biases as zeros): the only sharing left is
the model's real ties, and a load that fills a tensor from the wrong name cannot pass.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import weightvault  # noqa: E402
import weightvault.torch as wv  # noqa: E402

VOCAB = 1000


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing here may reach the Hub: every model is built from a config.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")


@dataclass(frozen=True)
class Spec:
    config: Callable[..., Any]
    model: str  # class name in transformers
    auto: str  # Auto class that from_pretrained goes through
    seq2seq: bool
    ties: list[list[str]]  # the real tie groups, kept name first


def _gpt2(**kw: Any) -> Any:
    return transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_positions=64,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
        **kw,
    )


def _bart(**kw: Any) -> Any:
    return transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        **kw,
    )


def _t5(**kw: Any) -> Any:
    return transformers.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        **kw,
    )


def _albert(**kw: Any) -> Any:
    return transformers.AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        **kw,
    )


SPECS: dict[str, Spec] = {
    "gpt2": Spec(
        _gpt2,
        "GPT2LMHeadModel",
        "AutoModelForCausalLM",
        False,
        [["transformer.wte.weight", "lm_head.weight"]],
    ),
    "bart": Spec(
        _bart,
        "BartForConditionalGeneration",
        "AutoModelForSeq2SeqLM",
        True,
        [
            [
                "model.shared.weight",
                "model.encoder.embed_tokens.weight",
                "model.decoder.embed_tokens.weight",
                "lm_head.weight",
            ]
        ],
    ),
    "t5": Spec(
        _t5,
        "T5ForConditionalGeneration",
        "AutoModelForSeq2SeqLM",
        True,
        [
            [
                "shared.weight",
                "encoder.embed_tokens.weight",
                "decoder.embed_tokens.weight",
                "lm_head.weight",
            ]
        ],
    ),
    "albert": Spec(
        _albert,
        "AlbertForMaskedLM",
        "AutoModelForMaskedLM",
        False,
        [
            ["albert.embeddings.word_embeddings.weight", "predictions.decoder.weight"],
            ["predictions.bias", "predictions.decoder.bias"],
        ],
    ),
}
NAMES = list(SPECS)


def _perturb(model: Any, seed: int) -> None:
    """Add noise to every distinct floating tensor (each tie once)."""
    g = torch.Generator().manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or not t.is_floating_point():
                continue
            seen.add(ptr)
            t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.05)


def _build(key: str, *, seed: int, **config: Any) -> Any:
    spec = SPECS[key]
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model)(spec.config(**config))
    _perturb(model, seed + 1000)
    return model.eval()


def _logits(key: str, model: Any) -> Any:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (2, 9), generator=g)
    with torch.no_grad():
        if SPECS[key].seq2seq:
            dec = torch.randint(1, VOCAB, (2, 5), generator=g)
            return model(input_ids=ids, decoder_input_ids=dec).logits
        return model(input_ids=ids).logits


def _bitwise_equal(a: Any, b: Any) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    ua = a.detach().contiguous().reshape(-1).view(torch.uint8)
    ub = b.detach().contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(ua, ub))


def _assert_same_state(a: Any, b: Any) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    bad = [n for n in sa if not _bitwise_equal(sa[n], sb[n])]
    assert not bad, f"values differ for {bad}"


def _tie_groups(model: Any) -> list[list[str]]:
    groups: dict[Any, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault((t.untyped_storage().data_ptr(), t.storage_offset()), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path, Any]]:
    """Each model, saved once: (model, path, SaveReport)."""
    out = {}
    root = tmp_path_factory.mktemp("models")
    for key in NAMES:
        model = _build(key, seed=0)
        path = root / f"{key}.safetensors"
        report = wv.save(model, path)
        out[key] = (model, path, report)
    return out


@pytest.mark.parametrize("key", NAMES)
def test_models_have_the_expected_ties(key: str, saved: dict) -> None:
    # Guards the premise of every other test: transformers still ties these names.
    model, _, _ = saved[key]
    assert _tie_groups(model) == SPECS[key].ties


@pytest.mark.parametrize("key", NAMES)
def test_roundtrip_into_fresh_model_is_bitwise(key: str, saved: dict) -> None:
    model, path, _ = saved[key]
    fresh = _build(key, seed=1)
    before = fresh.state_dict()
    name = next(iter(before))
    assert not _bitwise_equal(before[name], model.state_dict()[name])  # really different

    report = wv.load(fresh, path)

    assert report.ok, report
    assert report.untied == [] and report.tied == []
    assert sorted(report.loaded) == sorted(model.state_dict())
    _assert_same_state(model, fresh)
    assert _tie_groups(fresh) == SPECS[key].ties  # the model's own ties survive
    assert torch.equal(_logits(key, model), _logits(key, fresh))


@pytest.mark.parametrize("key", NAMES)
def test_file_stores_each_distinct_tensor_once(key: str, saved: dict) -> None:
    model, path, report = saved[key]
    state = model.state_dict()
    unique: dict[int, Any] = {}
    for t in state.values():
        unique.setdefault(t.untyped_storage().data_ptr(), t)
    unique_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    logical = sum(t.numel() * t.element_size() for t in state.values())

    info = weightvault.inspect(path)
    assert info.stored_bytes == unique_bytes == report.stored_bytes
    assert info.logical_bytes == logical == report.logical_bytes
    assert len(info.stored) == len(unique)
    assert info.copies == {} and info.views == []
    expected_aliases = {alias: group[0] for group in SPECS[key].ties for alias in group[1:]}
    assert info.aliases == expected_aliases == report.aliases
    assert info.names == list(state)

    size = path.stat().st_size
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    assert size == info.file_bytes == report.file_bytes
    assert size == 8 + header_len + unique_bytes
    # The header (names, offsets, manifest, checksums) is small next to the weights.
    assert header_len < 400 * len(state)
    assert header_len % 8 == 0  # data section 8-byte aligned


def test_gpt2_keeps_the_embedding_and_aliases_the_head(saved: dict) -> None:
    _, path, report = saved["gpt2"]
    assert report.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert "transformer.wte.weight" in report.stored
    assert "lm_head.weight" not in report.stored
    info = weightvault.inspect(path)
    assert info.tensors["lm_head.weight"].kind == "alias"
    assert info.tensors["lm_head.weight"].stored == "transformer.wte.weight"
    assert info.tensors["transformer.wte.weight"].kind == "stored"


@pytest.mark.parametrize("key", NAMES)
def test_from_pretrained_reads_our_file(key: str, saved: dict, tmp_path: Path) -> None:
    model, path, _ = saved[key]
    model.config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(path.read_bytes())

    auto = getattr(transformers, SPECS[key].auto)
    loaded, info = auto.from_pretrained(tmp_path, output_loading_info=True)

    assert type(loaded) is type(model)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    loaded.eval()
    _assert_same_state(model, loaded)
    assert torch.equal(_logits(key, model), _logits(key, loaded))


def test_tied_file_into_untied_gpt2_fills_both(saved: dict) -> None:
    model, path, _ = saved["gpt2"]
    untied = _build("gpt2", seed=2, tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert _tie_groups(untied) == []

    report = wv.load(untied, path)

    assert report.ok, report
    assert report.untied == [("transformer.wte.weight", "lm_head.weight")]
    assert report.tied == []
    assert untied.lm_head.weight is not untied.transformer.wte.weight  # still separate
    wte = model.transformer.wte.weight
    assert _bitwise_equal(untied.transformer.wte.weight, wte)
    assert _bitwise_equal(untied.lm_head.weight, wte)
    assert untied.lm_head.weight.data_ptr() != untied.transformer.wte.weight.data_ptr()
    _assert_same_state(model, untied)
    assert torch.equal(_logits("gpt2", model), _logits("gpt2", untied))


def test_tied_file_into_untied_gpt2_with_tie_shares_one_parameter(saved: dict) -> None:
    model, path, _ = saved["gpt2"]
    untied = _build("gpt2", seed=3, tie_word_embeddings=False)

    report = wv.load(untied, path, tie=True)

    assert report.ok, report
    assert report.tied == [("transformer.wte.weight", "lm_head.weight")]
    assert report.untied == []
    assert untied.lm_head.weight is untied.transformer.wte.weight
    assert isinstance(untied.lm_head.weight, torch.nn.Parameter)
    assert _bitwise_equal(untied.transformer.wte.weight, model.transformer.wte.weight)
    # One Parameter now, so an optimizer sees it once.
    params = list(untied.parameters())
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    assert torch.equal(_logits("gpt2", model), _logits("gpt2", untied))


def test_safetensors_load_file_reads_our_gpt2(saved: dict) -> None:
    model, path, _ = saved["gpt2"]
    tensors = safetensors_torch.load_file(path)
    state = model.state_dict()
    # A plain reader sees every stored tensor; the alias lives only in the metadata.
    assert set(tensors) == set(state) - {"lm_head.weight"}
    for name, t in tensors.items():
        assert _bitwise_equal(t, state[name]), name


def test_safetensors_load_model_fills_our_gpt2(saved: dict) -> None:
    model, path, _ = saved["gpt2"]
    fresh = _build("gpt2", seed=4)
    missing, unexpected = safetensors_torch.load_model(fresh, path)
    assert not missing and not unexpected
    _assert_same_state(model, fresh)
    assert torch.equal(_logits("gpt2", model), _logits("gpt2", fresh))


def test_safetensors_save_model_of_gpt2_loads_with_weightvault(tmp_path: Path) -> None:
    # The other direction on a real model: safetensors keeps the sorted-first name
    # ("lm_head.weight") and records the embedding as the alias.
    model = _build("gpt2", seed=5)
    path = tmp_path / "st.safetensors"
    safetensors_torch.save_model(model, str(path))
    info = weightvault.inspect(path)
    assert info.aliases == {"transformer.wte.weight": "lm_head.weight"}

    fresh = _build("gpt2", seed=6)
    report = wv.load(fresh, path)
    assert report.ok, report
    _assert_same_state(model, fresh)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight

    untied = _build("gpt2", seed=7, tie_word_embeddings=False)
    report = wv.load(untied, path)
    assert report.ok, report
    assert report.untied == [("transformer.wte.weight", "lm_head.weight")]
    _assert_same_state(model, untied)


def test_untouched_model_copies_are_restored_and_optional(tmp_path: Path) -> None:
    # Without noise, LayerNorm weights (ones) and biases (zeros) are equal copies: with
    # dedupe_copies=True stored once, but each name gets its own tensor back, never a tie.
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2()).eval()
    path = tmp_path / "model.safetensors"
    report = wv.save(model, path, dedupe_copies=True)
    assert report.copies, "expected equal LayerNorm/bias tensors to be deduplicated"
    assert report.aliases == {"lm_head.weight": "transformer.wte.weight"}

    fresh = _build("gpt2", seed=8)
    assert wv.load(fresh, path).ok
    _assert_same_state(model, fresh)
    assert _tie_groups(fresh) == SPECS["gpt2"].ties

    # By default (dedupe_copies=False) a plain reader sees every copy by name, so
    # transformers finds every key it needs.
    folder = tmp_path / "plain"
    model.config.save_pretrained(folder)
    report = wv.save(model, folder / "model.safetensors")
    assert report.copies == {} and report.duplicates
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    _assert_same_state(model, loaded)


def test_mmap_load_into_gpt2_is_zero_copy_and_never_writes_the_file(saved: dict) -> None:
    model, path, _ = saved["gpt2"]
    before = path.read_bytes()
    fresh = _build("gpt2", seed=9)
    report = wv.load(fresh, path, mmap=True)
    assert report.ok, report
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    _assert_same_state(model, fresh)
    assert torch.equal(_logits("gpt2", model), _logits("gpt2", fresh))
    with torch.no_grad():
        fresh.transformer.wte.weight.mul_(2.0)  # copy-on-write: the file stays as it was
    assert path.read_bytes() == before


def test_mmap_load_into_untied_gpt2_keeps_the_tensors_apart(saved: dict) -> None:
    model, path, _ = saved["gpt2"]
    untied = _build("gpt2", seed=10, tie_word_embeddings=False)
    report = wv.load(untied, path, mmap=True)
    assert report.untied == [("transformer.wte.weight", "lm_head.weight")]
    with torch.no_grad():
        untied.lm_head.weight.add_(1.0)
    assert _bitwise_equal(untied.transformer.wte.weight, model.transformer.wte.weight)
