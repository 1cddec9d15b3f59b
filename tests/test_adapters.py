"""The adapter contract: every registered adapter offers it, and the vault uses only it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from weightvault import Vault
from weightvault._vault.adapters import ADAPTERS, adapter_for

np = pytest.importorskip("numpy")


@pytest.mark.parametrize("module", [m for m, _ in ADAPTERS])
def test_every_registered_adapter_offers_the_contract(module: str) -> None:
    try:
        adapter = importlib.import_module(module)
    except ImportError:
        pytest.skip(f"{module}'s framework is not installed")
    assert isinstance(adapter.FRAMEWORK, str) and adapter.FRAMEWORK
    for hook in ("owns", "sources", "load", "checkpoint_sources"):
        assert callable(getattr(adapter, hook)), f"{module} lacks {hook}"
    assert not adapter.owns(object())


def test_the_vault_saves_and_loads_numpy_dicts(tmp_path: Path) -> None:
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    arrays = {"w": w, "w_again": w, "b": np.ones(3, np.int64)}
    vault = Vault(tmp_path / "v")
    record = vault.save(arrays, "one")
    assert record.framework == "np"
    with vault.open("one") as ckpt:
        assert ckpt.entry("w_again").kind == "alias"  # the tie survives the vault
    into = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.int64)}
    into["w_again"] = into["w"]
    report = vault.load(into, "one", tie=True)
    assert sorted(report.loaded) == ["b", "w", "w_again"]
    np.testing.assert_array_equal(into["w"], w)
    np.testing.assert_array_equal(into["b"], np.ones(3, np.int64))


def test_numpy_state_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"weightvault\.numpy: the vault saves no optimizer"):
        Vault(tmp_path / "v").save({"w": np.zeros(2)}, rng=True)


def test_torch_dicts_go_to_torch_and_strangers_are_refused() -> None:
    with pytest.raises(TypeError, match="does not know how to save a int"):
        adapter_for(3)
    torch = pytest.importorskip("torch")
    assert adapter_for({"w": torch.zeros(2)}).FRAMEWORK == "pt"
    assert adapter_for(torch.nn.Linear(2, 2)).FRAMEWORK == "pt"
