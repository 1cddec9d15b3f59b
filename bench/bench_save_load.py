"""Save/load benchmark: weightvault vs safetensors vs torch.save vs a raw write.

GPT-2 small (124M parameters, tied embedding, random weights from ``GPT2Config()``
defaults, nothing downloaded) in one process. Contenders alternate within every round
(the first one rotates) and medians are reported.

* Saves are timed twice: with fsync (primary: weightvault always fsyncs the file and its
  folder, so every other contender gets ``os.fsync`` on its file and folder too), and
  with ``os.fsync`` patched to a no-op for everyone (page-cache only; this shows the
  CPU-side cost without disk noise). Every save writes a fresh file (the previous one is
  unlinked outside the timing) after an ``os.sync()``.
* Loads are timed warm (the file is in the page cache) and cold (``posix_fadvise
  DONTNEED`` on the file first). The target model's parameters are reset to their
  original, already-touched tensors before every load.
* Peak extra RSS is measured in a fresh subprocess per contender: ``VmHWM`` is reset via
  ``/proc/self/clear_refs`` right before the call, and the peak minus the RSS just
  before is reported.

Usage:
    python bench/bench_save_load.py [--quick] [--rounds 5] [--warmup 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C
import safetensors.torch as st
import torch

import weightvault.torch as wv

SAVE_FILES = {
    "weightvault": "wv.safetensors",
    "weightvault checksum=False": "wv-nock.safetensors",
    "safetensors.save_model": "st.safetensors",
    "torch.save(state_dict)": "torch.pt",
    "raw os.write (limit)": "raw.bin",
}


def write_all(fd: int, data: memoryview) -> None:
    while data.nbytes:
        data = data[os.write(fd, data) :]


def save_fns(
    model: torch.nn.Module, uniq: list[memoryview], folder: str
) -> dict[str, Callable[[], Any]]:
    p = {k: os.path.join(folder, v) for k, v in SAVE_FILES.items()}

    def st_save() -> None:
        st.save_model(model, p["safetensors.save_model"])
        C.fsync_path(p["safetensors.save_model"])

    def torch_save() -> None:
        torch.save(model.state_dict(), p["torch.save(state_dict)"])
        C.fsync_path(p["torch.save(state_dict)"])

    def raw() -> None:
        fd = os.open(p["raw os.write (limit)"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for mv in uniq:
                write_all(fd, mv)
            os.fsync(fd)
        finally:
            os.close(fd)
        C.fsync_dir(folder)

    return {
        "weightvault": lambda: wv.save(model, p["weightvault"]),
        "weightvault checksum=False": lambda: wv.save(
            model, p["weightvault checksum=False"], checksum=False
        ),
        "safetensors.save_model": st_save,
        "torch.save(state_dict)": torch_save,
        "raw os.write (limit)": raw,
    }


def load_fns(target: torch.nn.Module, folder: str) -> dict[str, Callable[[], Any]]:
    wvp = os.path.join(folder, SAVE_FILES["weightvault"])
    stp = os.path.join(folder, SAVE_FILES["safetensors.save_model"])
    tp = os.path.join(folder, SAVE_FILES["torch.save(state_dict)"])

    def mmap_touch() -> None:
        wv.load(target, wvp, mmap=True)
        with torch.no_grad():
            for prm in target.parameters():
                prm.sum()

    def torch_load() -> None:
        target.load_state_dict(torch.load(tp, mmap=True, weights_only=True))

    return {
        "weightvault load (copy)": lambda: wv.load(target, wvp),
        "weightvault load verify=True": lambda: wv.load(target, wvp, verify=True),
        "weightvault load mmap=True": lambda: wv.load(target, wvp, mmap=True),
        "weightvault mmap=True + read all": mmap_touch,
        "safetensors.load_model": lambda: st.load_model(target, stp),
        "torch.load(mmap)+load_state_dict": torch_load,
    }


def load_paths(folder: str) -> dict[str, str]:
    wvp = os.path.join(folder, SAVE_FILES["weightvault"])
    return {
        "weightvault load (copy)": wvp,
        "weightvault load verify=True": wvp,
        "weightvault load mmap=True": wvp,
        "weightvault mmap=True + read all": wvp,
        "safetensors.load_model": os.path.join(folder, SAVE_FILES["safetensors.save_model"]),
        "torch.load(mmap)+load_state_dict": os.path.join(
            folder, SAVE_FILES["torch.save(state_dict)"]
        ),
    }


def resetter(target: torch.nn.Module) -> Callable[[str], None]:
    """Put the target's original (touched, owned) tensors back before each load."""
    params = dict(target.named_parameters())
    original = {n: p.data for n, p in params.items()}

    def reset(_: str) -> None:
        for n, prm in params.items():
            prm.data = original[n]
        gc.collect()

    return reset


