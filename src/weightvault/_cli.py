"""The ``weightvault`` command line: inspect, verify, diff (and, from other modules,
convert and vault) checkpoint files.

Exit codes (also in ``weightvault --help``):
    0  success: the file is intact, or the two files are identical
    1  a check failed: verify found damage, or diff found differences
    2  usage error (bad arguments)
    3  an input could not be read: missing file, or not a valid checkpoint
    4  an unexpected error: a one-line message, never a traceback; set
       WEIGHTVAULT_DEBUG=1 to see the traceback (and please report it)
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, TextIO

from . import __version__
from ._errors import FormatError, WeightvaultError
from ._inspect import DiffReport, Inspection, diff, inspect, verify
from ._progress import Progress, human

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREADABLE, EXIT_UNEXPECTED = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130
#: Set to 1 to let an unexpected error show its traceback.
DEBUG_ENV = "WEIGHTVAULT_DEBUG"

EPILOG = """\
exit codes:
  0  success (intact file, identical files)
  1  a check failed (verify found damage, diff found differences)
  2  usage error
  3  an input could not be read (missing file; for inspect and diff, also a
     file that is not a checkpoint; verify reports that as damage, exit 1)
  4  unexpected error, reported in one line (WEIGHTVAULT_DEBUG=1 shows the
     traceback; please report it)
  130 interrupted

examples:
  weightvault inspect model.safetensors
  weightvault inspect model.safetensors --json | jq .aliases
  weightvault verify model.safetensors
  weightvault diff step100.safetensors step200.safetensors
  weightvault vault runs/ft log            (see: weightvault vault --help)
