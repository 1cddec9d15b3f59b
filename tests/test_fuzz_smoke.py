"""Fuzz smoke run: thousands of hostile safetensors/weightvault files, one error class.

Every case is a file that a seeded generator builds: headers whose JSON is shaped like a
real one but holds wrong types, absurd sizes, lone surrogates and dangling references,
and byte mutations of valid weightvault files that hold aliases, copies and views. Each
goes through ``weightvault.numpy.load_file``, ``weightvault.torch.load_file``, opening a
checkpoint and ``weightvault.verify``; the only exception allowed is ``FormatError``, and
``verify`` raises nothing at all.

``WEIGHTVAULT_FUZZ_CASES=50000`` runs a bigger one-off by hand (the default keeps the run
at about 20 s of CPU time).
"""

from __future__ import annotations

import json
import os
import random
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import weightvault
import weightvault.numpy as wvn
from _hostile_files import reseal
from weightvault.formats._registry import open_checkpoint

try:
    import torch

    import weightvault.torch as wvt
except ImportError:  # pragma: no cover - the numpy readers still run
    torch = None  # type: ignore[assignment]
    wvt = None  # type: ignore[assignment]

CASES = int(os.environ.get("WEIGHTVAULT_FUZZ_CASES", "10000"))

DTYPES = ["F32", "F16", "BF16", "U8", "I64", "BOOL", "F8_E4M3", "C64", "F64", "I8"]
ITEM = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I64": 8, "BOOL": 1, "F8_E4M3": 1}
ITEM.update({"C64": 8, "F64": 8, "I8": 1})
#: Names a fuzzed reference may use: real ones, internal storage, odd ones and, rarely,
#: lone surrogates (which the reader refuses up front, ending the case early).
NAMES = ["a", "b", "c", "__weightvault__.storage0", "", "format", "w", "row"] * 4
NAMES += ["\ud800", "x\udfff"]


def _size(r: random.Random) -> Any:
    return r.choice(
        [0, 1, 2, 3, 4, 2**28, 2**62, 2**63, 2**64, -1, True, 1.5, "2", None, [2], 2**31 - 1]
    )


def _shape(r: random.Random) -> Any:
    if r.random() < 0.85:
        return [r.choice([0, 1, 2, 3, 4]) for _ in range(r.randint(0, 3))]
    if r.random() < 0.9:
        return [_size(r) for _ in range(r.randint(0, 4))]
    return r.choice([None, 3, "x", {}, [[1]], [0] * 70])


def _junk(r: random.Random) -> Any:
    return r.choice([None, True, 0, -1, 2**70, 1e400, "x", "\ud800", [], {}, [[[]]], {"a": 1}])


def _maybe(r: random.Random, good: Any) -> Any:
    return good if r.random() < 0.96 else _junk(r)


def _view(r: random.Random, stored: list[str]) -> Any:
    base = r.choice(stored) if stored and r.random() < 0.9 else r.choice(NAMES)
    dtype = r.choice(["U8", "U8", "F32", *DTYPES])
    n = r.randint(0, 3)
    shape = [r.choice([0, 1, 1, 2, 3, 2**28, 2**40]) for _ in range(n)]
    stride = [r.choice([0, 0, 1, 1, 2, 3, 2**40]) for _ in range(n)]
    if r.random() < 0.1:
        stride = stride[:-1]
    record = [base, dtype, shape, stride, r.choice([0, 0, 0, 1, 2, 4, 8, 2**62])]
    if r.random() < 0.05:
        record[r.randrange(5)] = _junk(r)
    return _maybe(r, record)


def _manifest(r: random.Random, stored: list[str]) -> Any:
    everything = stored + NAMES + ["v0", "v1", "c0", "al0"]
    doc: dict[str, Any] = {"version": _maybe(r, 1)}
    if r.random() < 0.6:
        doc["views"] = _maybe(r, {f"v{i}": _view(r, stored) for i in range(r.randint(0, 2))})
    if r.random() < 0.5:
        doc["copies"] = _maybe(r, {"c0": _maybe(r, r.choice(everything))})
    if r.random() < 0.5:
        doc["aliases"] = _maybe(r, {"al0": _maybe(r, r.choice(everything))})
    for key in ("frozen", "names"):
        if r.random() < 0.4:
            doc[key] = _maybe(r, r.sample(everything, r.randint(0, 3)))
    if r.random() < 0.3:
        doc["checksum"] = _maybe(r, "xxh3_64")
        doc["sums"] = _maybe(r, {n: r.choice(["0" * 16, "g" * 16, "00"]) for n in stored})
    if r.random() < 0.2:
        doc["metadata"] = _maybe(r, {"k": "v"})
    if r.random() < 0.03:
        return r.choice(["{", "[]", "null", '{"version": 1, "views": {"v0": [', "\ud800"])
    return json.dumps(doc)


