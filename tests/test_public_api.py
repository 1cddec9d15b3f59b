"""The public API is pinned: changing it must change this test."""

from __future__ import annotations

import subprocess
import sys

import weightvault


def test_all_is_pinned():
    assert weightvault.__all__ == [
        "BackendNotInstalled",
        "Checkpoint",
        "CheckpointExistsError",
        "CheckpointNameError",
        "CheckpointNotFoundError",
        "CheckpointRecord",
        "ChecksumError",
        "DiffReport",
        "FormatError",
        "Inspection",
        "KeyMismatchError",
        "LoadReport",
        "OptimizerReport",
        "ReservedNameError",
        "RuleError",
        "SaveHandle",
        "SaveReport",
        "ShapeMismatchError",
        "TieConflictError",
        "UnsupportedDtypeError",
        "UnsupportedValueError",
        "Vault",
        "VaultVerifyReport",
        "VerifyReport",
        "WeightvaultError",
        "__version__",
        "convert",
        "diff",
        "inspect",
        "verify",
    ]
    for name in weightvault.__all__:
        assert hasattr(weightvault, name)


def test_torch_adapter_verbs_are_pinned():
    import pytest

    pytest.importorskip("torch")
    import weightvault.torch as wv

    assert wv.__all__ == ["freeze", "load", "load_file", "save", "trainable", "unfreeze"]


def test_keras_adapter_verbs_are_pinned():
    import pytest

    pytest.importorskip("keras")
    import weightvault.keras as wvk

    assert wvk.__all__ == ["freeze", "load", "load_file", "save", "trainable", "unfreeze"]


def test_jax_adapter_verbs_are_pinned():
    import pytest

    pytest.importorskip("jax")
    import weightvault.jax as wvj

    assert wvj.__all__ == ["freeze", "load", "load_file", "save", "trainable", "unfreeze"]


def test_errors_subclass_the_base_and_the_builtin():
    e = weightvault
    for cls in (
        e.FormatError,
        e.ChecksumError,
        e.KeyMismatchError,
        e.ShapeMismatchError,
        e.TieConflictError,
        e.RuleError,
        e.CheckpointNameError,
        e.ReservedNameError,
    ):
        assert issubclass(cls, e.WeightvaultError) and issubclass(cls, ValueError)
    assert issubclass(e.BackendNotInstalled, ImportError)
    assert issubclass(e.UnsupportedValueError, TypeError)
    assert issubclass(e.ChecksumError, e.FormatError)


def test_import_and_cli_need_no_framework(tmp_path):
    """`import weightvault` and the CLI work with torch, numpy and safetensors blocked."""
    blocker = (
        "import sys\n"
        "for m in ('torch', 'numpy', 'safetensors', 'keras', 'jax', 'tensorflow'):\n"
        "    sys.modules[m] = None\n"
        "import weightvault, weightvault._cli.main, weightvault.rules\n"
        "assert not any(m in sys.modules and sys.modules[m] is not None\n"
        "               for m in ('torch', 'numpy'))\n"
        "try:\n"
        "    import weightvault.torch\n"
        "except weightvault.BackendNotInstalled as e:\n"
        "    assert \"pip install 'weightvault[torch]'\" in str(e)\n"
        "else:\n"
        "    raise SystemExit('torch import should have failed')\n"
        "raise SystemExit(weightvault._cli.main(['--version']))\n"
    )
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("weightvault ")


def test_dcp_module_is_pinned():
    import pytest

    pytest.importorskip("torch.distributed.checkpoint")
    import weightvault.dcp as wdcp

    assert wdcp.__all__ == [
        "ReadStats",
        "UnstorableValueError",
        "VaultReader",
        "VaultSavePlanner",
        "VaultWriter",
        "load",
        "save",
    ]


def test_keras_integration_is_pinned():
    import pytest

    pytest.importorskip("keras")
    from weightvault.integrations import keras as integration

    assert integration.__all__ == ["VaultCheckpoint", "restore"]


def test_integrations_are_pinned_and_not_imported_by_weightvault():
    import pytest

    out = subprocess.run(
        [sys.executable, "-c", "import sys, weightvault, weightvault.integrations, "
         "weightvault.torch\nassert not any(m in sys.modules for m in ('transformers', "
         "'lightning', 'peft', 'weightvault.integrations.transformers', "
         "'weightvault.integrations.lightning')), 'imported'"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    import weightvault.integrations.lightning as wvl
    import weightvault.integrations.transformers as wvt

    assert wvt.__all__ == ["VaultCallback", "checkout", "resume"]
    assert wvl.__all__ == ["VaultCheckpointIO", "checkpoint_name"]
