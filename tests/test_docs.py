"""Every Python example in the README and docs runs as written, and so does the demo.

The ```python blocks of README.md and each docs/*.md run in a fresh Python process with
the environment a user has, not this suite's: ``tests/conftest.py`` sets
``KERAS_BACKEND=torch``, so that variable is removed, and Keras gets an empty
``KERAS_HOME`` so no ``~/.keras/keras.json`` picks a backend either. A block that needs a
Keras backend must therefore choose it itself, as a user's script must. The blocks of one
file run in order in one process, each in a fresh namespace and its own empty working
folder. Keras fixes its backend at its first import, so the first Keras block of a file
proves its ``KERAS_BACKEND`` line by running, and every Keras block is also checked to
set the variable before its import. A block whose first line is ``# not-run`` is skipped;
docs/benchmarks.md is skipped as a whole because its numbers come from a benchmark run,
not from an example. A block that imports a package which is not installed (an optional
framework) is skipped, not failed.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_FILES = {"benchmarks.md"}
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
#: Variables this suite sets for itself that a user's shell does not have.
SUITE_ONLY_ENV = ("KERAS_BACKEND",)

#: Runs the blocks it reads as JSON from stdin, each in a fresh namespace and folder;
#: the first failure prints its traceback (with the Markdown file's line numbers) and
#: exits 1.
RUNNER = """
import json, os, sys, traceback
base = os.getcwd()
for i, block in enumerate(json.load(sys.stdin)):
    os.environ.pop("KERAS_BACKEND", None)  # as in a user's shell, for every block
    folder = os.path.join(base, f"block{i}")
    os.mkdir(folder)
    os.chdir(folder)
    source = "\\n" * (block["line"] - 1) + block["code"]
    try:
        exec(compile(source, block["path"], "exec"), {"__name__": "__doc_example__"})
    except BaseException:
        traceback.print_exc()
        sys.exit(f"FAILED {block['id']}")
"""


@dataclass(frozen=True)
class Block:
    """One runnable block: its code and where it starts in its Markdown file."""

    code: str
    name: str
    line: int

    @property
    def id(self) -> str:
        return f"{self.name}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every docs/*.md except the skipped ones."""
    docs = sorted((ROOT / "docs").glob("*.md"))
    return [ROOT / "README.md", *(p for p in docs if p.name not in SKIP_FILES)]