def fuzzed_header(r: random.Random) -> bytes:
    """A header shaped like a real one, with hostile values; data to match its offsets."""
    header: dict[str, Any] = {}
    position = 0
    stored: list[str] = []
    for i in range(r.randint(0, 3)):
        name = r.choice(["t0", "t1", "t2", *NAMES]) if r.random() < 0.2 else f"t{i}"
        dtype = r.choice(["U8", "U8", *DTYPES])
        shape = _shape(r)
        try:
            nbytes = ITEM[dtype] * int(np.prod([int(d) for d in shape], dtype=object))
        except (TypeError, ValueError, OverflowError):
            nbytes = r.randint(0, 16)
        nbytes = nbytes if 0 <= nbytes <= 4096 else r.randint(0, 16)
        offsets: Any = [position, position + nbytes]
        if r.random() < 0.03:
            offsets = r.choice([[0, 2**64], [-1, 0], [0], "0", [1.0, 2.0], [position, 0]])
        entry: dict[str, Any] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        if r.random() < 0.03:
            entry[r.choice(["dtype", "shape", "data_offsets", "extra"])] = _junk(r)
        header[name] = _maybe(r, entry)
        stored.append(name)
        position += nbytes
    if r.random() < 0.8:
        meta: dict[str, Any] = {"weightvault": _manifest(r, stored)}
        if r.random() < 0.2:
            meta[r.choice([*NAMES, "al"])] = r.choice(stored + NAMES) if stored else "a"
        if r.random() < 0.05:
            meta["format"] = _junk(r)
        header["__metadata__"] = _maybe(r, meta)
    text = json.dumps(header, ensure_ascii=r.random() < 0.9)
    raw = text.encode("utf-8", "surrogatepass")
    data = bytes(r.getrandbits(8) for _ in range(max(position, 0)))
    if r.random() < 0.05:
        data = data[: r.randint(0, len(data))] if data else b"\0"
    length = len(raw) if r.random() < 0.97 else r.choice([0, 1, len(raw) + 1, 2**63, 2**64 - 1])
    return struct.pack("<Q", length) + raw + data


