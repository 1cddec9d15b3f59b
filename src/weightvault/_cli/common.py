"""What the ``weightvault`` subcommands share: exit codes, tables, and registration.

Its own module so that :mod:`.app` (the parser and ``main``) and the subcommand modules
(:mod:`.convert`, :mod:`.vault`, with :mod:`.describe` and :mod:`.plot`) all import it,
and no subcommand module imports :mod:`.app`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TextIO

from .._base.errors import (
    BackendNotInstalled,
    CheckpointExistsError,
    CheckpointNotFoundError,
    FormatError,
    VaultBusyError,
    VaultNotFoundError,
    WeightvaultError,
)
from .._tools.inspect import DiffReport

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREADABLE, EXIT_UNEXPECTED = 0, 1, 2, 3, 4
EXIT_REFUSED, EXIT_NOT_INSTALLED = 5, 6
EXIT_INTERRUPTED = 130

#: Every exit code and its one meaning; ``--help`` and docs/cli.md say the same.
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success (intact file, identical files, done)",
    EXIT_FAILED: "a check failed (verify found damage, diff found differences)",
    EXIT_USAGE: "usage error (unknown command, missing or malformed arguments)",
    EXIT_UNREADABLE: "an input could not be read (missing or unreadable file, not a "
    "valid checkpoint, no vault at that path, no vault checkpoint of that name)",
    EXIT_UNEXPECTED: "unexpected error, reported in one line (WEIGHTVAULT_DEBUG=1 shows "
    "the traceback; please report it)",
    EXIT_REFUSED: "refused: the inputs are fine but the request cannot be done as asked "
    "(a checkpoint name taken or invalid, a rule that matches nothing, names that do "
    "not match, a gc that may still be running)",
    EXIT_NOT_INSTALLED: "a package the input needs is not installed (the message gives "
    "the pip command)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


def exit_code(error: BaseException) -> int:
    """The exit code of a command that raised ``error`` (see :data:`EXIT_CODES`)."""
    if isinstance(error, BackendNotInstalled):
        return EXIT_NOT_INSTALLED
    # Both are OSErrors (FileExistsError, TimeoutError), yet the vault was read fine and
    # the request refused: test them before OSError.
    if isinstance(error, CheckpointExistsError | VaultBusyError):
        return EXIT_REFUSED
    if isinstance(error, FormatError | CheckpointNotFoundError | VaultNotFoundError | OSError):
        return EXIT_UNREADABLE
    if isinstance(error, WeightvaultError):
        return EXIT_REFUSED
    return EXIT_UNEXPECTED


def table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


def report_check(report: Any, where: str, summary: str, as_json: bool, out: TextIO) -> int:
    """Print a verify report (``OK, summary`` or ``DAMAGED`` and each problem, or the
    report as JSON) and return its exit code."""
    if as_json:
        print_json(asdict(report), out)
    elif report.ok:
        out.write(f"{where}: OK, {summary}\n")
    else:
        out.write(f"{where}: DAMAGED\n")
        for problem in report.problems:
            out.write(f"  {problem}\n")
    return EXIT_OK if report.ok else EXIT_FAILED


def report_diff(d: DiffReport, atol: float, as_json: bool, out: TextIO) -> int:
    """Print a diff (``-`` removed, ``+`` added, ``~`` changed) and return the exit code."""
    changed = [(n, v) for n, v in d.changed if v is None or v > atol]
    within = len(d.changed) - len(changed)
    if as_json:
        doc = asdict(d)
        doc["changed"] = changed
        doc["atol"] = atol
        doc["within_atol"] = [(n, v) for n, v in d.changed if (n, v) not in changed]
        print_json(doc, out)
    else:
        for n in d.removed:
            out.write(f"- {n}\n")
        for n in d.added:
            out.write(f"+ {n}\n")
        for n, a, b in d.reshaped:
            out.write(f"~ {n}: {a} -> {b}\n")
        for n, v in changed:
            out.write(f"~ {n}: max abs diff {'?' if v is None else f'{v:.6g}'}\n")
        out.write(
            f"{len(d.removed)} removed, {len(d.added)} added, {len(d.reshaped)} reshaped, "
            f"{len(changed)} changed, {within} within --atol, {d.same} identical\n"
        )
    return EXIT_FAILED if (d.removed or d.added or d.reshaped or changed) else EXIT_OK


def tolerance(text: str) -> float:
    """``--atol``: a finite number, zero or more (argparse reports anything else)."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(text)
    return value


def not_a_vault(path: str) -> str:
    """``path`` itself, unless it is a vault's folder or a sharded checkpoint's index:
    then a hint to what reads it.

    Raises:
        FormatError: ``path`` is a vault or an index, which the file commands do not read.
    """
    if path.endswith(".index.json"):
        raise FormatError(
            f"{path}: is the index of a checkpoint split into several files; weightvault "
            "reads one file at a time: name a shard, such as model-00001-of-00002.safetensors"
        )
    if os.path.isfile(os.path.join(path, "vault.json")):
        raise FormatError(
            f"{path}: is a vault, not a checkpoint file; use 'weightvault vault {path} show' "
            "(or log, diff, export)"
        )
    return path


def print_json(doc: object, out: TextIO) -> None:
    """Print ``doc`` as the one JSON document a ``--json`` command writes."""
    json.dump(doc, out, indent=2)
    out.write("\n")


Subparsers = Any  # argparse's _SubParsersAction, which is private


def add_command(
    sub: Subparsers, name: str, func: Callable[..., int], help: str, epilog: str
) -> argparse.ArgumentParser:
    """Add one subcommand whose handler is ``func(args, out) -> exit code``."""
    p: argparse.ArgumentParser = sub.add_parser(
        name,
        help=help,
        description=help,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=func)
    return p
