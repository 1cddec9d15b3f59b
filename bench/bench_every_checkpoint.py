"""Every checkpoint of a settled vault, loaded beside plain files: weights only and with the
optimizer, each one's layout (objects read per tensor, deltas) and, for every checkpoint,
the floor its weights' bytes allow (the kernels alone, without weightvault's code).

Setup (``gpt2``): GPT-2 6 x 512 (``GPT2Config(n_layer=6, n_embd=512, n_head=8)``, built
from its config) and AdamW at ``--lr`` (3e-5), 10 checkpoints ``--steps`` (3) training
steps apart on the Python standard library's source read as bytes (``bench/_train_lm.py``,
as ``bench_vault_speed.py`` trains). Each checkpoint is saved into a default ``Vault``
(``optimizer=opt``; its compactor waited for after each save) and as plain files
(``save_model`` + ``torch.save(optimizer.state_dict())``, fsynced); then
``vault.compact()``, settled as the end of training leaves it. ``lm`` does the same with 10
checkpoints of the trained byte-level GPT-2 run of ``bench_compress.py train --dir DIR``
(its lr 1e-3 phase, restored as ``bench_vault_speed.py lm`` restores them).

Then, checkpoint by checkpoint, from the page cache, in one process, the contenders of a
checkpoint alternating in an order that rotates, one warm-up round, medians over
``--rounds``:

- weights only: ``Vault.load(model, name)`` against ``safetensors.torch.load_model``;
- with optimizer: ``Vault.load(model, name, optimizer=opt)`` against ``load_model`` +
  ``opt.load_state_dict(torch.load(path, weights_only=True))``;
- the floor of the checkpoint's weights: every object a load reads, read (``preadv``)
  from the page cache, each delta's blocks decoded by their codec (pcodec or blosc2,
  called directly) and applied to its base's bytes (the frame's transform: XOR, or the
  zigzag difference), block by block on 1 and on 2 threads (the faster counts), as
  ``bench_decode_floor.py`` times its kernels. For a whole checkpoint it is the copy of
  its raw objects (and the decode of any compressed one).

Each checkpoint's loads are checked bitwise once (weights and the optimizer's state dict
against what the plain files hold, loaded over another checkpoint's state first). The
targets the table marks: with optimizer every checkpoint <= 2.0x and the newest <= 1.0x
of the plain files; weights only a whole checkpoint <= 1.5x of ``load_model``, a delta
<= 1.2x of its floor.

    python3 -c "bytearray(8 << 30)"      # touch memory first
    PYTHONPATH=src .venv/bin/python bench/bench_every_checkpoint.py --tiny
    PYTHONPATH=src .venv/bin/python bench/bench_every_checkpoint.py gpt2 --json out.json \\
        --profile prof.txt
    PYTHONPATH=src .venv/bin/python bench/bench_every_checkpoint.py lm --lm-dir /tmp/wv-lm

``--profile PATH`` writes a cProfile of the slowest checkpoint's weights-only load (the
calling thread only; the codec threads' work shows as waits). Everything is written under
one temporary folder (``--scratch``), deleted at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np
import torch
from _common import machine, med, quiesce, save_plain_files, spread
from bench_vault_speed import _alternate as alternate, _files_load, _touch, gpt2_states, lm_states

from weightvault import Vault
from weightvault._file.layout import is_training
from weightvault._vault.objects.address import search_order
from weightvault._vault.objects.frame import (
    HEADER_SIZE,
    Frame,
    is_frame,
    parse_frame,
    table_size as frame_table_size,
)
from weightvault._vault.records.reading import read_doc

CHECKPOINTS = 10
#: The brief's shape; ``--tiny`` makes a 1 x 64 one that checks the script.
SHAPE: dict[str, Any] = {"n_layer": 6, "n_embd": 512, "n_head": 8}
#: Items a zigzag difference is undone in at once (stays in a core's cache).
SLICE = 1 << 16


# -- the states --------------------------------------------------------------------------


def settings(model: Any, opt: Any) -> dict[str, Any]:
    """What the run used: lr (after any scheduler), dtypes, parameter count, threads."""
    state = opt.state_dict()["state"]
    moments = {str(v.dtype) for s in state.values() for k, v in s.items() if k != "step"}
    return {
        "optimizer": type(opt).__name__,
        "lr": sorted({g["lr"] for g in opt.param_groups}),
        "weight_decay": sorted({g.get("weight_decay", 0.0) for g in opt.param_groups}),
        "parameters": sum(p.numel() for p in model.parameters()),
        "weight dtypes": sorted({str(t.dtype) for t in model.state_dict().values()}),
        "moment dtypes": sorted(moments),
        "torch threads": torch.get_num_threads(),
        "cpu count": os.cpu_count(),
    }


def step_count(opt: Any) -> int:
    steps = {int(s["step"]) for s in opt.state_dict()["state"].values() if "step" in s}
    return max(steps) if steps else 0


# -- the layout and the floor --------------------------------------------------------------


@dataclass
class Obj:
    """One stored object: where its bytes are and, for a frame, its parsed table."""

    digest: str
    path: str
    offset: int
    size: int
    frame: Frame | None  # None: raw bytes

    @property
    def is_delta(self) -> bool:
        return self.frame is not None and self.frame.base is not None


def locate(vault: Vault, digest: str, nbytes: int) -> Obj:
    """Object ``digest``'s file (loose or packed) and its frame, as a load finds it."""
    store = vault.store
    for key, packed in search_order(store, digest):
        path = store.local_path(key)
        if path is None or not os.path.exists(path):
            continue
        if packed is not None:  # packs hold raw bytes only
            return Obj(digest, path, packed.offset, packed.size, None)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
            if size == nbytes or not is_frame(head):
                return Obj(digest, path, 0, size, None)
            f.seek(0)
            prefix = f.read(frame_table_size(memoryview(head)))
        return Obj(digest, path, 0, size, parse_frame(memoryview(prefix), None, size))
    raise FileNotFoundError(f"object {digest[:12]} is in no file of {store.url}")


