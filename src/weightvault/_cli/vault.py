"""``weightvault vault ROOT COMMAND``: look after a vault from the shell."""

from __future__ import annotations

import argparse
import datetime as dt
import os
from dataclasses import asdict
from typing import Any, TextIO

from .._base.errors import VaultNotFoundError
from .._base.progress import Progress, human
from .._tools.inspect import diff
from .._vault.records.names import LABELS
from .._vault.records.usage import vault_usage
from .._vault.store.backend import open_store
from .._vault.travel.transfer import TransferReport
from .._vault.vault import Vault
from .common import (
    EXIT_FAILED,
    EXIT_OK,
    Subparsers,
    add_command,
    print_json,
    report_check,
    report_diff,
    table,
    tolerance,
)
from .describe import describe, show
from .log import DERIVED, RAW, log_doc, marked, notes, summary, times
from .plot import plot

EPILOG = """\
ROOT is a folder or an fsspec URL (s3://bucket/run1; credentials and endpoint come from
the usual AWS_* environment variables).

examples:
  weightvault vault runs/ft log
  weightvault vault runs/ft show                 # the newest checkpoint
  weightvault vault runs/ft show 000003 --json
  weightvault vault runs/ft diff 000002 000003
  weightvault vault runs/ft verify
  weightvault vault runs/ft export latest model.safetensors
  weightvault vault runs/ft rm 000001 && weightvault vault runs/ft gc
  weightvault vault runs/ft gc --break-lock      # after a gc was killed
  weightvault vault runs/ft plot -o bytes.png
  weightvault vault runs/ft push s3://bucket/ft   # send what the other vault lacks
  weightvault vault runs/eval pull s3://bucket/ft latest
"""


#: Metadata values longer than this are cut in ``log``'s table (``--json`` has them whole).
META_CHARS = 40


def _short(value: str) -> str:
    """``value`` on one line, cut to :data:`META_CHARS` characters."""
    flat = " ".join(value.split())
    return flat if len(flat) <= META_CHARS else flat[: META_CHARS - 3] + "..."


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def holds_vault(root: str) -> bool:
    """Whether ``root`` (a folder or an fsspec URL) holds a vault, checked without
    creating anything: a mistyped path must not become an empty vault."""
    if "://" not in root or root.startswith("file://"):
        return os.path.isfile(os.path.join(root.removeprefix("file://"), "vault.json"))
    return open_store(root).exists("vault.json")


def _vault(args: argparse.Namespace) -> Vault:
    """The vault at ``args.root``; every verb reads an existing vault, none creates one.

    Raises:
        VaultNotFoundError: ``args.root`` holds no vault (exit code 3).
    """
    if not holds_vault(args.root):
        raise VaultNotFoundError(
            f"{args.root}: no vault here (no vault.json); check the path, or create a vault "
            "by saving into it: weightvault.Vault(path).save(model)"
        )
    return Vault(args.root)


