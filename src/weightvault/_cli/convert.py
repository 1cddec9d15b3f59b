"""``weightvault convert SRC DST``: any supported checkpoint to a deduplicated file."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from .. import rules as _named_rules
from .._base.errors import RuleError
from .._base.progress import human
from .._base.reports import SaveReport
from .._file.checkpoint import Checkpoint
from .._file.layout import is_training
from .._load.rules import Rule, check, explain
from .._tools.convert import convert
from ..formats._registry import opened
from .common import EXIT_OK, EXIT_USAGE, Subparsers, add_command, not_a_vault, print_json

#: How many renames the text output lists before it says how many more there are.
SHOWN_RENAMES = 10

EPILOG = """\
SRC may be an MXNet .params, a torch .pt/.pth/.bin, a Keras .weights.h5, a numpy .npz
or a safetensors file; the format is recognised from its bytes. Every name is kept.
Copies (separate tensors with equal bytes, such as a shared weight an MXNet or Keras
file wrote once per layer) are found by content and written under every name, so plain
safetensors readers see them all; --dedupe-copies stores each once instead, and only
weightvault readers then restore the other names.

--rules takes a JSON file holding a list of [pattern, replacement] pairs ('*' captures,
null drops the name), or the name of a built-in rule set: MXNET_PREFIXES (strip arg:/aux:)
or GLUON_TO_TORCH (gamma/beta -> weight/bias, ...). Every rule of a file must rename or
drop at least one name, and a built-in set at least one in all; otherwise nothing is
written and the exit code is 5. The output lists what the rules renamed and dropped.

examples:
  weightvault convert shared_dense.params dense.safetensors --dedupe-copies
  weightvault convert model-0000.params model.safetensors --rules MXNET_PREFIXES
  weightvault convert pytorch_model.bin model.safetensors --dry-run --json
"""


@dataclass
class Renames:
    """What ``--rules`` did to the source's names."""

    renamed: dict[str, str] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)


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


def plan_renames(ckpt: Checkpoint, rules: list[Rule], spec: str) -> Renames:
    """What ``rules`` do to ``ckpt``'s names, refusing rules that do nothing.

    Each rule of a rules file must match a name (a rule that matches nothing is a typo
    until shown otherwise); a built-in set covers many layer kinds, so it must match at
    least one name in all.

    Raises:
        RuleError: A rule, or the whole built-in set, matches no name of the source.
    """
    out, used = Renames(), set()
    for old, new, index in explain(rules, ckpt.names):
        if index is None:
            continue
        used.add(index)
        if new is None:
            out.dropped.append(old)
        elif new != old:
            out.renamed[old] = new
    builtin = spec.isupper() and isinstance(getattr(_named_rules, spec, None), list)
    unused = [] if builtin and used else [i for i in range(len(rules)) if i not in used]
    if unused:
        pattern, replacement = rules[unused[0]]
        what = f"rule {unused[0]} ({pattern!r} -> {replacement!r})"
        if builtin:
            what = f"built-in rule set {spec}"
        close = difflib.get_close_matches(pattern, ckpt.names, n=1)
        hint = f"; the nearest name is {close[0]!r}" if close else ""
        raise RuleError(
            f"{ckpt.path}: {what} matches no name{hint}, so nothing was written; fix or "
            "remove the rule ('weightvault inspect SRC' lists the names)"
        )
    return out


def cmd_convert(args: argparse.Namespace, out: TextIO) -> int:
    try:
        rules = read_rules(args.rules) if args.rules else []
    except RuleError as e:
        # A malformed --rules argument is a usage error; rules that match nothing are
        # refused later (exit 5), once the source's names are known.
        sys.stderr.write(f"weightvault convert: {e}\n")
        return EXIT_USAGE
    with opened(not_a_vault(args.src)) as ckpt:
        renames = plan_renames(ckpt, rules, args.rules) if rules else Renames()
        report = convert(
            ckpt, args.dst, rules=rules, dry_run=args.dry_run, dedupe_copies=args.dedupe_copies
        )
    before = os.path.getsize(args.src)
    if args.json:
        doc = {"src": args.src, "dst": args.dst, "dry_run": args.dry_run, **asdict(report)}
        doc.update(bytes_before=before, bytes_saved=report.bytes_saved, **asdict(renames))
        print_json(doc, out)
    else:
        print_report(args, report, renames, before, out)
    return EXIT_OK


def print_report(
    args: argparse.Namespace, report: SaveReport, renames: Renames, before: int, out: TextIO
) -> None:
    """The text summary of a conversion: counts, bytes, and what the rules changed."""
    every = [*report.stored, *report.aliases, *report.copies, *report.views]
    state = sum(map(is_training, every))  # optimizer, scheduler and RNG state, kept as is
    names = len(every) - state
    stored = len(report.stored) - sum(map(is_training, report.stored))
    verb = "would write" if args.dry_run else "wrote"
    after = report.file_bytes if not args.dry_run else report.stored_bytes
    if args.dedupe_copies:
        copies = f"{len(report.copies)} copies stored once"
    else:
        kept = [n for n in report.duplicates if not is_training(n)]
        copies = f"{len(kept)} copies kept under their own names"
    out.write(
        f"{args.src} -> {args.dst}: {verb} {names} tensors, {stored} stored; "
        f"{copies}, {len(report.aliases)} aliases, {len(report.views)} views"
        + (f"; and {state} tensors of training state\n" if state else "\n")
    )
    out.write(
        f"bytes before {before} ({human(before)}), after {after} ({human(after)})"
        + (" of tensor data" if args.dry_run else "")
        + f"; deduplication saved {report.bytes_saved} ({human(report.bytes_saved)})\n"
    )
    if any(not is_training(n) for n in report.duplicates):
        extra = report.dedupe_savings
        grew = " (the file is larger than its source)" if after > before else ""
        out.write(f"--dedupe-copies would save {extra} ({human(extra)}) more{grew}\n")
    if args.rules:
        print_renames(renames, out)


def print_renames(renames: Renames, out: TextIO) -> None:
    """Each rename and drop, up to :data:`SHOWN_RENAMES` lines, then a count."""
    out.write(f"rules renamed {len(renames.renamed)} names and dropped {len(renames.dropped)}\n")
    lines = [f"  {old} -> {new}" for old, new in renames.renamed.items()]
    lines += [f"  {old} (dropped)" for old in renames.dropped]
    for line in lines[:SHOWN_RENAMES]:
        out.write(line + "\n")
    if len(lines) > SHOWN_RENAMES:
        out.write(f"  ... and {len(lines) - SHOWN_RENAMES} more (--json lists every one)\n")


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
    p.add_argument(
        "--rules", metavar="RULES", help="a JSON file of rename rules, or a built-in set's name"
    )
    p.add_argument("--dry-run", action="store_true", help="report only; write nothing")
    p.add_argument(
        "--dedupe-copies",
        action="store_true",
        help="store tensors with equal bytes once (plain safetensors readers then miss "
        "the copies' names)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