@dataclass
class Tensor:
    """A stored tensor of a checkpoint and the objects a load reads for it, top first."""

    name: str
    nbytes: int
    links: list[Obj]
    out: Any = field(default=None, repr=False)


def layout(vault: Vault, name: str) -> list[Tensor]:
    """Every stored tensor of checkpoint ``name`` and its chain of objects."""
    doc = read_doc(vault.store, name)
    sizes = _stored_sizes(doc)
    out = []
    for tensor, digest in doc["objects"].items():
        nbytes = sizes[tensor]
        links = [locate(vault, digest, nbytes)]
        while links[-1].is_delta:
            base = links[-1].frame.base  # type: ignore[union-attr]
            links.append(locate(vault, base, nbytes))
        out.append(Tensor(tensor, nbytes, links))
    return out


def _stored_sizes(doc: dict[str, Any]) -> dict[str, int]:
    """Each stored tensor's raw size, from the record's safetensors header."""
    header = json.loads(doc["header"])
    return {
        k: v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in header.items()
        if k != "__metadata__"
    }


class Floor:
    """The kernels a load of ``tensors`` cannot avoid: read every object's bytes from the
    page cache, decode each delta block and apply it to its base, block by block."""

    def __init__(self, tensors: list[Tensor]) -> None:
        import blosc2
        from pcodec import standalone

        blosc2.set_releasegil(True)
        self._blosc2, self._pcodec = blosc2, standalone
        self._fds = {o.path: os.open(o.path, os.O_RDONLY) for t in tensors for o in t.links}
        self.items: list[tuple[Tensor, int, int]] = []
        for t in tensors:
            t.out = np.empty(t.nbytes, np.uint8)
            sizes = {o.frame.block_size for o in t.links if o.frame is not None}
            block = min(sizes) if sizes else 4 << 20
            assert all(block == s for s in sizes), f"{t.name}: blocks of several sizes"
            self.items += [(t, lo, min(lo + block, t.nbytes)) for lo in range(0, t.nbytes, block)]
        self.items.sort(key=lambda i: i[2] - i[1], reverse=True)
        self._local = threading.local()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)

    def run(self, threads: int) -> None:
        parts = [self.items[k::threads] for k in range(threads)]
        workers = [threading.Thread(target=self._work, args=(p,)) for p in parts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def _work(self, items: list[tuple[Tensor, int, int]]) -> None:
        for t, lo, hi in items:
            out = t.out[lo:hi]
            self._fill(t.links[-1], out, lo)
            for delta in reversed(t.links[:-1]):
                self._apply(delta, out, lo)

    def _scratch(self, n: int) -> Any:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < n:
            buf = self._local.buf = np.empty(max(n, 4 << 20), np.uint8)
        return buf[:n]

    def _compressed(self, obj: Obj, i: int) -> bytes:
        frame = obj.frame
        assert frame is not None
        _, _, offset = frame.block(i)
        return os.pread(self._fds[obj.path], frame.lengths[i], obj.offset + offset)

    def _decode(self, obj: Obj, i: int, out: Any) -> None:
        frame = obj.frame
        assert frame is not None
        src = self._compressed(obj, i)
        if frame.codec == 0:
            out[:] = np.frombuffer(src, np.uint8)
        elif frame.codec == 1:
            self._blosc2.decompress2(src, dst=out, nthreads=1)
        else:  # pcodec, on the delta's words
            self._pcodec.simple_decompress_into(src, out.view(f"<u{frame.itemsize}"))

    def _fill(self, obj: Obj, out: Any, lo: int) -> None:
        if obj.frame is None:
            os.preadv(self._fds[obj.path], [out], obj.offset + lo)
        else:
            self._decode(obj, lo // obj.frame.block_size, out)

    def _apply(self, obj: Obj, out: Any, lo: int) -> None:
        frame = obj.frame
        assert frame is not None
        delta = self._scratch(out.nbytes)
        self._decode(obj, lo // frame.block_size, delta)
        if frame.kind == 1 or frame.itemsize not in (2, 4, 8):  # XOR
            wide = out.nbytes % 8 == 0
            a, b = (out.view(np.uint64), delta.view(np.uint64)) if wide else (out, delta)
            np.bitwise_xor(a, b, out=a)
            return
        # the zigzag integer difference of item-size words, undone in cache-sized slices
        z, t = delta.view(f"<u{frame.itemsize}"), out.view(f"<u{frame.itemsize}")
        mask = self._local.mask = getattr(self._local, "mask", None)
        if mask is None or mask.dtype != z.dtype:
            mask = self._local.mask = np.empty(SLICE, z.dtype)
        for s in range(0, z.size, SLICE):
            zz, tt, m = z[s : s + SLICE], t[s : s + SLICE], mask[: min(SLICE, z.size - s)]
            np.bitwise_and(zz, 1, out=m)
            np.negative(m, out=m)
            np.right_shift(zz, 1, out=zz)
            np.bitwise_xor(zz, m, out=zz)
            np.add(tt, zz, out=tt)


def check_floor(tensors: list[Tensor], vault: Vault, name: str) -> None:
    """The floor rebuilt the bytes the vault holds (so it timed the real work)."""
    with vault.open(name) as ckpt:
        for t in tensors:
            got = bytes(ckpt.raw(t.name).cast("B"))
            assert got == t.out.tobytes(), f"the floor rebuilt {name}/{t.name} wrongly"


# -- the loads ---------------------------------------------------------------------------


def snapshot(model: Any, opt: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        _clone(opt.state_dict()),
    )


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_clone(v) for v in x)
    return x


def same(a: Any, b: Any, where: str) -> None:
    """``a`` and ``b`` hold the same bits (tensors compared as bytes, so NaNs count)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        ab = a.contiguous().view(-1).view(torch.uint8)
        bb = b.contiguous().view(-1).view(torch.uint8)
        assert torch.equal(ab, bb), f"{where}: bits differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{k}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def check_bitwise(vault: Vault, name: str, folder: Path, other: Path, model: Any, opt: Any) -> None:
    """Both vault loads of ``name`` give exactly what its plain files hold, each loaded
    over the state of checkpoint ``other`` (so a load that did nothing would fail)."""
    from safetensors.torch import load_model

    _files_load(folder, model, opt)
    want_w, want_o = snapshot(model, opt)
    _files_load(other, model, opt)
    vault.load(model, name, optimizer=opt)
    same(snapshot(model, opt)[0], want_w, f"{name} weights (with optimizer)")
    same(_clone(opt.state_dict()), want_o, f"{name} optimizer")
    load_model(model, str(other / "model.safetensors"))
    vault.load(model, name)
    same(snapshot(model, opt)[0], want_w, f"{name} weights only")


def measure(
    states: Iterator[tuple[Any, Any]], scratch: Path, rounds: int, profile: Path | None
) -> dict[str, Any]:
    from safetensors.torch import load_model

    vault = Vault(scratch / "vault")
    model = opt = None
    steps: list[int] = []
    t0 = time.perf_counter()
    for k, (model, opt) in enumerate(states):
        save_plain_files(scratch / f"files-{k:02d}", model, opt)
        vault.save(model, optimizer=opt)
        vault.wait()  # its compactor, before the next save (as an idle loop has it)
        steps.append(step_count(opt))
    assert model is not None and opt is not None
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    vault.compact()  # settled, as the end of training leaves it
    compact_s = time.perf_counter() - t0
    out: dict[str, Any] = {"settings": settings(model, opt), "optimizer steps": steps}
    out["train + save s"], out["final compact s"] = train_s, compact_s
    names = [r.name for r in vault.list()]
    files = sorted(scratch.glob("files-*"))
    out["disk"] = {
        "vault": vault.disk_bytes(),
        "files": sum(f.stat().st_size for d in files for f in d.iterdir()),
    }
    _touch(model, opt)
    rows: list[dict[str, Any]] = []
    for k, (name, folder) in enumerate(zip(names, files, strict=True)):
        check_bitwise(vault, name, folder, files[(k + 1) % len(files)], model, opt)
        tensors = layout(vault, name)
        weights = [t for t in tensors if not is_training(t.name)]
        state = [t for t in tensors if is_training(t.name)]
        floor = Floor(weights)
        floor.run(1)
        check_floor(weights, vault, name)
        path = str(folder / "model.safetensors")
        contenders: dict[str, Callable[[], Any]] = {
            "vault weights": lambda n=name: vault.load(model, n),
            "files weights": lambda p=path: load_model(model, p),
            "vault + opt": lambda n=name: vault.load(model, n, optimizer=opt),
            "files + opt": lambda f=folder: _files_load(f, model, opt),
            "floor 1 thread": lambda fl=floor: fl.run(1),
            "floor 2 threads": lambda fl=floor: fl.run(2),
        }
        times = alternate(contenders, rounds)
        floor.close()
        floor.items.clear()
        for t in weights:
            t.out = None
        row: dict[str, Any] = {"name": name, "checkpoint": f"c{k}", "step": steps[k]}
        row |= {n: med(ts) for n, ts in times.items()}
        row["spread"] = {n: spread(ts) for n, ts in times.items()}
        row["floor"] = min(row["floor 1 thread"], row["floor 2 threads"])
        row["objects per weight (max)"] = max(len(t.links) for t in weights)
        row["objects per state tensor (max)"] = max((len(t.links) for t in state), default=0)
        row["weight deltas"] = sum(t.links[0].is_delta for t in weights)
        row["weights"] = len(weights)
        row["state deltas"] = sum(t.links[0].is_delta for t in state)
        row["state tensors"] = len(state)
        row["weight MB read"] = sum(o.size for t in weights for o in t.links) / 1e6
        row["weight MB raw"] = sum(t.nbytes for t in weights) / 1e6
        row["compressed whole weights"] = sum(
            1 for t in weights if t.links[0].frame is not None and not t.links[0].is_delta
        )
        rows.append(row)
        print(f"{name}: {row_text(row, k == len(names) - 1)}", flush=True)
    out["checkpoints"] = rows
    if profile is not None:
        slowest = max(rows, key=lambda r: r["vault weights"])
        out["profiled"] = slowest["name"]
        profile.write_text(profiled(lambda: vault.load(model, slowest["name"]), slowest["name"]))
    return out


def profiled(fn: Callable[[], Any], name: str, times: int = 3) -> str:
    prof = cProfile.Profile()
    fn()
    for _ in range(times):
        quiesce()
        prof.enable()
        fn()
        prof.disable()
    text = io.StringIO()
    text.write(f"cProfile of {times} weights-only loads of {name} (calling thread only)\n")
    for order in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(30)
    return text.getvalue()


# -- the report --------------------------------------------------------------------------


def row_text(row: dict[str, Any], newest: bool) -> str:
    return " ".join(f"{c}" for c in cells(row, newest))


def cells(row: dict[str, Any], newest: bool) -> list[str]:
    """One table row; a target a figure misses is marked ``!``."""
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    delta = row["weight deltas"] > 0
    w = row["vault weights"] / row["files weights"]
    o = row["vault + opt"] / row["files + opt"]
    f = row["vault weights"] / row["floor"]
    w_ok = delta or w <= 1.5
    f_ok = not delta or f <= 1.2
    o_ok = o <= (1.0 if newest else 2.0)
    mark = lambda ok: "" if ok else " !"  # noqa: E731
    return [
        row["checkpoint"] + (" (newest)" if newest else ""),
        str(row["step"]),
        f"{row['objects per weight (max)']}/{row['objects per state tensor (max)']}",
        f"{row['weight deltas']}/{row['weights']}",
        f"{row['state deltas']}/{row['state tensors']}",
        ms(row["files weights"]),
        ms(row["vault weights"]),
        f"{w:.2f}x{mark(w_ok)}",
        ms(row["floor"]),
        f"{f:.2f}x{mark(f_ok)}",
        ms(row["files + opt"]),
        ms(row["vault + opt"]),
        f"{o:.2f}x{mark(o_ok)}",
    ]


HEADS = [
    "ckpt",
    "opt step",
    "objs/tensor max (w/state)",
    "weight deltas",
    "state deltas",
    "load_model ms",
    "vault w ms",
    "vs load_model",
    "floor ms",
    "vs floor",
    "files+opt ms",
    "vault+opt ms",
    "vs files",
]


def report(out: dict[str, Any]) -> str:
    rows = out["checkpoints"]
    body = [cells(r, k == len(rows) - 1) for k, r in enumerate(rows)]
    lines = [
        f"run: {out['run']}; settings: {json.dumps(out['settings'])}",
        f"optimizer steps at the checkpoints: {out['optimizer steps']}; "
        f"rounds {out['rounds']} (medians), load average before/after "
        f"{out['loadavg before']} / {out['loadavg after']}",
        f"disk: vault {out['disk']['vault'] / 1e6:.1f} MB, plain files "
        f"{out['disk']['files'] / 1e6:.1f} MB",
        "",
        "| " + " | ".join(HEADS) + " |",
        "|" + "---|" * len(HEADS),
        *("| " + " | ".join(r) + " |" for r in body),
        "",
        "targets: with optimizer <= 2.0x (newest <= 1.0x) of the plain files; weights only "
        "a whole checkpoint <= 1.5x of load_model, a delta <= 1.2x of its floor ('!' = missed)",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", nargs="?", choices=["gpt2", "lm"], default="gpt2")
    ap.add_argument("--lm-dir", type=Path, default=Path("/tmp/wv-lm"), help="the lm run")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per checkpoint")
    ap.add_argument("--steps", type=int, default=3, help="training steps between checkpoints")
    ap.add_argument("--lr", type=float, default=3e-5, help="AdamW's learning rate (gpt2)")
    ap.add_argument("--tiny", action="store_true", help="a 1 x 64 GPT-2: checks the script")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--profile", type=Path, help="write a cProfile of the slowest load here")
    ap.add_argument("--scratch", type=Path, help="make the temporary folder in here")
    args = ap.parse_args()
    if args.tiny:
        SHAPE.update(n_layer=1, n_embd=64, n_head=2, vocab_size=256)
    if args.run == "lm":
        import _train_lm as T

        if not T.checkpoints_exist(args.lm_dir):
            print(f"no lm run at {args.lm_dir} (bench_compress.py train --dir makes it): skipped")
            return
        states = lm_states(args.lm_dir)
    else:
        states = gpt2_states(args.steps, lr=args.lr, shape=SHAPE)
    if args.scratch is not None:
        args.scratch.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="wv-bench-every-", dir=args.scratch))
    # A `timeout` (SIGTERM) still deletes the scratch folder (several GB for gpt2).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    before = os.getloadavg()
    try:
        out = measure(states, scratch, args.rounds, args.profile)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out |= {"run": args.run + (" tiny" if args.tiny else ""), "rounds": args.rounds}
    out["steps between checkpoints"] = args.steps if args.run == "gpt2" else None
    out["loadavg before"] = [round(x, 2) for x in before]
    out["loadavg after"] = [round(x, 2) for x in os.getloadavg()]
    import weightvault

    out["weightvault"] = weightvault.__file__
    out["machine"] = machine()
    print(report(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
