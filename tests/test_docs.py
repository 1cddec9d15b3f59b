"""Every Python example in the README and docs runs as written, and so does the demo.

Each ```python block of README.md and docs/*.md runs in a fresh namespace with a temporary
folder as its working directory, so the documentation cannot drift from the code. A block
whose first line is ``# not-run`` is skipped; docs/benchmarks.md is skipped as a whole
because its numbers come from a benchmark run, not from an example. A block that imports
a package which is not installed (an optional framework) is skipped, not failed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_FILES = {"benchmarks.md"}
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def doc_files() -> list[Path]:
    """README.md and every docs/*.md except the skipped ones."""
    docs = sorted((ROOT / "docs").glob("*.md"))
    return [ROOT / "README.md", *(p for p in docs if p.name not in SKIP_FILES)]


def python_blocks() -> list[Any]:
    """One ``pytest.param(code)`` per runnable block, with an id of ``file:line``."""
    out = []
    for path in doc_files():
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            code = m.group(1)
            if code.lstrip().startswith("# not-run"):
                continue
            line = text.count("\n", 0, m.start()) + 2  # first line of code, 1-based
            name = path.relative_to(ROOT).as_posix()
            out.append(pytest.param(code, name, line, id=f"{name}:{line}"))
    return out


BLOCKS = python_blocks()


def missing_imports(code: str) -> list[str]:
    """Modules ``code`` imports that are not installed (weightvault's own always are).

    An adapter of weightvault whose framework is missing counts as missing too; any other
    error importing weightvault is a failure, not a reason to skip.
    """
    from weightvault import BackendNotInstalled

    names: list[str] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    missing = []
    for name in names:
        if name.split(".")[0] == "weightvault":
            try:
                importlib.import_module(name)
            except BackendNotInstalled:
                missing.append(name)
        elif importlib.util.find_spec(name.split(".")[0]) is None:
            missing.append(name)
    return missing


def test_docs_have_examples() -> None:
    """The README and the docs pages exist and hold examples to run."""
    assert (ROOT / "README.md").is_file()
    assert len(BLOCKS) >= 10, [b.id for b in BLOCKS]


@pytest.mark.parametrize(("code", "name", "line"), BLOCKS)
def test_doc_example_runs(
    code: str, name: str, line: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block runs without error in a fresh namespace inside an empty folder."""
    missing = missing_imports(code)
    if missing:
        pytest.skip(f"{name}:{line} needs {', '.join(missing)}, which is not installed")
    monkeypatch.chdir(tmp_path)
    # Pad with newlines so a traceback's line numbers match the Markdown file.
    source = "\n" * (line - 1) + code
    compiled = compile(source, str(ROOT / name), "exec")
    exec(compiled, {"__name__": "__doc_example__"})


def test_demo_runs_and_prints_the_seed_numbers() -> None:
    """``make demo`` exits 0 and prints the numbers the seed reports are about."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "shared_weights.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # (a) weightvault stores the shared layer once; the per-name copy writer four times.
    assert re.search(r"weightvault\.torch\.save\(model\)\s+[\d.]+ MiB\s+1\.00x\s+2\s+8", out), out
    assert re.search(r"\[Gluon/Keras\]\s+[\d.]+ MiB\s+4\.00x", out), out
    assert "Some tensors share memory" in out
    # (b) the renamed model: the error proposes the rule, and the load with it succeeds.
    assert "Pass rules=[('l1.*', 'l2.*')] to rename" in out
    assert "Foo2.l2 now equals Foo.l1: True" in out
    # (c) frozen: 42 before and after; trainable: 41.58 after; still frozen after a load.
    assert re.search(r"frozen \['conv\.weight'\]\s+42\s+42\n", out), out
    assert re.search(r"trainable\s+42\s+41\.58\n", out), out
    assert "conv.weight.requires_grad = False" in out
    assert "output after one SGD step over fresh.parameters(): 42\n" in out


def test_finetune_demo_runs_tiny(tmp_path):
    """`make demo`'s script, on a 2-layer GPT-2: checkpoints cost only the trained block."""
    script = Path(__file__).resolve().parents[1] / "examples" / "finetune.py"
    result = subprocess.run(
        [sys.executable, str(script), "--tiny", "--steps", "4", "--stop", "2", "--vault", "v"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        # This checkout's source, not whichever weightvault the interpreter has installed.
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "outputs identical to the trained model: True" in result.stdout
    assert "-- restarted: resumed 000001" in result.stdout
    assert "parameters bitwise identical: True" in result.stdout
    assert (tmp_path / "v" / "bytes.png").exists()


def test_blocks_needing_missing_packages_are_skipped_not_failed() -> None:
    code = "import json\nimport no_such_package_xyz.sub\nfrom weightvault import inspect\n"
    assert missing_imports(code) == ["no_such_package_xyz.sub"]