"""


_size = human


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    info = inspect(args.file)
    if args.json:
        doc = asdict(info)
        doc["bytes_saved"] = info.bytes_saved
        doc["dedupe_savings"] = info.dedupe_savings
        json.dump(doc, out, indent=2)
        out.write("\n")
        return EXIT_OK
    if info.format_version:
        kind = f"weightvault v{info.format_version}"
    elif info.container == "safetensors":
        kind = "plain safetensors"
    else:
        kind = f"{info.container} file, read without its framework"
    out.write(f"{info.path}: {kind}, {len(info.names)} names, {len(info.stored)} stored\n\n")
    print_inspection(info, out)
    return EXIT_OK


def print_inspection(info: Inspection, out: TextIO) -> None:
    """The table of names grouped by the tensor they share, and the totals."""
    rows = [["name", "dtype", "shape", "size", "held as"]]
    members: dict[str, list[str]] = {}
    for name, rec in info.tensors.items():
        if rec.kind != "stored":
            members.setdefault(rec.stored, []).append(name)
    for name in info.stored:
        t = info.tensors.get(name)
        if t is None:  # storage that several views share, not itself a model name
            size = _size(info.shared_storage[name])
            rows.append([name, "U8", "", size, "storage shared by views"])
        else:
            flag = " (frozen)" if name in info.frozen else ""
            if name in info.duplicates:
                flag += f", equal to {info.duplicates[name]}"
            rows.append([name, t.dtype, str(list(t.shape)), _size(t.nbytes), "stored" + flag])
        for other in members.get(name, []):
            o = info.tensors[other]
            how = {"alias": "alias of", "copy": "copy of", "view": "view of"}[o.kind]
            rows.append([f"  {other}", o.dtype, str(list(o.shape)), "0 B", f"{how} {name}"])
    _table(rows, out)
    out.write(
        f"\nlogical {_size(info.logical_bytes)}, stored {_size(info.stored_bytes)}, "
        f"saved by deduplication {_size(info.bytes_saved)}; "
        f"{len(info.aliases)} aliases, {len(info.copies)} copies, {len(info.views)} views, "
        f"{len(info.frozen)} frozen\n"
    )
    if info.duplicates:
        out.write(
            f"{len(info.duplicates)} copies are stored under their own names for plain "
            f"readers; dedupe_copies=True would save {_size(info.dedupe_savings)} more\n"
        )
    if info.metadata:
        out.write(f"metadata: {json.dumps(info.metadata)}\n")


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    with open(args.file, "rb"):
        pass  # an unreadable path is exit 3, not "damaged"
    try:
        total = inspect(args.file).stored_bytes
    except (FormatError, OSError):
        total = 0
    bar = Progress(total, "verifying")
    report = verify(args.file, progress=bar)
    bar.close()
    if args.json:
        json.dump(asdict(report), out, indent=2)
        out.write("\n")
    elif report.ok:
        note = "" if report.has_checksums else " (no checksums recorded: structure only)"
        out.write(f"{report.path}: OK, {report.checked} tensors checked{note}\n")
    else:
        out.write(f"{report.path}: DAMAGED\n")
        for p in report.problems:
            out.write(f"  {p}\n")
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_diff(args: argparse.Namespace, out: TextIO) -> int:
    return report_diff(diff(args.a, args.b), args.atol, args.json, out)


def report_diff(d: DiffReport, atol: float, as_json: bool, out: TextIO) -> int:
    """Print a diff (``-`` removed, ``+`` added, ``~`` changed) and return the exit code."""
    changed = [(n, v) for n, v in d.changed if v is None or v > atol]
    within = len(d.changed) - len(changed)
    if as_json:
        doc = asdict(d)
        doc["changed"] = changed
        json.dump(doc, out, indent=2)
        out.write("\n")
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


def _extensions() -> list[Callable[[Subparsers], None]]:
    """Subcommands that live in their own modules; each registers itself on ``sub``."""
    from . import _cli_convert, _cli_vault

    return [_cli_vault.register, _cli_convert.register]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightvault",
        description="Inspect, verify, compare and convert weight files that store every "
        "distinct tensor once (valid safetensors; plain safetensors files work too), and "
        "look after vaults of checkpoints.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"weightvault {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func: Callable[..., int], help: str, epilog: str) -> argparse.ArgumentParser:
        return add_command(sub, name, func, help, epilog)

    p = add(
        "inspect",
        cmd_inspect,
        "List every name with its dtype, shape and size, grouped by the tensor it shares; "
        "only the header is read.",
        "example:\n  weightvault inspect model.safetensors\n"
        "  weightvault inspect model.safetensors --json",
    )
    p.add_argument("file", help="a weightvault or safetensors file")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = add(
        "verify",
        cmd_verify,
        "Check the file's structure and every tensor's checksum; exit 1 naming each "
        "damaged tensor.",
        "example:\n  weightvault verify model.safetensors && echo intact",
    )
    p.add_argument("file", help="a weightvault or safetensors file")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = add(
        "diff",
        cmd_diff,
        "List names removed (-), added (+) and changed (~, with the max abs difference) "
        "from A to B; exit 1 if they differ.",
        "example:\n  weightvault diff step100.safetensors step200.safetensors --atol 1e-6",
    )
    p.add_argument("a", help="the first file")
    p.add_argument("b", help="the second file")
    p.add_argument("--atol", type=float, default=0.0, help="ignore changes up to this size")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    for register in _extensions():
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the CLI and return its exit code (see the module docstring)."""
    out = out or _printable(sys.stdout)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) and EXIT_USAGE
    try:
        result: Any = args.func(args, out)
        return int(result)
    except BrokenPipeError:
        # `weightvault inspect f | head` closed our stdout: not an error of ours.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return EXIT_OK
    except (WeightvaultError, OSError) as e:
        _error(args.command, str(e))
        return EXIT_UNREADABLE
    except KeyboardInterrupt:
        _error(args.command, "interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        # Hostile input must not end in a traceback: one line, a documented code, and
        # the traceback only for someone debugging.
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            traceback.print_exc()
        detail = " ".join(str(e)[:300].split())
        _error(
            args.command,
            f"unexpected {type(e).__name__}: {detail} (set {DEBUG_ENV}=1 to see the "
            "traceback, and please report it)",
        )
        return EXIT_UNEXPECTED


def _printable(stream: TextIO) -> TextIO:
    """``stream``, set to escape what its encoding cannot show instead of raising."""
    if isinstance(stream, io.TextIOWrapper):
        with contextlib.suppress(ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")
    return stream


def _error(command: str, message: str) -> None:
    line = f"weightvault {command}: {message}\n"
    with contextlib.suppress(OSError):
        try:
            sys.stderr.write(line)
        except UnicodeEncodeError:
            # The terminal's encoding cannot show a name in the message: escape it.
            sys.stderr.write(line.encode("ascii", "backslashreplace").decode("ascii"))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
