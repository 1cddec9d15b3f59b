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
        "CollectivesRequiredError",
        "DiffReport",
        "DistributedCheckpointError",
        "FormatError",
        "Inspection",
        "InvalidLimitError",
        "KerasInternalsChanged",
        "KeyMismatchError",
        "LoadOptionError",
        "LoadReport",
        "ModelNotBuiltError",
        "NameCollisionError",
        "OptimizerReport",
        "ReservedNameError",
        "RuleError",
        "SaveHandle",
        "SaveReport",
        "ShapeMismatchError",
        "SourceDamagedError",
        "TieConflictError",
        "TrainingStateError",
        "TransferReport",
        "UnstorableValueError",
        "UnsupportedDtypeError",
        "UnsupportedStateError",
        "UnsupportedValueError",
        "Vault",
        "VaultBusyError",
        "VaultNotFoundError",
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

    assert wvk.__all__ == [
        "check",
        "freeze",
        "load",
        "load_file",
        "load_model",
        "save",
        "save_model",
        "save_weights",
        "trainable",
        "unfreeze",
    ]


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
        "import weightvault, weightvault._cli.app, weightvault.rules\n"
        "assert not any(m in sys.modules and sys.modules[m] is not None\n"
        "               for m in ('torch', 'numpy'))\n"
        "try:\n"
        "    import weightvault.torch\n"
        "except weightvault.BackendNotInstalled as e:\n"
        "    assert \"pip install 'weightvault[torch]'\" in str(e)\n"
        "else:\n"
        "    raise SystemExit('torch import should have failed')\n"
        "raise SystemExit(weightvault._cli.app.main(['--version']))\n"
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
        "async_save",
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


def test_every_error_class_lives_in_one_module_and_is_exported():
    import ast
    from pathlib import Path

    from weightvault._base import errors

    src = Path(weightvault.__file__).parent
    defined_elsewhere = [
        f"{p.relative_to(src)}:{node.name}"
        for p in src.rglob("*.py")
        if p != Path(errors.__file__)
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
        and any(getattr(b, "id", "").endswith(("Error", "Changed")) for b in node.bases)
    ]
    assert not defined_elsewhere, defined_elsewhere
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    for cls in classes:
        assert getattr(weightvault, cls.__name__) is cls, cls.__name__
        assert cls.__name__ in weightvault.__all__
        if cls is not weightvault.WeightvaultError:
            # Each subclasses the base and a builtin a caller would already catch.
            assert issubclass(cls, weightvault.WeightvaultError)
            assert any(b.__module__ == "builtins" for b in cls.__mro__[1:-2]), cls


def test_no_bare_base_error_is_raised():
    # A caller catches the specific class (KeyError-like, ValueError-like, ...), never only
    # the base; each raise names one.
    import re
    from pathlib import Path

    src = Path(weightvault.__file__).parent
    bare = [
        f"{p.relative_to(src)}:{i}"
        for p in src.rglob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"raise WeightvaultError\(", line)
    ]
    assert not bare, bare


def test_vault_marks_and_walk_are_pinned():
    # The training-loop callbacks mark the best checkpoint through these very calls.
    import dataclasses
    import inspect

    shape = {
        m: str(inspect.signature(getattr(weightvault.Vault, m)))
        for m in ("mark", "unmark", "marks", "walk")
    }
    assert shape == {
        "mark": "(self, name: 'str', label: 'str' = 'best') -> 'None'",
        "unmark": "(self, label: 'str' = 'best') -> 'str | None'",
        "marks": "(self) -> 'dict[str, str]'",
        "walk": "(self, model: 'Any', names: 'Sequence[str] | None' = None, *, "
        "verify: 'bool' = True, **options: 'Any') -> 'Iterator[tuple[str, Any]]'",
    }
    fields = {f.name: f.default for f in dataclasses.fields(weightvault.CheckpointRecord)}
    assert fields["labels"] == ()
