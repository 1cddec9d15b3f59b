"""torch.compile, DDP and DataParallel wrappers never reach the stored names (issue 19, 8).

A tiny GPT-2 (tied ``lm_head``) is saved plain and wrapped, and loaded both ways; files
written with the wrappers' prefixes (``_orig_mod.``, ``module.``) still load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault.torch as wv  # noqa: E402
from weightvault import Vault  # noqa: E402

CONFIG = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)


def gpt2(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # bos/eos inside the tiny vocabulary, so the config raises no warning.
    config = transformers.GPT2Config(**CONFIG, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def compiled(model: nn.Module) -> nn.Module:
    # backend="eager" still wraps in OptimizedModule, but never needs a C++ compiler.
    return torch.compile(model, backend="eager")  # type: ignore[return-value]


def assert_bitwise(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name, value in sa.items():
        assert torch.equal(value.view(torch.uint8), sb[name].view(torch.uint8)), name


def stored_names(path: Path) -> tuple[list[str], dict[str, str]]:
    """The names in the header, and the metadata (where aliases are recorded)."""
    with safetensors.safe_open(str(path), "pt") as f:
        return sorted(f.keys()), f.metadata()


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo group, so that a real DistributedDataParallel can be built."""
    init = "file://" + str(tmp_path / "rendezvous")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=init)
    try:
        yield
    finally:
        dist.destroy_process_group()


WRAPS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "compile": compiled,
    "DataParallel": nn.DataParallel,
    "DataParallel(compile)": lambda m: nn.DataParallel(compiled(m)),
    "compile(DataParallel)": lambda m: compiled(nn.DataParallel(m)),
}


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_a_wrapped_model_saves_the_plain_models_file(tmp_path: Path, wrap: str) -> None:
    model = gpt2()
    plain = wv.save(model, tmp_path / "plain.safetensors")
    wrapped = wv.save(WRAPS[wrap](model), tmp_path / "wrapped.safetensors")
    assert wrapped.stored == plain.stored and wrapped.aliases == plain.aliases
    assert wrapped.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert stored_names(tmp_path / "wrapped.safetensors") == stored_names(
        tmp_path / "plain.safetensors"
    )
    # Nothing else differs either: the very same bytes.
    data = (tmp_path / "wrapped.safetensors").read_bytes()
    assert data == (tmp_path / "plain.safetensors").read_bytes()


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_plain_and_wrapped_load_each_others_files(tmp_path: Path, wrap: str) -> None:
    source = gpt2(seed=1)
    wv.save(source, tmp_path / "plain.safetensors")
    wv.save(WRAPS[wrap](source), tmp_path / "wrapped.safetensors")

    into_wrapped = gpt2(seed=2)
    report = wv.load(WRAPS[wrap](into_wrapped), tmp_path / "plain.safetensors")
    assert report.ok and report.renamed == []
    assert_bitwise(into_wrapped, source)
    assert into_wrapped.lm_head.weight is into_wrapped.transformer.wte.weight

    into_plain = gpt2(seed=3)
    report = wv.load(into_plain, tmp_path / "wrapped.safetensors")
    assert report.ok and report.renamed == []
    assert_bitwise(into_plain, source)


def test_distributed_data_parallel_is_unwrapped(tmp_path: Path, process_group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    source = gpt2(seed=1)
    plain = wv.save(source, tmp_path / "plain.safetensors")
    for i, wrapped in enumerate([DDP(source), DDP(compiled(source)), compiled(DDP(source))]):
        report = wv.save(wrapped, tmp_path / f"ddp{i}.safetensors")
        assert report.stored == plain.stored and report.aliases == plain.aliases
        target = gpt2(seed=2)
        assert wv.load(DDP(target), tmp_path / "plain.safetensors").ok
        assert_bitwise(target, source)
        target = gpt2(seed=3)
        assert wv.load(target, tmp_path / f"ddp{i}.safetensors").ok
        assert_bitwise(target, source)


@pytest.mark.parametrize("prefix", ["_orig_mod.", "module.", "module._orig_mod."])
def test_a_file_saved_with_wrapper_prefixes_loads(tmp_path: Path, prefix: str) -> None:
    source = gpt2(seed=1)
    path = tmp_path / "old.safetensors"
    # What saving a wrapped model wrote before: every name prefixed, the tie an alias.
    old = wv.save({prefix + k: v for k, v in source.state_dict().items()}, path)
    assert old.aliases == {f"{prefix}lm_head.weight": f"{prefix}transformer.wte.weight"}

    for target, wrap in [(gpt2(seed=2), None), (gpt2(seed=3), compiled)]:
        report = wv.load(target if wrap is None else wrap(target), path)
        assert report.ok
        # The report says which names lost their prefix.
        assert sorted(report.renamed) == sorted((prefix + k, k) for k in source.state_dict())
        assert_bitwise(target, source)
    # rules="auto" pairs them as well: the names differ only by a prefix they all share.
    target = gpt2(seed=4)
    assert wv.load(target, path, rules="auto").ok
    assert_bitwise(target, source)


def test_a_prefix_the_model_has_itself_is_kept(tmp_path: Path) -> None:
    model = nn.Module()
    model.module = nn.Linear(2, 2)  # a submodule that happens to be called "module"
    path = tmp_path / "m.safetensors"
    wv.save(compiled(model), path)
    assert stored_names(path)[0] == ["module.bias", "module.weight"]
    target = nn.Module()
    target.module = nn.Linear(2, 2)
    report = wv.load(target, path)
    assert report.ok and report.renamed == []
    assert torch.equal(target.module.weight, model.module.weight)

    # An old compiled file loses only the prefix the model lacks.
    wv.save({"_orig_mod." + k: v for k, v in model.state_dict().items()}, path)
    report = wv.load(target, path)
    assert report.ok
    assert report.renamed == [(f"_orig_mod.module.{k}", f"module.{k}") for k in ("weight", "bias")]


def test_rules_for_the_models_names_apply_to_an_old_prefixed_file(tmp_path: Path) -> None:
    old = nn.Sequential()
    old.add_module("encoder", nn.Linear(2, 2))
    path = tmp_path / "old.safetensors"
    wv.save({"module." + k: v for k, v in old.state_dict().items()}, path)
    new = nn.Sequential()
    new.add_module("enc", nn.Linear(2, 2))
    report = wv.load(new, path, rules=[("encoder.*", "enc.*")])
    assert report.ok
    assert ("module.encoder.weight", "enc.weight") in report.renamed
    assert torch.equal(new.enc.weight, old.encoder.weight)
    # Rules written for the names on disk work as they always did.
    new = nn.Sequential()
    new.add_module("enc", nn.Linear(2, 2))
    assert wv.load(new, path, rules=[("module.encoder.*", "enc.*")]).ok
    assert torch.equal(new.enc.weight, old.encoder.weight)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8))
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def test_optimizer_state_saved_through_a_compiled_model_resumes_plain(tmp_path: Path) -> None:
    model = gpt2(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt, seed=10)
    path = tmp_path / "ckpt.safetensors"
    wv.save(compiled(model), path, optimizer=opt)
    names = stored_names(path)[0]
    assert not [n for n in names if "_orig_mod" in n]
    assert [n for n in names if "transformer.wte.weight" in n and "exp_avg_sq" in n]

    resumed = gpt2(seed=2)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    report = wv.load(resumed, path, optimizer=resumed_opt)
    assert report.ok and report.optimizer is not None and report.optimizer.ok
    assert "transformer.wte.weight" in report.optimizer.loaded
    # One more step on each gives the same weights: the state resumed exactly.
    _train_step(model, opt, seed=11)
    _train_step(resumed, resumed_opt, seed=11)
    assert_bitwise(resumed, model)