def check_loaded(target: torch.nn.Module, model: torch.nn.Module) -> None:
    ref = model.state_dict()
    for n, t in target.state_dict().items():
        if not torch.equal(t, ref[n]):
            raise SystemExit(f"load produced wrong values for {n}")


# --- peak RSS, one fresh subprocess per contender ---------------------------------------

RSS_MODES = {
    "save weightvault": "save:weightvault",
    "save weightvault checksum=False": "save:weightvault checksum=False",
    "save safetensors.save_model": "save:safetensors.save_model",
    "save torch.save(state_dict)": "save:torch.save(state_dict)",
    "load weightvault (copy)": "load:weightvault load (copy)",
    "load weightvault mmap=True": "load:weightvault load mmap=True",
    "load weightvault mmap=True + read all": "load:weightvault mmap=True + read all",
    "load safetensors.load_model": "load:safetensors.load_model",
    "load torch.load(mmap)+load_state_dict": "load:torch.load(mmap)+load_state_dict",
}


def rss_child(mode: str, folder: str, quick: bool) -> None:
    kind, name = mode.split(":", 1)
    model = C.build_model(quick)
    if kind == "save":
        sub = os.path.join(folder, "rss")
        os.makedirs(sub, exist_ok=True)
        fn = save_fns(model, [], sub)[name]
    else:
        fn = load_fns(model, folder)[name]
    gc.collect()
    anon0 = C.status_kb("RssAnon")
    sampler = C.AnonSampler()
    C.reset_peak_rss()
    before = C.status_kb("VmRSS")
    with sampler:
        fn()
    peak = C.status_kb("VmHWM")
    print(
        json.dumps(
            {
                "before_kb": before,
                "peak_kb": peak,
                "extra_kb": peak - before,
                "extra_anon_kb": sampler.peak_kb - anon0,
            }
        )
    )


def measure_rss(folder: str, quick: bool) -> dict[str, dict[str, int]]:
    out = {}
    for label, mode in RSS_MODES.items():
        cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", mode, "--dir", folder]
        if quick:
            cmd.append("--quick")
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[label] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


# --- report -------------------------------------------------------------------------------


