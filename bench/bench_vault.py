"""Vault benchmark: GPT-2 fine-tuning checkpoints, vault versus separate safetensors files.

The workload is GPT-2 small with every block frozen except the last block and ``ln_f``,
saved as 10 checkpoints, each after one AdamW step. For each checkpoint the vault save
and a ``safetensors.torch.save_model`` of the same model into its own file (fsynced, as
the vault is) run back to back, alternating which goes first. Then loads of checkpoints
alternate with ``safetensors.torch.load_model`` of the matching file.

Reported: disk against the ideal (one full copy plus 9x the trainable bytes) and against
10 separate files; the median save time of checkpoints 2-10 against safetensors; load
time (with and without hash verification) against safetensors. Everything runs for a
local folder and, unless ``--no-s3``, for an S3-compatible server (moto) on 127.0.0.1.

    .venv/bin/python bench/bench_vault.py            # full size, local + loopback S3
    .venv/bin/python bench/bench_vault.py --quick    # a 2-layer GPT-2, for smoke runs

``--incremental`` instead times one incremental save on its own: a GPT-2 of 6 layers x
512 wide with only its last block and ``ln_f`` trainable, one AdamW step (untimed) before
each vault save, against ``save_model`` into a new file, in alternating rounds, once with
fsync for everyone and once with ``os.fsync`` a no-op for everyone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import safetensors.torch as st
import torch
from _common import (
    MiB,
    build_model,
    drop_file_cache,
    fsync_dir,
    fsync_path,
    machine,
    med,
    no_fsync,
    quiesce,
    run_rounds,
    table,
    timed,
)

import weightvault
import weightvault.torch as wv


def trainable_setup(model: torch.nn.Module) -> torch.optim.Optimizer:
    last = model.config.n_layer - 1
    wv.freeze(model)
    wv.unfreeze(model, f"transformer.h.{last}.*", "transformer.ln_f.*")
    return torch.optim.AdamW(wv.trainable(model), lr=1e-4, weight_decay=0.1)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, model.config.vocab_size, (1, 16), generator=g)
    model(batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()


def run(label: str, vault: weightvault.Vault, files_dir: str, quick: bool, rounds: int) -> dict:
    model = build_model(quick)
    opt = trainable_setup(model)
    trainable_bytes = sum(p.numel() * p.element_size() for p in wv.trainable(model))
    vault_times, st_times, files = [], [], []
    for i in range(1, 11):
        step(model, opt, seed=i)
        path = os.path.join(files_dir, f"ckpt{i:02d}.safetensors")

        def save_st(path: str = path) -> None:
            st.save_model(model, path)
            fsync_path(path)
            fsync_dir(files_dir)

        order = [("vault", lambda: vault.save(model)), ("st", save_st)]
        if i % 2:
            order.reverse()
        for who, fn in order:
            quiesce()
            t = timed(fn)
            (vault_times if who == "vault" else st_times).append(t)
        files.append(path)
        print(
            f"  [{label}] checkpoint {i:2d}: vault {vault_times[-1]:.3f} s, "
            f"safetensors {st_times[-1]:.3f} s",
            flush=True,
        )

    records = vault.list()
    first_full = records[0].stored_bytes
    ideal = first_full + 9 * trainable_bytes
    disk = vault.disk_bytes()
    separate = sum(os.path.getsize(f) for f in files)

    fresh = build_model(quick, seed=1)
    names = [records[0].name, records[4].name, records[-1].name]
    load_v, load_v_noverify, load_st = [], [], []
    for r in range(rounds):
        for k, name in enumerate(names):
            file = files[[0, 4, 9][k]]
            contenders = [
                ("v", lambda name=name: vault.load(fresh, name)),
                ("vn", lambda name=name: vault.load(fresh, name, verify=False)),
                ("st", lambda file=file: st.load_model(fresh, file)),
            ]
            shift = (r + k) % 3
            for who, fn in contenders[shift:] + contenders[:shift]:
                quiesce()
                t = timed(fn)
                {"v": load_v, "vn": load_v_noverify, "st": load_st}[who].append(t)
    # Cold page cache (local only): the objects and the file are evicted before each load.
    cold_v: list[float] = []
    cold_st: list[float] = []
    root = vault.store.local_path("objects")
    if root is not None:
        objects = [os.path.join(f, n) for f, _, ns in os.walk(root) for n in ns]
        for r in range(rounds):
            pair = [
                ("v", lambda: vault.load(fresh, names[-1]), objects),
                ("st", lambda: st.load_model(fresh, files[9]), [files[9]]),
            ]
            for who, fn, evict in pair if r % 2 == 0 else pair[::-1]:
                for path in evict:
                    drop_file_cache(path)
                t = timed(fn)
                (cold_v if who == "v" else cold_st).append(t)
    # Fetching the bytes alone (no hashing, no copying): the store's own limit.
    fetch = [timed(lambda: vault.open(names[-1]).close()) for _ in range(rounds)]
    # The model must come back exactly, whichever checkpoint.
    vault.load(fresh, records[-1].name)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), n

    return {
        "label": label,
        "trainable_bytes": trainable_bytes,
        "first_checkpoint_bytes": first_full,
        "ideal_bytes": ideal,
        "vault_disk_bytes": disk,
        "disk_vs_ideal": disk / ideal,
        "separate_files_bytes": separate,
        "separate_vs_vault": separate / disk,
        "save_vault_first_s": vault_times[0],
        "save_vault_2_10_median_s": med(vault_times[1:]),
        "save_st_median_s": med(st_times),
        "save_ratio_2_10": med(vault_times[1:]) / med(st_times),
        "load_vault_median_s": med(load_v),
        "load_vault_noverify_median_s": med(load_v_noverify),
        "load_st_median_s": med(load_st),
        "load_ratio": med(load_v) / med(load_st),
        "load_ratio_noverify": med(load_v_noverify) / med(load_st),
        "open_fetch_median_s": med(fetch),
        "cold_load_vault_median_s": med(cold_v) if cold_v else None,
        "cold_load_st_median_s": med(cold_st) if cold_st else None,
    }


def incremental(rounds: int, warmup: int) -> dict:
    """Incremental vault saves of GPT-2 6 x 512 (last block trainable) against save_model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=512, n_head=8)).eval()
    opt = trainable_setup(model)
    trainable_bytes = sum(p.numel() * p.element_size() for p in wv.trainable(model))
    tmp = tempfile.mkdtemp(prefix="wv-bench-incremental-")
    out: dict = {"trainable_bytes": trainable_bytes}
    try:
        vault = weightvault.Vault(os.path.join(tmp, "vault"))
        out["stored_bytes"] = vault.save(model).stored_bytes  # the full first checkpoint
        path = os.path.join(tmp, "model.safetensors")
        seed = iter(range(1, 1 << 30))
        new_bytes: list[int] = []

        def save_st() -> None:
            st.save_model(model, path)
            fsync_path(path)  # a no-op, like the vault's, under no_fsync()

        def before(who: str) -> None:
            if who == "vault":
                step(model, opt, next(seed))  # the optimizer changes the last block
            elif os.path.exists(path):
                os.unlink(path)  # every save_model writes a new file

        contenders = {"vault": lambda: new_bytes.append(vault.save(model).new_bytes), "st": save_st}
        for mode in ("fsync", "no_fsync"):
            if mode == "fsync":
                samples = run_rounds(contenders, rounds=rounds, warmup=warmup, before=before)
            else:
                with no_fsync():
                    samples = run_rounds(contenders, rounds=rounds, warmup=warmup, before=before)
            v, s = samples["vault"], samples["st"]
            out[mode] = {
                "vault_s": v,
                "st_s": s,
                "ratio_median": med(v) / med(s),
                "ratio_min": min(v) / min(s),
            }
        out["new_bytes_median"] = med([float(b) for b in new_bytes])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def print_incremental(r: dict) -> None:
    print(
        f"GPT-2 6 x 512: {r['stored_bytes'] / MiB:.1f} MiB stored, "
        f"{r['trainable_bytes'] / MiB:.1f} MiB trainable, "
        f"{r['new_bytes_median'] / MiB:.1f} MiB new per incremental save"
    )
    rows = []
    for mode in ("fsync", "no_fsync"):
        v, s = r[mode]["vault_s"], r[mode]["st_s"]
        rows.append(
            [
                mode,
                f"{med(v):.3f} ({min(v):.3f}-{max(v):.3f})",
                f"{med(s):.3f} ({min(s):.3f}-{max(s):.3f})",
                f"{r[mode]['ratio_median']:.2f}x",
                f"{r[mode]['ratio_min']:.2f}x",
            ]
        )
    print(
        table(
            rows,
            [
                "durability",
                "vault incremental s, median (min-max)",
                "save_model s, median (min-max)",
                "ratio of medians",
                "ratio of minimums",
            ],
        )
    )