def test_optimizer_state_of_an_old_prefixed_file_resumes(tmp_path: Path) -> None:
    model = gpt2(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt, seed=10)
    path = tmp_path / "old.safetensors"
    # An old save through torch.compile: optimizer state keyed by prefixed names too.
    old = {"_orig_mod." + k: v for k, v in model.state_dict(keep_vars=True).items()}
    wv.save(old, path, optimizer=opt)

    resumed = gpt2(seed=2)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    report = wv.load(resumed, path, optimizer=resumed_opt)
    assert report.ok and report.optimizer is not None and report.optimizer.ok
    _train_step(model, opt, seed=11)
    _train_step(resumed, resumed_opt, seed=11)
    assert_bitwise(resumed, model)


def test_the_vault_stores_canonical_names(tmp_path: Path) -> None:
    vault = Vault(tmp_path / "vault")
    source = gpt2(seed=1)
    opt = torch.optim.AdamW(source.parameters(), lr=1e-3)
    _train_step(source, opt, seed=10)
    vault.save(compiled(source), "weights")
    vault.save(nn.DataParallel(source), "training", optimizer=opt)
    for name in ("weights", "training"):
        with vault.open(name) as ckpt:
            assert ckpt.names == list(source.state_dict())
        target = gpt2(seed=2)
        assert vault.load(target, name).ok
        assert_bitwise(target, source)


class Holder(nn.Module):
    """A training wrapper that is not one of torch's: its names carry ``model.``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def test_the_proposed_rule_counts_the_tied_alias_it_fixes(tmp_path: Path) -> None:
    path = tmp_path / "held.safetensors"
    wv.save(Holder(gpt2(seed=1)), path)
    target = gpt2(seed=2)
    with pytest.raises(weightvault.KeyMismatchError) as caught:
        wv.load(target, path)
    err = caught.value
    missing = list(target.state_dict())
    assert (len(err.missing), len(err.unexpected)) == (29, 28)
    assert err.rule == ("model.*", "*")
    # lm_head.weight is missing, and the rule renames its alias model.lm_head.weight to it.
    assert sorted(err.rule_fixes) == sorted(missing)
    assert "partial" not in str(err)
    assert wv.load(target, path, rules=[err.rule]).ok


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_freeze_on_a_wrapped_model_takes_and_returns_the_models_own_names(
    tmp_path: Path, wrap: str
) -> None:
    plain = gpt2()
    wrapped = WRAPS[wrap](plain)
    frozen = wv.freeze(wrapped, "transformer.h.0")
    assert frozen and all(n.startswith("transformer.h.0.") for n in frozen)
    assert not plain.transformer.h[0].attn.c_attn.weight.requires_grad
    assert plain.transformer.h[1].attn.c_attn.weight.requires_grad
    # A pattern written with the wrapper's prefix means the same parameters.
    again = wv.unfreeze(wrapped, "module.transformer.h.0.*", "_orig_mod.transformer.h.0.*")
    assert sorted(again) == sorted(frozen)
    assert plain.transformer.h[0].attn.c_attn.weight.requires_grad
    # The frozen set a checkpoint records uses the names it stores.
    wv.freeze(wrapped, "transformer.h.0")
    wv.save(wrapped, tmp_path / "m.safetensors")
    fresh = gpt2(seed=1)
    wv.load(fresh, tmp_path / "m.safetensors", restore_frozen=True)
    assert not fresh.transformer.h[0].attn.c_attn.weight.requires_grad
    assert fresh.transformer.h[1].attn.c_attn.weight.requires_grad
