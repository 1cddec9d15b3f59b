"""A file cut short while weightvault reads it is an error, never a signal that kills.

Touching a mapped page past a file's new end raises ``SIGBUS``, which no Python code can
catch: the process dies. So each case runs its reader in a child process (this file run
as a script), and a death by signal (``returncode -7`` for ``SIGBUS``) fails the test.

The cut is deterministic, never timing luck: the child wraps ``mmap.mmap``,
``os.pread`` and ``os.preadv``, and truncates the victim file to half its size right
after a mapping of it is made, or right before a positional read of it starts, or
after the first window of bytes was read (``skip=1``). Reads of a pack's index are let
through, so the cut lands on the objects' bytes. The child reports whether the cut
happened (a case whose cut never came would prove nothing) and what the reader said.

Foreign files (npz, compressed npz, MXNet ``.params``, Keras ``.weights.h5``) are cut
during a load of a checkpoint already open: between the open and the load, or before
the load's second positional read of the file (``skip=1``).

The oracle for what is read is the reader's own outcome: a load or a single file's
verify raises a :class:`~weightvault.FormatError` (or ``OSError``) naming the file and
the tensor and leaves the model as it was; a vault's verify reports the tensor; a
compaction reports the object damaged (or raises) and leaves the vault loadable
wherever the cut object is not needed.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import env

#: One tensor of this many float32 (8 MiB): a loose object (packs take those under 4 MiB),
#: read and hashed in several 1 MiB windows.
BIG = 1 << 21
#: The small tensors a save packs, and their count.
SMALL, COUNT = 1 << 14, 8


def big(k: int) -> np.ndarray:
    """A tensor that compresses (few mantissa bits) and drifts a little per save, as
    trained weights do, so the compactor writes full frames and deltas of it."""
    rng = np.random.default_rng(0)
    base = np.round(rng.standard_normal(BIG) * 256) / 256
    return (base + k / 1024).astype(np.float32)


def small(k: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(k)
    return {f"s{i}": rng.standard_normal(SMALL).astype(np.float32) for i in range(COUNT)}


# -- the victims -----------------------------------------------------------------------------


def make_file(root: Path) -> tuple[Path, str]:
    import weightvault.numpy as wvn

    path = root / "model.safetensors"
    wvn.save({"w": big(0), "b": np.arange(4096, dtype=np.float32)}, path)
    return path, "w"


def _object(root: Path, name: str, tensor: str) -> Path:
    doc = json.loads((root / "checkpoints" / f"{name}.json").read_text())
    digest = doc["objects"][tensor]
    return root / "objects" / digest[:2] / digest


def make_vault(root: Path, kind: str, reader: str) -> tuple[Path, str, str]:
    """A vault whose object (or pack) of ``kind`` the ``reader`` will read; returns the
    victim file, the checkpoint and the tensor to name."""
    from weightvault import Vault

    vault = Vault(root, compaction=None)
    if kind == "raw":
        vault.save({"w": big(0)})
        return _object(root, "000001", "w"), "000001", "w"
    if kind == "pack":
        vault.save(small(0))
        if reader == "compaction":
            vault.save(small(1))  # the oldest's pack is taken apart by a compaction
        (pack,) = sorted((root / "packs").glob("*.pack"))[:1]
        return pack, "000001", "s7"  # the last object: past the cut
    vault.save({"w": big(0)})
    vault.save({"w": big(1)})
    vault.compact()  # settled: 000002 a full compressed frame, 000001 a delta on it
    if reader == "compaction" and kind == "compressed":
        # Two new checkpoints: 000003, no longer the newest, becomes a delta on the anchor
        # 000002, which the compaction decodes to make it.
        vault.save({"w": big(2)})
        vault.save({"w": big(3)})
    if reader == "compaction" and kind == "delta":
        vault.delete("000002")  # the newest is a delta now: decoded and made full
    name = "000002" if kind == "compressed" else "000001"
    victim = _object(root, name, "w")
    magic = victim.read_bytes()[:8]
    assert magic == b"\x89WVO\r\n\x1a\n", f"{kind}: the object is not a frame"
    kind_byte = victim.read_bytes()[11]
    assert (kind_byte == 0) == (kind == "compressed"), kind_byte
    return victim, name, "w"


FOREIGN = ["npz", "npz-deflate", "mxnet", "h5"]


def _mx_dense(a: np.ndarray) -> bytes:
    """A dense float32 MXNet NDArray record (V2), as ``mx.nd.save`` writes it."""
    shape = struct.pack("<i", a.ndim) + struct.pack(f"<{a.ndim}q", *a.shape)
    return struct.pack("<Ii", 0xF993FAC9, 0) + shape + struct.pack("<iii", 1, 0, 0) + a.tobytes()


def make_foreign(root: Path, kind: str) -> Path:
    """A foreign file of ``kind`` holding ``w`` (8 MiB, so the cut lands in it) then ``b``."""
    arrays = {"w": big(0), "b": np.arange(4096, dtype=np.float32)}
    if kind in ("npz", "npz-deflate"):
        path = root / "m.npz"
        (np.savez_compressed if kind == "npz-deflate" else np.savez)(path, **arrays)
    elif kind == "mxnet":
        path = root / "m.params"
        body = struct.pack("<QQQ", 0x112, 0, 2) + b"".join(_mx_dense(a) for a in arrays.values())
        body += struct.pack("<Q", 2) + b"".join(struct.pack("<Q", 1) + n.encode() for n in arrays)
        path.write_bytes(body)
    else:
        import h5py

        path = root / "m.weights.h5"
        with h5py.File(path, "w") as f:
            for name, a in arrays.items():
                f[name] = a
    return path


# -- the child -------------------------------------------------------------------------------


def arm(victim: str, skip: int, below: int) -> dict[str, Any]:
    """Cut ``victim`` to half its size right after it is mapped, or before its
    ``skip + 1``-th positional read that starts below offset ``below``."""
    import mmap

    st = os.stat(victim)
    ident, size = (st.st_dev, st.st_ino), st.st_size
    state: dict[str, Any] = {"cut": False, "how": None, "reads": 0}

    def mine(fd: int) -> bool:
        try:
            s = os.fstat(fd)
        except (OSError, TypeError, ValueError):
            return False
        return (s.st_dev, s.st_ino) == ident

    def cut(how: str) -> None:
        if not state["cut"]:
            os.truncate(victim, size // 2)
            state["cut"], state["how"] = True, how

    real_map, real_pread, real_preadv = mmap.mmap, os.pread, os.preadv

    def mapping(fileno: int, *args: Any, **kwargs: Any) -> mmap.mmap:
        m = real_map(fileno, *args, **kwargs)
        if fileno >= 0 and mine(fileno):
            cut("after it was mapped")
        return m

    def before_read(fd: int, offset: int) -> None:
        if state["cut"] or offset >= below or not mine(fd):
            return
        if state["reads"] >= skip:
            cut("before a read" if skip == 0 else f"after {skip} window(s)")
        state["reads"] += 1

    def pread(fd: int, n: int, offset: int) -> bytes:
        before_read(fd, offset)
        return real_pread(fd, n, offset)

    def preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        before_read(fd, offset)
        return real_preadv(fd, buffers, offset, *args)

    mmap.mmap = mapping  # type: ignore[assignment, misc]
    os.pread, os.preadv = pread, preadv
    return state


def run_reader(spec: dict[str, Any]) -> dict[str, Any]:
    """In the child: arm the cut, run the reader, say what came of it."""
    import weightvault
    from weightvault import Vault

    if spec["kind"] == "foreign":
        return _foreign_reader(spec)
    state = arm(spec["victim"], spec["skip"], spec["below"])
    out: dict[str, Any] = {}
    try:
        if spec["kind"] == "file":
            out.update(_file_reader(spec))
        elif spec["reader"] == "load":
            import weightvault.numpy as wvn

            with Vault(spec["root"]).open(spec["name"]) as ckpt:
                wvn.load_file(ckpt, verify=spec["verify"])
            out["outcome"] = "loaded"
        elif spec["reader"] == "verify":
            report = Vault(spec["root"]).verify()
            out["outcome"] = "reported" if not report.ok else "ok"
            out["message"] = " | ".join(report.problems)
        else:
            compacted = Vault(spec["root"], compaction=None).compact()
            out["outcome"] = "reported" if compacted.damaged else "ok"
            out["message"] = " | ".join(compacted.damaged)
    except (weightvault.FormatError, OSError) as e:
        out["outcome"], out["error"], out["message"] = "raised", type(e).__name__, str(e)
    out["cut"], out["how"] = state["cut"], state["how"]
    return out


def _file_reader(spec: dict[str, Any]) -> dict[str, Any]:
    import weightvault

    if spec["reader"] == "verify":
        report = weightvault.verify(spec["victim"])
        return {"outcome": "reported" if not report.ok else "ok", "message": str(report)}
    if spec["reader"] == "diff":
        weightvault.diff(spec["victim"], spec["other"])
        return {"outcome": "ok"}
    import torch

    import weightvault.torch as wvt

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(BIG))
    model.b = torch.nn.Parameter(torch.zeros(4096))
    try:
        wvt.load(model, spec["victim"], verify=spec["verify"])
    finally:
        untouched = not model.w.detach().any().item() and not model.b.detach().any().item()
    return {"outcome": "loaded", "untouched": untouched}


def _foreign_reader(spec: dict[str, Any]) -> dict[str, Any]:
    """Open the foreign file, cut it (now, or armed before the load's reads), load it
    into arrays of zeros."""
    import weightvault
    import weightvault.numpy as wvn
    from weightvault.formats import open_any

    victim = spec["victim"]
    arrays = {"w": np.zeros(BIG, np.float32), "b": np.zeros(4096, np.float32)}
    state: dict[str, Any] = {"cut": False, "how": None}
    out: dict[str, Any] = {}
    try:
        with open_any(victim) as ckpt:
            if spec["skip"] < 0:
                os.truncate(victim, os.stat(victim).st_size // 2)
                state.update(cut=True, how="after it was opened")
            else:
                state = arm(victim, spec["skip"], spec["below"])
            wvn.load(arrays, ckpt)
        out["outcome"] = "loaded"
    except (weightvault.FormatError, OSError) as e:
        out["outcome"], out["error"], out["message"] = "raised", type(e).__name__, str(e)
    out["untouched"] = not any(a.any() for a in arrays.values())
    out["cut"], out["how"] = state["cut"], state["how"]
    return out


# -- the tests -------------------------------------------------------------------------------


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the reader of ``spec`` in a child process; fail on its death by a signal."""
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(spec)],
        env=env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    if proc.returncode < 0:
        pytest.fail(
            f"the reader died of signal {-proc.returncode} (SIGBUS is 7) when "
            f"{spec['victim']} was cut short:\n{proc.stderr[-3000:]}"
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cut"], f"the cut never came, so nothing was tested: {result}"
    return result


def _below(kind: str, victim: Path) -> int:
    if kind != "pack":
        return victim.stat().st_size
    from weightvault._vault.store import pack as P
    from weightvault._vault.store.backend import LocalStore

    index = P.read_index(LocalStore(str(victim.parent.parent)), f"packs/{victim.name}")
    return max(w.offset + w.size for w in index.values())  # the index starts past it


FILE_READERS = [("load", False, 0), ("load", True, 1), ("verify", False, 0),
                ("verify", False, 1), ("diff", False, 0)]  # fmt: skip


@pytest.mark.parametrize(("reader", "verify", "skip"), FILE_READERS)
def test_a_single_file_cut_short_while_read_is_an_error(
    tmp_path: Path, reader: str, verify: bool, skip: int
) -> None:
    victim, _ = make_file(tmp_path)
    other = tmp_path / "other.safetensors"
    import weightvault.numpy as wvn

    wvn.save({"w": big(1), "b": np.zeros(4096, np.float32)}, other)
    spec = {"kind": "file", "reader": reader, "verify": verify, "skip": skip,
            "victim": str(victim), "other": str(other), "below": victim.stat().st_size}  # fmt: skip
    result = child(spec)
    if reader == "verify":
        assert result["outcome"] == "reported", result
        assert re.search("'[wb]'", result["message"]), result
        return
    assert result["outcome"] == "raised", result
    # Whichever of its tensors the reader reached first past the cut.
    assert re.search(f"{re.escape(str(victim))}: tensor '[wb]'", result["message"]), result
    if reader == "load" and skip == 0:
        # Cut before a byte was read: the load refuses before it changes anything.
        assert "untouched" not in result or result["untouched"], result


KINDS = ["raw", "compressed", "delta", "pack"]
READERS = ["load", "verify", "compaction"]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_vault_file_cut_short_while_read_is_an_error(
    tmp_path: Path, kind: str, reader: str
) -> None:
    root = tmp_path / "v"
    victim, name, tensor = make_vault(root, kind, reader)
    spec = {"kind": kind, "reader": reader, "verify": kind == "raw", "skip": 0,
            "victim": str(victim), "root": str(root), "name": name,
            "below": _below(kind, victim)}  # fmt: skip
    result = child(spec)
    # A pack cut in half: the first of its objects past the cut is named.
    tensor = r"s\d" if kind == "pack" else tensor
    if reader == "load":
        assert result["outcome"] == "raised", result
        assert re.search(f"{name}.json: tensor '{tensor}'", result["message"]), result
    elif reader == "verify":
        assert result["outcome"] == "reported", result
        assert re.search(f"{name}: tensor '{tensor}'", result["message"]), result
    else:
        assert result["outcome"] in ("reported", "raised"), result
        assert str(victim) in result["message"], result


@pytest.mark.parametrize("kind", ["raw", "compressed"])
def test_a_vault_object_cut_after_its_first_window_is_an_error(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "v"
    victim, name, tensor = make_vault(root, kind, "load")
    spec = {"kind": kind, "reader": "load", "verify": True, "skip": 1, "victim": str(victim),
            "root": str(root), "name": name, "below": victim.stat().st_size}  # fmt: skip
    result = child(spec)
    assert result["outcome"] == "raised", result
    assert f"{name}.json: tensor {tensor!r}" in result["message"], result


#: ``skip``: -1 cuts the file between its open and the load; 1 before the load's second
#: positional read (a deflated member is inflated through buffered reads, not these).
FOREIGN_CUTS = [(kind, -1) for kind in FOREIGN] + [(k, 1) for k in FOREIGN if k != "npz-deflate"]


@pytest.mark.parametrize(("kind", "skip"), FOREIGN_CUTS)
def test_a_foreign_file_cut_short_during_a_load_is_an_error(
    tmp_path: Path, kind: str, skip: int
) -> None:
    if kind == "h5":
        pytest.importorskip("h5py")
    victim = make_foreign(tmp_path, kind)
    spec = {"kind": "foreign", "reader": "load", "skip": skip, "victim": str(victim),
            "below": victim.stat().st_size}  # fmt: skip
    result = child(spec)
    assert result["outcome"] == "raised", result
    assert result["error"] == "FormatError", result
    # Whichever of its arrays the load reached first past the cut.
    assert re.search(f"{re.escape(str(victim))}: tensor '[wb]'", result["message"]), result
    if skip < 0:
        # Cut before the load: it refuses before it changes anything.
        assert result["untouched"], result


if __name__ == "__main__":
    print(json.dumps(run_reader(json.loads(sys.argv[1]))))