def s3_vault() -> tuple[weightvault.Vault, subprocess.Popen[bytes]]:
    """A vault on an S3-compatible server (moto) in its own process on 127.0.0.1."""
    import s3fs

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except urllib.error.HTTPError:
            break  # the server answered
        except OSError:
            time.sleep(0.05)
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    options = {"client_kwargs": {"endpoint_url": url}}
    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("bench-vault")
    return weightvault.Vault("s3://bench-vault/run", **options), server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="load rounds per checkpoint")
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--incremental", action="store_true", help="only the incremental-save comparison"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (--incremental)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    if args.incremental:
        r = incremental(args.rounds, args.warmup)
        print("machine:", json.dumps(machine()))
        print_incremental(r)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": machine(), "incremental": r}, f, indent=2)
        return

    results = []
    tmp = tempfile.mkdtemp(prefix="wv-bench-vault-")
    try:
        files = os.path.join(tmp, "files")
        os.makedirs(files)
        results.append(
            run(
                "local",
                weightvault.Vault(os.path.join(tmp, "vault")),
                files,
                args.quick,
                args.rounds,
            )
        )
        if not args.no_s3:
            shutil.rmtree(files)
            os.makedirs(files)
            vault, server = s3_vault()
            try:
                results.append(run("s3 (moto, loopback)", vault, files, args.quick, args.rounds))
            finally:
                server.terminate()
                server.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print("\nmachine:", json.dumps(machine()))
    rows = []
    for r in results:
        rows.append(
            [
                r["label"],
                f"{r['vault_disk_bytes'] / MiB:.1f}",
                f"{r['ideal_bytes'] / MiB:.1f}",
                f"{r['disk_vs_ideal']:.3f}",
                f"{r['separate_files_bytes'] / MiB:.1f}",
                f"{r['separate_vs_vault']:.2f}x",
            ]
        )
    print(
        table(
            rows, ["store", "vault MiB", "ideal MiB", "vault/ideal", "10 files MiB", "files/vault"]
        )
    )
    rows = []
    for r in results:
        rows.append(
            [
                r["label"],
                f"{r['save_vault_first_s']:.3f}",
                f"{r['save_vault_2_10_median_s']:.3f}",
                f"{r['save_st_median_s']:.3f}",
                f"{r['save_ratio_2_10']:.2f}x",
            ]
        )
    print()
    print(
        table(
            rows,
            [
                "store",
                "vault save #1 s",
                "vault saves 2-10 median s",
                "safetensors save_model s",
                "ratio 2-10",
            ],
        )
    )
    rows = []
    for r in results:
        rows.append(
            [
                r["label"],
                f"{r['load_vault_median_s']:.3f}",
                f"{r['load_vault_noverify_median_s']:.3f}",
                f"{r['load_st_median_s']:.3f}",
                f"{r['load_ratio']:.2f}x",
                f"{r['load_ratio_noverify']:.2f}x",
                f"{r['open_fetch_median_s']:.3f}",
            ]
        )
    print()
    print(
        table(
            rows,
            [
                "store",
                "vault load s (verify)",
                "vault load s (no verify)",
                "safetensors load_model s",
                "ratio",
                "ratio no verify",
                "open+fetch only s",
            ],
        )
    )
    for r in results:
        if r["cold_load_vault_median_s"] is not None:
            v, t = r["cold_load_vault_median_s"], r["cold_load_st_median_s"]
            print(
                f"\n{r['label']}, cold page cache: vault load (verify) {v:.3f} s, "
                f"safetensors load_model {t:.3f} s, ratio {v / t:.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