def python_blocks(path: Path) -> list[Block]:
    """The runnable blocks of one Markdown file, in order."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        code = m.group(1)
        if code.lstrip().startswith("# not-run"):
            continue
        line = text.count("\n", 0, m.start()) + 2  # first line of code, 1-based
        out.append(Block(code, path.relative_to(ROOT).as_posix(), line))
    return out


FILES = [p for p in doc_files() if p.is_file() and python_blocks(p)]


def imports(code: str) -> list[str]:
    """Every module ``code`` imports, in order."""
    names: list[str] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def missing_imports(code: str) -> list[str]:
    """Modules ``code`` imports that are not installed (weightvault's own always are).

    An adapter of weightvault whose framework is missing counts as missing too; any other
    error importing weightvault is a failure, not a reason to skip.
    """
    from weightvault import BackendNotInstalled

    missing = []
    for name in imports(code):
        if name.split(".")[0] == "weightvault":
            try:
                importlib.import_module(name)
            except BackendNotInstalled:
                missing.append(name)
        elif importlib.util.find_spec(name.split(".")[0]) is None:
            missing.append(name)
    return missing


def is_keras(module: str) -> bool:
    """Whether importing ``module`` imports Keras (weightvault's Keras modules do)."""
    parts = module.split(".")
    return parts[0] == "keras" or (parts[0] == "weightvault" and "keras" in parts)


def keras_import_line(block: Block) -> int | None:
    """The first line of ``block`` that imports Keras, or ``None``."""
    lines = []
    for node in ast.walk(ast.parse(block.code)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        else:
            continue
        if any(map(is_keras, names)):
            lines.append(node.lineno)
    return min(lines, default=None)


def chooses_backend_first(block: Block) -> bool:
    """Whether a block that imports Keras sets ``KERAS_BACKEND`` before it does."""
    first = keras_import_line(block)
    if first is None:
        return True
    return "KERAS_BACKEND" in "".join(block.code.splitlines(keepends=True)[: first - 1])


def user_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment as a user's shell has it, running this checkout's code."""
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY_ENV}
    keras_home = tmp_path / "keras-home"
    keras_home.mkdir(exist_ok=True)
    env["KERAS_HOME"] = str(keras_home)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def run_blocks(blocks: list[Block], tmp_path: Path) -> None:
    """Run ``blocks`` in order in one fresh process; fail with the first one's traceback."""
    folder = Path(tempfile.mkdtemp(prefix="run-", dir=tmp_path))
    doc = [{"code": b.code, "path": str(ROOT / b.name), "line": b.line, "id": b.id} for b in blocks]
    result = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(doc),
        cwd=folder,
        env=user_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(result.stderr[-4000:])


def test_docs_have_examples() -> None:
    """The README and the docs pages exist and hold examples to run."""
    assert (ROOT / "README.md").is_file()
    assert sum(len(python_blocks(p)) for p in FILES) >= 10


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_examples_run(path: Path, tmp_path: Path) -> None:
    """Every block of one file runs, in order, in a fresh process with a user's environment."""
    blocks = python_blocks(path)
    runnable = [b for b in blocks if not missing_imports(b.code)]
    if not runnable:
        pytest.skip(f"every block of {path.name} needs a package that is not installed")
    # Keras fixes its backend at its first import, so only the first Keras block of a
    # process shows a missing KERAS_BACKEND by failing; every other is checked here.
    unchosen = [b.id for b in runnable if not chooses_backend_first(b)]
    assert not unchosen, f"set KERAS_BACKEND before importing Keras in {unchosen}"
    run_blocks(runnable, tmp_path)


def test_keras_blocks_are_read_for_their_backend_line() -> None:
    """Keras blocks after a file's first are checked by reading them."""
    chosen = 'import os\nos.environ["KERAS_BACKEND"] = "torch"\nimport keras\n'
    assert chooses_backend_first(Block(chosen, "README.md", 1))
    assert chooses_backend_first(Block("import torch\n", "README.md", 1))
    assert not chooses_backend_first(Block("import weightvault.keras as wvk\n", "README.md", 1))
    late = 'import keras\nimport os\nos.environ["KERAS_BACKEND"] = "jax"\n'
    assert not chooses_backend_first(Block(late, "README.md", 1))
    assert (
        keras_import_line(
            Block("x = 1\nfrom weightvault.integrations.keras import restore\n", "a", 1)
        )
        == 2
    )


def test_a_keras_block_must_choose_its_backend(tmp_path: Path) -> None:
    """The docs test sees what a user sees: Keras without a backend fails without TF."""
    pytest.importorskip("keras")
    if importlib.util.find_spec("tensorflow") is not None:
        pytest.skip("TensorFlow is installed, so Keras' default backend works")
    bare = Block("import keras\n", "README.md", 1)
    with pytest.raises(AssertionError, match="tensorflow"):
        run_blocks([bare], tmp_path)
    chosen = Block(
        'import os\nos.environ["KERAS_BACKEND"] = "torch"\nimport keras\n', "README.md", 1
    )
    run_blocks([chosen], tmp_path)


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
    # Each phase announces itself as it starts, so a slow machine never looks hung.
    phases = re.findall(r"^\[(\d)/5\] .*\(at \d+ s\)$", result.stdout, re.MULTILINE)
    assert phases == ["1", "2", "3", "4", "5"], result.stdout
    # The save and the resume, timed beside plain files.
    for kind in ("save", "load"):
        assert re.search(
            rf"^  {kind} of model \+ optimizer: vault \d+ ms, plain files \d+ ms \([\d.]+x\)$",
            result.stdout,
            re.MULTILINE,
        ), result.stdout
    assert re.search(r"^  step   1  loss [\d.]+$", result.stdout, re.MULTILINE)
    assert re.search(r"^done in \d+ s$", result.stdout, re.MULTILINE)
    assert (tmp_path / "v" / "bytes.png").exists()
    # The bytes saved: the checkpoints' raw bytes (the records) against the vault's files
    # on disk (walked here; bytes.png is written after the line is printed).
    m = re.search(SAVED, result.stdout, re.MULTILINE)
    assert m, result.stdout
    assert m["n"] == "2"
    import weightvault

    raw = sum(r.stored_bytes for r in weightvault.Vault(tmp_path / "v").list())
    files = [p for p in (tmp_path / "v").rglob("*") if p.is_file() and p.name != "bytes.png"]
    disk = sum(p.stat().st_size for p in files)
    assert (m["raw"], m["disk"]) == (f"{raw / 2**20:.1f}", f"{disk / 2**20:.1f}")
    assert m["ratio"] == f"{disk / raw:.2f}" and m["saved"] == f"{(raw - disk) / 2**20:.1f}"
    # The README shows the same line from the full demo.
    assert re.search(SAVED, (ROOT / "README.md").read_text(encoding="utf-8"), re.MULTILINE)


#: The demo's last word on bytes: raw bytes of all checkpoints against the vault on disk.
SAVED = (
    r"^bytes saved: (?P<n>\d+) checkpoints hold (?P<raw>[\d.]+) MiB raw; the vault takes "
    r"(?P<disk>[\d.]+) MiB on disk \((?P<ratio>[\d.]+)x of raw, [\d.]+x smaller\), "
    r"(?P<saved>[\d.]+) MiB saved$"
)


def test_blocks_needing_missing_packages_are_skipped_not_failed() -> None:
    code = "import json\nimport no_such_package_xyz.sub\nfrom weightvault import inspect\n"
    assert missing_imports(code) == ["no_such_package_xyz.sub"]


# -- docs/cli.md: every `$ weightvault` line's output is what the command prints -------------

CONSOLE = re.compile(r"^```console[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
#: Dates differ from run to run; both sides are compared with this pattern masked.
DATE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


@dataclass
class Step:
    """One ``$ command`` of a console block and the output the page shows for it."""

    command: str
    expected: list[str]
    line: int


def transcript(text: str) -> list[Step]:
    """Every ``$ command`` of every console block, in order."""
    steps: list[Step] = []
    for m in CONSOLE.finditer(text):
        first = text.count("\n", 0, m.start()) + 2
        for i, line in enumerate(m.group(1).splitlines()):
            if line.startswith("$ "):
                steps.append(Step(line[2:], [], first + i))
            elif steps:
                steps[-1].expected.append(line)
    return steps


def shows(expected: list[str], actual: str) -> bool:
    """Whether ``actual`` is ``expected``, a line ``...`` standing for any lines."""
    pattern = "".join(
        r"(?:.*\n)*?" if line == "..." else re.escape(DATE.sub("DATE", line)) + r"\n"
        for line in expected
    )
    return re.fullmatch(pattern, DATE.sub("DATE", actual)) is not None


def replay(steps: list[Step], capsys: pytest.CaptureFixture[str]) -> list[tuple[Step, str]]:
    """Run each step in the current folder: ``weightvault ...`` or ``echo $?``."""
    import shlex

    from weightvault._cli.app import main

    code, out = 0, []
    for step in steps:
        argv = shlex.split(step.command, comments=True)
        if argv == ["echo", "$?"]:
            actual = f"{code}\n"
        elif argv[:1] == ["weightvault"]:
            capsys.readouterr()
            code = main(argv[1:])
            captured = capsys.readouterr()
            actual = captured.out + captured.err
        else:
            raise AssertionError(f"docs/cli.md:{step.line}: only weightvault and echo $? run")
        out.append((step, actual))
    return out


#: The time every vault record of the replay is made at (2026-01-01 00:00:00.5 UTC).
FIXED_TIME = 1767225600.5


def steady(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the bytes the page shows repeatable: the RNG states a checkpoint saves come
    from seeded generators, and every record is made at :data:`FIXED_TIME`, so headers
    and records have the same length on every run."""
    import contextlib
    import random
    import time

    import numpy as np

    # python-blosc2 draws from ``random`` when first imported (by the vault's compactor,
    # or earlier in the suite): imported before the seed, the saved state is the same.
    with contextlib.suppress(ImportError):
        import blosc2  # noqa: F401

    random.seed(0)
    np.random.seed(0)
    monkeypatch.setattr(time, "time", lambda: FIXED_TIME)


def test_cli_md_shows_what_each_command_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each `$ weightvault` line of docs/cli.md, run after the page's own script, prints
    exactly the output the page shows (and `echo $?` the exit code)."""
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    path = ROOT / "docs" / "cli.md"
    setup = python_blocks(path)[0]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps usage lines to the terminal
    steady(monkeypatch)
    exec(compile("\n" * (setup.line - 1) + setup.code, str(path), "exec"), {})
    wrong = [
        f"docs/cli.md:{step.line}: $ {step.command}\n{actual}"
        for step, actual in replay(transcript(path.read_text(encoding="utf-8")), capsys)
        if not shows(step.expected, actual)
    ]
    assert not wrong, "\n".join(wrong)


def test_transcripts_compare_lines_with_ellipses() -> None:
    assert shows(["a", "...", "d"], "a\nb\nc\nd\n")
    assert shows(["a", "...", "b"], "a\nb\n")
    assert not shows(["a", "b"], "a\nb\nc\n")
    assert shows(["made 2024-01-02 03:04:05"], "made 2026-12-01 21:20:13\n")


def commands(parser: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], list[list[str]]]:
    """Every runnable command of ``parser`` (``("vault", "gc")``) and its flags, each as
    its spellings (``["-o", "--output"]``)."""
    import argparse

    out: dict[tuple[str, ...], list[list[str]]] = {}
    skip = {"-h", "--help", "--version"}
    flags = [a.option_strings for a in parser._actions if set(a.option_strings) - skip]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for leaf, more in commands(sub, (*path, name)).items():
                    out[leaf] = more + flags
    return out or {path: flags}


def test_cli_md_runs_every_command_with_every_flag() -> None:
    """Each command, and each of its flags, appears in a `$ weightvault` line of the page,
    so every one is shown with the output of a real run."""
    import shlex

    from weightvault._cli.app import build_parser

    lines = [
        shlex.split(s.command, comments=True)
        for s in transcript((ROOT / "docs" / "cli.md").read_text(encoding="utf-8"))
    ]
    runs = [a[1:] for a in lines if a[:1] == ["weightvault"]]
    for command, flags in commands(build_parser()).items():
        shown = [a for a in runs if a[: len(command)] == list(command)]
        if command[0] == "vault":  # weightvault vault ROOT VERB
            shown = [a for a in runs if a[:1] == ["vault"] and a[2:3] == [command[1]]]
        assert shown, f"docs/cli.md runs no 'weightvault {' '.join(command)}'"
        for spellings in flags:
            used = any(f in a for a in shown for f in spellings)
            assert used, f"docs/cli.md never runs {command} {spellings[-1]}"
