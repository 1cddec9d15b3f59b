"""``weightvault vault ROOT COMMAND``: look after a vault from the shell."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from dataclasses import asdict
from typing import Any, TextIO

from .._base.progress import Progress, human
from .._tools.inspect import diff, inspect
from .._vault.vault import Vault
from .common import (
    EXIT_FAILED,
    EXIT_OK,
    Subparsers,
    _table,
    add_command,
    print_inspection,
    report_diff,
)

EPILOG = """\
ROOT is a folder or an fsspec URL (s3://bucket/run1; credentials and endpoint come from
the usual AWS_* environment variables).

examples:
  weightvault vault runs/ft log
  weightvault vault runs/ft show 000003
  weightvault vault runs/ft diff 000002 000003
  weightvault vault runs/ft verify
  weightvault vault runs/ft export latest model.safetensors
  weightvault vault runs/ft rm 000001 && weightvault vault runs/ft gc
  weightvault vault runs/ft gc --break-lock      # after a gc was killed
  weightvault vault runs/ft plot -o bytes.png
"""


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _vault(args: argparse.Namespace) -> Vault:
    return Vault(args.root)


def cmd_log(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    records = vault.list()
    if args.json:
        json.dump([asdict(r) for r in records], out, indent=2)
        out.write("\n")
        return EXIT_OK
    rows = [["checkpoint", "created", "logical", "new bytes", "metadata"]]
    for r in records:
        meta = " ".join(f"{k}={v}" for k, v in r.metadata.items())
        rows.append([r.name, _when(r.created), human(r.logical_bytes), human(r.new_bytes), meta])
    _table(rows, out)
    separate = sum(r.stored_bytes for r in records)
    disk = vault.disk_bytes()
    ratio = f" ({separate / disk:.1f}x smaller)" if disk else ""
    out.write(
        f"\n{len(records)} checkpoints; vault on disk {human(disk)}, as separate files "
        f"{human(separate)}{ratio}\n"
    )
    return EXIT_OK


def cmd_show(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    with vault.open(args.name) as ckpt:
        info = inspect(ckpt)
        record = ckpt.record
    if args.json:
        doc: dict[str, Any] = {"record": asdict(record), "tensors": asdict(info)["tensors"]}
        json.dump(doc, out, indent=2)
        out.write("\n")
        return EXIT_OK
    out.write(
        f"{record.name}: created {_when(record.created)}, {len(info.names)} names, "
        f"new bytes {human(record.new_bytes)}\n\n"
    )
    print_inspection(info, out)
    return EXIT_OK


def cmd_diff(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    with vault.open(args.a) as a, vault.open(args.b) as b:
        return report_diff(diff(a, b), args.atol, args.json, out)


def cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    bar = Progress(vault.disk_bytes(), "verifying")
    report = vault.verify(progress=bar)
    bar.close()
    if args.json:
        json.dump(asdict(report), out, indent=2)
        out.write("\n")
    elif report.ok:
        out.write(f"{vault.url}: OK, {report.checkpoints} checkpoints, {report.objects} objects\n")
    else:
        out.write(f"{vault.url}: DAMAGED\n")
        for p in report.problems:
            out.write(f"  {p}\n")
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_gc(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    broken = vault.break_gc_lock() if args.break_lock else []
    before = vault.disk_bytes()
    freed = vault.gc()
    if args.json:
        doc = {"freed_bytes": freed, "disk_bytes": before - freed}
        json.dump({**doc, "broken_locks": broken} if args.break_lock else doc, out)
        out.write("\n")
    else:
        for key in broken:
            out.write(f"removed {key}, the marker of a gc that died\n")
        out.write(f"freed {human(freed)}; vault now {human(before - freed)}\n")
    return EXIT_OK


def cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    size = vault.export(args.name, args.file, dedupe_copies=args.dedupe_copies)
    if args.json:
        json.dump({"file": args.file, "bytes": size}, out)
        out.write("\n")
    else:
        out.write(f"wrote {args.file} ({human(size)}), a standalone safetensors file\n")
    return EXIT_OK


def cmd_rm(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    for name in args.names:
        vault.delete(name)
    if args.json:
        json.dump({"deleted": args.names}, out)
        out.write("\n")
    else:
        out.write(f"deleted {', '.join(args.names)}; run 'gc' to free their bytes\n")
    return EXIT_OK


def cmd_plot(args: argparse.Namespace, out: TextIO) -> int:
    vault = _vault(args)
    path = plot(vault, args.output)
    out.write(f"wrote {path}\n")
    return EXIT_OK


def plot(vault: Vault, path: str | os.PathLike[str]) -> str:
    """Draw cumulative bytes on disk per checkpoint, vault versus separate files, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = vault.list()
    xs = list(range(1, len(records) + 1))
    vault_total, files_total = [], []
    v = f = 0
    for r in records:
        v += r.new_bytes
        f += r.stored_bytes
        vault_total.append(v / 2**20)
        files_total.append(f / 2**20)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(xs, files_total, marker="o", label="separate safetensors files")
    ax.plot(xs, vault_total, marker="o", label="weightvault vault")
    ax.set_xlabel("checkpoint")
    ax.set_ylabel("cumulative MiB on disk")
    ax.set_title(f"{os.path.basename(vault.url.rstrip('/')) or vault.url}: bytes on disk")
    ax.set_xticks(xs, [r.name for r in records], rotation=45, ha="right", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return os.fspath(path)


def register(sub: Subparsers) -> None:
    """Add ``weightvault vault ROOT ...`` to the CLI."""
    vault = add_command(
        sub,
        "vault",
        lambda args, out: args.vault_func(args, out),
        "Inspect and maintain a vault (a checkpoint store that keeps each distinct tensor once).",
        EPILOG,
    )
    vault.add_argument("root", help="the vault: a folder or an fsspec URL")
    verbs = vault.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, func: Any, help: str) -> argparse.ArgumentParser:
        p = verbs.add_parser(name, help=help, description=help)
        p.set_defaults(vault_func=func)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    verb("log", cmd_log, "List checkpoints, oldest first, with what each one cost.")
    p = verb("show", cmd_show, "List the tensors of one checkpoint ('latest' for the newest).")
    p.add_argument("name")
    p = verb("diff", cmd_diff, "Compare two checkpoints name by name; exit 1 if they differ.")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="ignore changes up to this size")
    verb("verify", cmd_verify, "Check every record and every object's hash; exit 1 if damaged.")
    p = verb("gc", cmd_gc, "Delete objects that no checkpoint references; print the bytes freed.")
    p.add_argument(
        "--break-lock",
        action="store_true",
        help="first remove the markers of gcs that died (refused while one may be running)",
    )
    p = verb("export", cmd_export, "Write one checkpoint as a standalone safetensors file.")
    p.add_argument("name")
    p.add_argument("file")
    p.add_argument(
        "--dedupe-copies",
        action="store_true",
        help="store tensors with equal bytes once, as the vault does (plain safetensors "
        "readers then miss the copies' names)",
    )
    p = verb("rm", cmd_rm, "Delete checkpoints (their bytes are freed by the next gc).")
    p.add_argument("names", nargs="+")
    p = verb("plot", cmd_plot, "Draw cumulative bytes on disk: vault versus separate files.")
    p.add_argument("-o", "--output", default="vault-bytes.png", help="PNG file to write")
