"""The ``weightvault`` command line: inspect, verify, diff (and, from other modules,
convert and vault) checkpoint files.

Exit codes: one meaning each, listed in :data:`.common.EXIT_CODES`, which
``weightvault --help`` prints and docs/cli.md repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from .. import __version__
from .._base.errors import FormatError, WeightvaultError
from .._base.progress import Progress
from .._tools.inspect import diff, inspect, verify
from ..formats._registry import opened
from .common import (
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNEXPECTED,
    EXIT_USAGE,
    Subparsers,
    add_command,
    exit_code,
    not_a_vault,
    report_check,
    report_diff,
    tolerance,
)
from .describe import kind_of, show, training_state

#: Set to 1 to let an unexpected error show its traceback.
DEBUG_ENV = "WEIGHTVAULT_DEBUG"
EXIT_TABLE = "\n".join(
    textwrap.fill(meaning, 78, initial_indent=f"  {code:<4}", subsequent_indent=" " * 6)
    for code, meaning in EXIT_CODES.items()
)

EPILOG = f"""\
exit codes:
{EXIT_TABLE}
  verify reports a file that is not a valid checkpoint as damage (1), not as 3.

Every command takes --json and then prints one JSON document on standard output.

examples:
  weightvault inspect model.safetensors
  weightvault inspect model.safetensors --json | jq .aliases
  weightvault verify model.safetensors
  weightvault diff step100.safetensors step200.safetensors
  weightvault convert model.params model.safetensors --dedupe-copies
  weightvault vault runs/ft log            (see: weightvault vault --help)
"""


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    with opened(not_a_vault(args.file)) as ckpt:
        info, training = inspect(ckpt), training_state(ckpt)
    stored = len(info.stored) - len(training.tensors)
    heading = f"{info.path}: {kind_of(info)}, {len(info.names)} names, {stored} stored"
    show(info, training, heading, out, as_json=args.json)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    with open(not_a_vault(args.file), "rb"):
        pass  # an unreadable path is exit 3, not "damaged"
    try:
        total = inspect(args.file).stored_bytes
    except (FormatError, OSError):
        total = 0
    bar = Progress(total, "verifying")
    report = verify(args.file, progress=bar)
    bar.close()
    note = "" if report.has_checksums else " (no checksums recorded: structure only)"
    if report.has_checksums and not report.has_header_sum:
        note = " (no header sum: written before header checksums, the header is unchecked)"
    return report_check(
        report, report.path, f"{report.checked} tensors checked{note}", args.json, out
    )


def cmd_diff(args: argparse.Namespace, out: TextIO) -> int:
    return report_diff(diff(not_a_vault(args.a), not_a_vault(args.b)), args.atol, args.json, out)


def _extensions() -> list[Callable[[Subparsers], None]]:
    """Subcommands that live in their own modules; each registers itself on ``sub``."""
    from . import convert as _cli_convert, vault as _cli_vault

    return [_cli_convert.register, _cli_vault.register]


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
    q = add(
        "verify",
        cmd_verify,
        "Check the file's structure and every tensor's checksum; exit 1 naming each "
        "damaged tensor.",
        "example:\n  weightvault verify model.safetensors && echo intact",
    )
    for one_file in (p, q):
        one_file.add_argument("file", help="a weightvault, safetensors or foreign file")
        one_file.add_argument("--json", action="store_true", help="machine-readable output")

    p = add(
        "diff",
        cmd_diff,
        "List names removed (-), added (+) and changed (~, with the max abs difference) "
        "from A to B; exit 1 if they differ.",
        "example:\n  weightvault diff step100.safetensors step200.safetensors --atol 1e-6",
    )
    p.add_argument("a", help="the first file")
    p.add_argument("b", help="the second file")
    p.add_argument("--atol", type=tolerance, default=0.0, help="ignore changes up to this size")
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
    # Errors name the whole command, as in "weightvault vault log: ...".
    command = " ".join(filter(None, [args.command, getattr(args, "verb", None)]))
    try:
        result: Any = args.func(args, out)
        return int(result)
    except BrokenPipeError:
        # `weightvault inspect f | head` closed our stdout: not an error of ours.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return EXIT_OK
    except (WeightvaultError, OSError) as e:
        _error(command, as_given(str(e), args))
        return exit_code(e)
    except KeyboardInterrupt:
        _error(command, "interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:
        # Hostile input must not end in a traceback: one line, a documented code, and
        # the traceback only for someone debugging.
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            traceback.print_exc()
        detail = " ".join(str(e)[:300].split())
        _error(
            command,
            f"unexpected {type(e).__name__}: {detail} (set {DEBUG_ENV}=1 to see the "
            "traceback, and please report it)",
        )
        return EXIT_UNEXPECTED


def as_given(message: str, args: argparse.Namespace) -> str:
    """``message`` with a local vault's absolute path written as the user typed it."""
    root = getattr(args, "root", None)
    if not isinstance(root, str) or "://" in root:
        return message
    return message.replace(os.path.abspath(root), root)


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