def _valid_files() -> list[bytes]:
    """Small valid weightvault files with aliases, copies, views, expanded views."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((3, 4)).astype(np.float32)
    row = np.arange(3, dtype=np.int16)
    arrays_list = [
        {
            "w": base,
            "w_tied": base,
            "w_t": base.T,
            "w_row": base[1],
            "w_copy": base.copy(),
            "row": row,
            "row_b": np.broadcast_to(row, (5, 3)),
            "flag": np.array(True),
            "empty": np.zeros((0, 2), np.float32),
        },
        {"a": base[:, 1:3], "b": base[:, 0:2], "c": base[:, 1:3].copy()},
    ]
    out = []
    with tempfile.TemporaryDirectory() as d:
        for i, arrays in enumerate(arrays_list):
            p = os.path.join(d, f"{i}.safetensors")
            wvn.save(arrays, p, metadata={"step": "3"})
            out.append(Path(p).read_bytes())
    return out


def mutated(r: random.Random, valid: bytes) -> bytes:
    """A valid file with a few bytes set, flipped, deleted or inserted, maybe truncated."""
    data = bytearray(valid)
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    for _ in range(r.randint(1, 4)):
        hi = (header_end if r.random() < 0.85 else len(data)) - 1
        at = r.randint(0, hi)
        kind = r.choice(["set", "flip", "delete", "insert", "digit"])
        if kind == "set":
            text = b'0123456789-[]{}",:.eE \\u'
            data[at] = r.choice(text) if r.random() < 0.7 else r.randrange(256)
        elif kind == "flip":
            data[at] ^= 1 << r.randrange(8)
        elif kind == "delete":
            del data[at]
        elif kind == "insert":
            data.insert(at, r.randrange(256))
        elif data[at : at + 1].isdigit():
            data[at : at + 1] = r.choice([b"99999999999", b"0", b"-1", b"268435456"])
    if r.random() < 0.1:
        data = data[: r.randint(0, len(data))]
    return bytes(data)


def _tweak(r: random.Random, doc: Any) -> Any:
    """``doc`` with one value somewhere inside replaced by a plausible or hostile one."""
    if isinstance(doc, dict) and doc and r.random() < 0.95:
        key = r.choice(list(doc))
        if r.random() < 0.1:
            doc[r.choice(NAMES)] = doc.pop(key)
        else:
            doc[key] = _tweak(r, doc[key])
        return doc
    if isinstance(doc, list) and doc and r.random() < 0.9:
        i = r.randrange(len(doc))
        doc[i] = _tweak(r, doc[i])
        return doc
    if isinstance(doc, str) and doc.startswith("{"):
        try:
            return json.dumps(_tweak(r, json.loads(doc)))
        except ValueError:
            return doc
    if isinstance(doc, int) and not isinstance(doc, bool) and r.random() < 0.9:
        return r.choice([0, 0, 1, doc + 1, doc - 1, doc * 2, 2**28, 2**40, -doc])
    return _junk(r) if r.random() < 0.5 else r.choice([*NAMES, "w", "row", "a", "b", "U8"])


def restructured(r: random.Random, valid: bytes) -> bytes:
    """A valid file whose header (manifest included) has a value or two changed."""
    n = struct.unpack("<Q", valid[:8])[0]
    doc = json.loads(valid[8 : 8 + n])
    for _ in range(r.randint(1, 2)):
        key = r.choice(list(doc))
        doc[key] = _tweak(r, doc[key])
    raw = json.dumps(doc, ensure_ascii=r.random() < 0.9).encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw + valid[8 + n :]


def case(seed: int, valid: list[bytes]) -> bytes:
    """The file of case ``seed``: fuzzed headers, changed headers, mutated bytes."""
    r = random.Random(seed)
    pick = r.random()
    if pick < 0.4:
        return fuzzed_header(r)
    # Changes of a valid file are resealed, so they reach the checks past the header's sum.
    if pick < 0.7:
        return reseal(restructured(r, r.choice(valid)))
    return reseal(mutated(r, r.choice(valid)))


def _numpy(path: Path) -> Any:
    return wvn.load_file(path, verify=True)


def _torch(path: Path) -> Any:
    assert wvt is not None
    return wvt.load_file(path)


def _torch_verify(path: Path) -> Any:
    assert wvt is not None
    return wvt.load_file(path, verify=True, mmap=True)


def _open(path: Path) -> Any:
    with open_checkpoint(path) as ckpt:
        ckpt.verify()
        return weightvault.inspect(ckpt.path)


def run_cases(tmp: Path, seeds: range) -> dict[str, list[tuple[int, str]]]:
    """Run every reader on every case; the non-FormatError failures, by reader."""
    readers: list[tuple[str, Callable[[Path], Any]]] = [("numpy", _numpy), ("open", _open)]
    if wvt is not None:
        readers += [("torch", _torch), ("torch_verify", _torch_verify)]
    valid = _valid_files()
    path = tmp / "fuzz.safetensors"
    bad: dict[str, list[tuple[int, str]]] = {}
    for seed in seeds:
        path.write_bytes(case(seed, valid))
        for label, read in readers:
            try:
                read(path)
            except weightvault.FormatError:
                pass
            except Exception as e:
                bad.setdefault(label, []).append((seed, f"{type(e).__name__}: {e}"[:200]))
        try:
            report = weightvault.verify(path)
            assert isinstance(report.ok, bool)
        except Exception as e:
            bad.setdefault("verify", []).append((seed, f"{type(e).__name__}: {e}"[:200]))
    return bad


def test_fuzz_smoke(tmp_path: Path) -> None:
    bad = run_cases(tmp_path, range(CASES))
    assert not bad, {k: (len(v), v[:5]) for k, v in bad.items()}


def test_cases_reach_past_the_header() -> None:
    """The generator is not all noise: many cases open, so the deeper readers run."""
    valid = _valid_files()
    opened = 0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.safetensors"
        for seed in range(400):
            path.write_bytes(case(seed, valid))
            try:
                with open_checkpoint(path):
                    opened += 1
            except weightvault.FormatError:
                pass
    assert 40 <= opened <= 360, opened


if __name__ == "__main__":  # pragma: no cover - the bigger one-off run by hand
    import sys
    import time

    start = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    with tempfile.TemporaryDirectory() as d:
        t0, c0 = time.perf_counter(), time.process_time()
        found = run_cases(Path(d), range(start, start + CASES))
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(f"{CASES} cases (seeds {start}..{start + CASES - 1}): {took:.1f} s wall, {cpu:.1f} s CPU")
    for label, items in found.items():
        print(label, len(items))
        for seed, msg in items[:10]:
            print("  ", seed, msg)
    pytest  # noqa: B018 - keep the import used when run as a script
