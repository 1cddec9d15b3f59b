"""``weightvault convert SRC DST``: any supported checkpoint to a deduplicated file."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from .. import rules as _named_rules
from .._base.errors import RuleError
from .._load.rules import Rule, check
from .._tools.convert import convert
from .common import EXIT_OK, EXIT_USAGE, Subparsers, _size, add_command

EPILOG = """\
SRC may be an MXNet .params, a torch .pt/.pth/.bin, a Keras .weights.h5, a numpy .npz
or a safetensors file; the format is recognised from its bytes. Every name is kept.
Copies (separate tensors with equal bytes, such as a shared weight an MXNet or Keras
file wrote once per layer) are found by content and written under every name, so plain
safetensors readers see them all; --dedupe-copies stores each once instead, and only
weightvault readers then restore the other names.

--rules takes a JSON file holding a list of [pattern, replacement] pairs ('*' captures,
null drops the name), or the name of a built-in rule set: MXNET_PREFIXES (strip arg:/aux:)
or GLUON_TO_TORCH (gamma/beta -> weight/bias, ...).

examples:
  weightvault convert model-0000.params model.safetensors --rules MXNET_PREFIXES
  weightvault convert pytorch_model.bin model.safetensors --dry-run
  weightvault convert shared_dense.params dense.safetensors --dedupe-copies
"""


def read_rules(spec: str) -> list[Rule]:
    """Rules from a built-in set's name or a JSON file of ``[pattern, replacement]`` pairs.

    Raises:
        RuleError: The file is not a JSON list of pairs.
        OSError: The file cannot be read.
    """
    builtin = getattr(_named_rules, spec, None) if spec.isupper() else None
    if isinstance(builtin, list):
        return check(builtin)
    with open(spec, encoding="utf-8") as f:
        try:
            doc: Any = json.load(f)
        except ValueError as e:
            raise RuleError(f"{spec}: the rules file is not valid JSON ({e})") from None
    if not isinstance(doc, list):
        raise RuleError(f"{spec}: the rules file must hold a JSON list of [pattern, replacement]")
    return check([tuple(r) if isinstance(r, list) else r for r in doc])


def cmd_convert(args: argparse.Namespace, out: TextIO) -> int:
    try:
        rules = read_rules(args.rules) if args.rules else []
        report = convert(
            args.src,
            args.dst,
            rules=rules,
            dry_run=args.dry_run,
            dedupe_copies=args.dedupe_copies,
        )
    except RuleError as e:
        sys.stderr.write(f"weightvault convert: {e}\n")
        return EXIT_USAGE
    import os

    before = os.path.getsize(args.src)
    names = len(report.stored) + len(report.aliases) + len(report.copies) + len(report.views)
    verb = "would write" if args.dry_run else "wrote"
    after = report.file_bytes if not args.dry_run else report.stored_bytes
    if args.dedupe_copies:
        copies = f"{len(report.copies)} copies stored once"
    else:
        copies = f"{len(report.duplicates)} copies kept under their own names"
    out.write(
        f"{args.src} -> {args.dst}: {verb} {names} tensors, {len(report.stored)} stored; "
        f"{copies}, {len(report.aliases)} aliases, {len(report.views)} views"
        + (f", {len(report.skipped)} dropped by rules" if report.skipped else "")
        + "\n"
    )
    out.write(
        f"bytes before {before} ({_size(before)}), after {after} ({_size(after)})"
        + (" of tensor data" if args.dry_run else "")
        + f"; deduplication saved {report.bytes_saved} ({_size(report.bytes_saved)})\n"
    )
    if report.duplicates:
        extra = report.dedupe_savings
        out.write(f"--dedupe-copies would save {extra} ({_size(extra)}) more\n")
    return EXIT_OK


def register(sub: Subparsers) -> None:
    """Add ``convert`` to the ``weightvault`` command line."""
    p = add_command(
        sub,
        "convert",
        cmd_convert,
        "Convert an MXNet, torch, Keras, npz or safetensors checkpoint to a weightvault "
        "file that stores every tied tensor once.",
        EPILOG,
    )
    p.add_argument("src", help="the checkpoint to convert (format recognised from its bytes)")
    p.add_argument("dst", help="the weightvault file to write")
    p.add_argument("--rules", metavar="FILE", help="JSON rename rules, or a built-in set name")
    p.add_argument("--dry-run", action="store_true", help="report only; write nothing")
    p.add_argument(
        "--dedupe-copies",
        action="store_true",
        help="store tensors with equal bytes once (plain safetensors readers then miss "
        "the copies' names)",
    )