def report(res: dict[str, Any]) -> str:
    unique = res["unique_bytes"]
    lines = []
    m = res["machine"]
    lines.append(
        f"machine: {m['nproc']} CPUs ({m['cpu']}), {m['ram_gib']} GiB RAM, python {m['python']}, "
        f"torch {m['torch']}, safetensors {m.get('safetensors')}, "
        f"transformers {m.get('transformers')}"
    )
    lines.append(
        f"model: {res['model']}, {res['params']:,} parameters, {unique / C.GB:.3f} GB unique "
        f"bytes; {res['rounds']} rounds after {res['warmup']} warm-up; files in {res['dir']}"
    )
    for title, key in (
        ("SAVE, with fsync of file + folder for every contender", "save_fsync"),
        ("SAVE, os.fsync patched to a no-op for everyone (page cache only)", "save_nofsync"),
    ):
        s = res[key]
        st_t = C.med(s["safetensors.save_model"])
        raw_t = C.med(s["raw os.write (limit)"])
        rows = []
        for name, xs in s.items():
            t = C.med(xs)
            size = res["sizes"][name]
            rows.append(
                [
                    name,
                    f"{t:.3f}",
                    C.spread(xs),
                    f"{t / st_t:.2f}x",
                    f"{size / t / C.GB:.2f}",
                    f"{raw_t / t * 100:.0f}%",
                    f"{size / C.MiB:.1f}",
                ]
            )
        lines += ["", title]
        lines.append(
            C.table(
                rows,
                [
                    "contender",
                    "median s",
                    "min-max s",
                    "vs safetensors",
                    "GB/s",
                    "% of raw",
                    "file MiB",
                ],
            )
        )
    for title, key in (
        ("LOAD, warm page cache", "load_warm"),
        ("LOAD, cold (posix_fadvise DONTNEED on the file before each load)", "load_cold"),
    ):
        if key not in res:
            continue
        s = res[key]
        st_t = C.med(s["safetensors.load_model"])
        rows = [
            [name, f"{C.med(xs):.3f}", C.spread(xs), f"{C.med(xs) / st_t:.2f}x"]
            for name, xs in s.items()
        ]
        lines += ["", title]
        lines.append(C.table(rows, ["contender", "median s", "min-max s", "vs safetensors"]))
    if "rss" in res:
        rows = [
            [
                name,
                f"{r['extra_kb'] / 1024:.1f}",
                f"{r['extra_kb'] * 1024 / unique * 100:.1f}%",
                f"{r['extra_anon_kb'] / 1024:.1f}",
                f"{r['before_kb'] / 1024:.0f}",
            ]
            for name, r in res["rss"].items()
        ]
        lines += [
            "",
            "PEAK EXTRA RSS (fresh process each). total: VmHWM after the call - VmRSS before,",
            "includes file pages mapped by mmap; anon: peak RssAnon sampled every 1 ms - before",
        ]
        lines.append(
            C.table(
                rows,
                ["operation", "total MiB", "% of model", "anon MiB", "RSS before MiB"],
            )
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT-2 with n_layer=2 (smoke run)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", metavar="PATH", help="also dump all samples as JSON")
    ap.add_argument(
        "--dir", help="where to write files (default: a new temp dir under $TMPDIR or /tmp)"
    )
    ap.add_argument("--no-cold", action="store_true", help="skip cold-cache loads")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.rss_child:
        rss_child(args.rss_child, args.dir, args.quick)
        return

    folder = tempfile.mkdtemp(prefix="wv-bench-", dir=args.dir)
    try:
        model = C.build_model(args.quick)
        uniq = C.unique_buffers(model)
        res: dict[str, Any] = {
            "machine": C.machine(),
            "model": "gpt2 n_layer=2" if args.quick else "gpt2 (124M)",
            "params": sum(p.numel() for p in model.parameters()),
            "unique_bytes": sum(mv.nbytes for mv in uniq),
            "rounds": args.rounds,
            "warmup": args.warmup,
            "dir": folder,
        }
        saves = save_fns(model, uniq, folder)

        def unlink(name: str) -> None:
            path = os.path.join(folder, SAVE_FILES[name])
            if os.path.exists(path):
                os.unlink(path)

        kw = {"rounds": args.rounds, "warmup": args.warmup}
        print("saves with fsync ...", file=sys.stderr)
        res["save_fsync"] = C.run_rounds(saves, before=unlink, **kw)
        print("saves without fsync ...", file=sys.stderr)
        with C.no_fsync():
            res["save_nofsync"] = C.run_rounds(saves, before=unlink, **kw)
        res["sizes"] = {n: os.path.getsize(os.path.join(folder, f)) for n, f in SAVE_FILES.items()}
        for n in SAVE_FILES:  # every save once more with fsync, so the files are on disk
            if n != "raw os.write (limit)":
                saves[n]()

        target = C.build_model(args.quick, seed=1)
        loads = load_fns(target, folder)
        reset = resetter(target)
        for name, fn in loads.items():
            reset(name)
            fn()
            check_loaded(target, model)
        paths = load_paths(folder)
        print("loads, warm ...", file=sys.stderr)
        res["load_warm"] = C.run_rounds(loads, before=reset, **kw)
        if not args.no_cold:

            def cold(name: str) -> None:
                reset(name)
                C.drop_file_cache(paths[name])

            print("loads, cold ...", file=sys.stderr)
            res["load_cold"] = C.run_rounds(loads, before=cold, **kw)
        reset("")
        del target, loads
        if not args.no_rss:
            print("peak RSS ...", file=sys.stderr)
            res["rss"] = measure_rss(folder, args.quick)
        print(report(res))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