def cmd_log(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    use = vault_usage(vault.store)
    marks = vault.marks()
    if args.json:
        print_json(log_doc(use, marks), out)
        return EXIT_OK
    if not use.records:
        out.write(f"{args.root}: no checkpoints yet\n")
        return EXIT_OK
    held = marked(marks)
    rows = [["checkpoint", "created", "raw", "new", "on disk", "disk/raw", "metadata"]]
    if held:  # the column only where a checkpoint is marked
        rows[0].insert(6, "mark")
    for r, c in zip(use.records, use.checkpoints, strict=True):
        meta = " ".join(f"{k}={_short(v)}" for k, v in r.metadata.items())
        disk = human(c.disk_bytes) + ("" if c.recorded else DERIVED) + ("" if c.compacted else RAW)
        rows.append(
            [r.name, _when(r.created), human(c.raw_bytes), human(c.new_bytes), disk,
             times(c.ratio) if c.ratio is not None else "-", meta]
        )  # fmt: skip
        if held:
            rows[-1].insert(6, ",".join(held.get(r.name, [])) or "-")
    table(rows, out)
    for mark, note in notes(use.checkpoints):
        out.write(f"{mark} {note}\n")
    out.write(f"\n{summary(use)}\n")
    return EXIT_OK


def cmd_mark(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    was = vault.marks().get(args.label)
    if args.remove:
        now = None
        vault.unmark(args.label)
    elif args.name is None:
        now = was  # show it
    else:
        vault.mark(args.name, args.label)
        now = vault.resolve(args.label)
    if args.json:
        print_json({"label": args.label, "checkpoint": now, "before": was}, out)
    elif args.remove:
        out.write(f"{args.label!r} is on no checkpoint now" + (f" (was {was})\n" if was else "\n"))
    elif args.name is None:
        out.write(f"{args.label}: {now}\n" if now else f"no checkpoint is marked {args.label!r}\n")
    else:
        out.write(
            f"marked {now} {args.label!r}" + (f" (was {was})\n" if was and was != now else "\n")
        )
    return EXIT_OK


def cmd_show(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    with vault.open(args.name) as ckpt:
        info, training = describe(ckpt)
        record = ckpt.record
    use = vault_usage(vault.store)
    c = next(c for c in use.checkpoints if c.name == record.name)
    # As in log: a record without written_bytes had its objects written raw.
    state = "" if c.compacted else ", not compacted yet"
    heading = (
        f"{record.name}: created {_when(record.created)}, {len(info.names)} names, "
        f"new bytes {human(record.new_bytes)} ({human(c.disk_bytes)} on disk{state})"
    )
    show(info, training, heading, out, as_json=args.json, extra={"record": asdict(record)})
    return EXIT_OK


def cmd_diff(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    with vault.open(args.a) as a, vault.open(args.b) as b:
        report = diff(a, b)
        # The checkpoints by name ('latest' resolved), not by their records' paths.
        report.a, report.b = a.record.name, b.record.name
        return report_diff(report, args.atol, args.json, out)


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    from .._base.errors import ChecksumError
    from .._vault.upkeep.verify import verify_vault

    try:
        vault: Vault | None = _vault(args)
    except ChecksumError:
        vault = None  # vault.json is damaged: the report says so, and checks the rest
    bar = Progress(vault.disk_bytes() if vault is not None else 0, "verifying")
    if vault is not None:
        report = vault.verify(progress=bar)
    else:
        report = verify_vault(open_store(args.root), progress=bar)
    bar.close()
    summary = f"{report.checkpoints} checkpoints, {report.objects} objects"
    code = report_check(report, args.root, summary, args.json, out)
    if not args.json:
        for note in report.notes:
            out.write(f"  note: {note}\n")
    return code


def cmd_gc(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    broken = vault.break_gc_lock() if args.break_lock else []
    before = vault.disk_bytes()
    freed = vault.gc()
    if args.json:
        doc = {"freed_bytes": freed, "disk_bytes": before - freed}
        print_json({**doc, "broken_locks": broken} if args.break_lock else doc, out)
    else:
        for key in broken:
            out.write(f"removed {key}, the marker of a gc that died\n")
        out.write(f"freed {human(freed)}; vault now {human(before - freed)}\n")
    return EXIT_OK


def cmd_compact(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    report = vault.compact()
    if args.json:
        print_json(asdict(report), out)
        return EXIT_OK
    for line in report.damaged:
        out.write(f"left as it is, damaged: {line}\n")
    if report.busy:
        out.write("another process is compacting this vault; it does the rest\n")
    elif not report.checkpoints:
        out.write("nothing to compact\n")
    else:
        n, full = len(report.checkpoints), report.full
        out.write(
            f"compacted {n} checkpoint{'s' if n != 1 else ''}: {full} object"
            f"{'s' if full != 1 else ''} compressed, {report.deltas} turned into deltas; "
            f"{human(report.bytes_before)} on disk before, {human(report.bytes_after)} after"
            + (f"; {report.unpacked} taken out of packs" if report.unpacked else "")
            + "\n"
        )
    return EXIT_OK if not report.damaged else EXIT_FAILED


def cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    size = vault.export(args.name, args.file, dedupe_copies=args.dedupe_copies)
    if args.json:
        print_json({"file": args.file, "bytes": size}, out)
    else:
        out.write(f"wrote {args.file} ({human(size)}), a standalone safetensors file\n")
    return EXIT_OK


def cmd_rm(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    for name in args.names:
        vault.delete(name)
    if args.json:
        print_json({"deleted": args.names}, out)
    else:
        out.write(
            f"deleted {', '.join(args.names)}; 'gc' frees the bytes no other checkpoint shares\n"
        )
    return EXIT_OK


def _moved(report: TransferReport, verb: str, other: str, as_json: bool, out: TextIO) -> int:
    """Print a push's or pull's report (or the report as JSON)."""
    if as_json:
        print_json(asdict(report), out)
        return EXIT_OK
    n, new = len(report.checkpoints), len(report.committed)
    out.write(
        f"{verb} {n} checkpoint{'s' if n != 1 else ''} {other} ({new} new): "
        f"{report.objects_sent} object{'s' if report.objects_sent != 1 else ''}, "
        f"{human(report.bytes_sent)} sent, {human(report.bytes_skipped)} already there"
        + (f", {report.whole} sent whole" if report.whole else "")
        + "\n"
    )
    return EXIT_OK


def cmd_push(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    report = vault.push(args.other, args.names or None, progress=True)
    return _moved(report, "pushed", f"to {args.other}", args.json, out)


def cmd_pull(args: argparse.Namespace, out: TextIO) -> int:
    # The receiver may not exist yet: a pull into a new path makes it a vault.
    report = Vault(args.root).pull(args.other, args.names or None, progress=True)
    return _moved(report, "pulled", f"from {args.other}", args.json, out)


def cmd_plot(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    drawn = plot(vault, args.output)
    if args.json:
        print_json(drawn.as_dict(), out)
    else:
        out.write(
            f"wrote {drawn.file}: {len(drawn.points)} checkpoints (x axis: {drawn.x}); "
            f"{human(drawn.files_bytes)} as separate files, {human(drawn.vault_bytes)} in the "
            f"vault uncompressed, {human(drawn.disk_bytes)} written on disk"
            + (f" ({drawn.ratio:.1f}x smaller)\n" if drawn.ratio > 1 else "\n")
        )
    return EXIT_OK


def register(sub: Subparsers) -> None:
    """Add ``weightvault vault ROOT ...`` to the CLI."""
    vault = add_command(
        sub,
        "vault",
        lambda args, out: args.vault_func(args, out),
        "Inspect and maintain a vault (a checkpoint store that keeps each distinct tensor once).",
        EPILOG,
    )
    vault.add_argument("root", metavar="ROOT", help="the vault: a folder or an fsspec URL")
    verbs = vault.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, func: Any, help: str) -> argparse.ArgumentParser:
        p = verbs.add_parser(name, help=help, description=help)
        p.set_defaults(vault_func=func)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    verb(
        "log",
        cmd_log,
        "List checkpoints, oldest first, with each one's raw bytes, what its new objects "
        "take on disk (marked ~ until compacted), and the vault's total.",
    )
    p = verb(
        "mark",
        cmd_mark,
        "Label a checkpoint 'best' (the label moves: the checkpoint that held it loses "
        "it), so that reads take 'best' for it (show best, export best, "
        "Vault.load(model, 'best')) and retention by count keeps it; 'rm NAME' still "
        "deletes it. Without NAME, print the checkpoint that holds the label.",
    )
    p.add_argument(
        "--label", default="best", choices=list(LABELS), help="the label (default: best)"
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("name", nargs="?", help="the checkpoint to mark, or 'latest'")
    which.add_argument("--remove", action="store_true", help="take the label off instead")
    p = verb("show", cmd_show, "List the tensors of one checkpoint (by default the newest).")
    p.add_argument("name", nargs="?", default="latest", help="a checkpoint, 'latest' or 'best'")
    p = verb("diff", cmd_diff, "Compare two checkpoints name by name; exit 1 if they differ.")
    p.add_argument("a", help="the first checkpoint")
    p.add_argument("b", help="the second checkpoint ('latest' for the newest)")
    p.add_argument("--atol", type=tolerance, default=0.0, help="ignore changes up to this size")
    verb("verify", cmd_verify, "Check every record and every object's hash; exit 1 if damaged.")
    p = verb("gc", cmd_gc, "Delete objects that no checkpoint references; print the bytes freed.")
    p.add_argument(
        "--break-lock",
        action="store_true",
        help="first remove the markers of gcs that died (refused while one may be running)",
    )
    verb(
        "compact",
        cmd_compact,
        "Compress what saves wrote raw, and turn older checkpoints' changed weights into "
        "deltas on their anchors (the newest stays whole); exit 1 if a damaged object was "
        "found.",
    )
    p = verb("export", cmd_export, "Write one checkpoint as a standalone safetensors file.")
    p.add_argument("name", help="the checkpoint, or 'latest'")
    p.add_argument("file", help="the safetensors file to write")
    p.add_argument(
        "--dedupe-copies",
        action="store_true",
        help="store tensors with equal bytes once, as the vault does (plain safetensors "
        "readers then miss the copies' names)",
    )
    p = verb("rm", cmd_rm, "Delete checkpoints (their bytes are freed by the next gc).")
    p.add_argument("names", nargs="+", help="checkpoints to delete ('latest' is refused)")
    p = verb(
        "plot",
        cmd_plot,
        "Draw bytes on disk, vault versus separate files: cumulative, and per checkpoint "
        "raw against written.",
    )
    p.add_argument("-o", "--output", default="vault-bytes.png", help="PNG file to write")
    p = verb(
        "push",
        cmd_push,
        "Send checkpoints to another vault (made if the path is empty), with only the "
        "objects it lacks, as they are stored here.",
    )
    p.add_argument("other", metavar="DEST", help="the receiving vault: a folder or a URL")
    p.add_argument("names", nargs="*", help="checkpoints to send (default: all)")
    p = verb(
        "pull",
        cmd_pull,
        "Fetch checkpoints from another vault into ROOT (made if the path is empty), with "
        "only the objects ROOT lacks.",
    )
    p.add_argument("other", metavar="SRC", help="the sending vault: a folder or a URL")
    p.add_argument("names", nargs="*", help="checkpoints to fetch (default: all)")
