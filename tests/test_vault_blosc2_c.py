"""Decoding through C-Blosc2's library directly (:mod:`weightvault._vault.objects.blosc2_c`).

python-blosc2 is the oracle: it writes every block here, and whatever it decodes, the C
decoder must decode to the same bytes; whatever it refuses, the C decoder refuses as a
ValueError, never a crash. Where the library cannot be used, decoding falls back to
python-blosc2 and gives the same bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

blosc2 = pytest.importorskip("blosc2")

from weightvault._vault.objects import blosc2_c  # noqa: E402
from weightvault._vault.objects.codec import CODECS, compress_block, decompress_block  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")
BLOSC2 = CODECS["blosc2"]


@pytest.fixture(scope="module")
def c_decoder() -> blosc2_c.Decoder:
    d = blosc2_c.decoder()
    if d is None:
        pytest.skip("no C-Blosc2 library beside python-blosc2 here")
    return d


@pytest.fixture
def fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding as where the library cannot be used: through python-blosc2."""
    monkeypatch.setattr(blosc2_c, "_decoder", [None])


@st.composite
def blocks(draw: st.DrawFn) -> tuple[bytes, int]:
    """Bytes of a few kinds (noise, runs, smooth words) and the item size to plane them."""
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 3000)) * itemsize
    kind = draw(st.sampled_from(["noise", "runs", "ramp"]))
    seed = draw(st.integers(0, 2**32 - 1))
    if kind == "noise":
        data = bytes(draw(st.binary(min_size=n, max_size=n)))
    elif kind == "runs":
        data = bytes((seed >> (i // 97 % 24)) & 0xFF for i in range(n))
    else:
        data = bytes((i * (seed % 7 + 1) // itemsize) & 0xFF for i in range(n))
    return data, itemsize


@settings(max_examples=60, deadline=None)
@given(blocks(), st.sampled_from(["bytes", "writable", "readonly"]))
def test_the_c_decoder_decodes_what_python_blosc2_does(
    c_decoder: blosc2_c.Decoder, block: tuple[bytes, int], given_as: str
) -> None:
    raw, itemsize = block
    packed = bytes(compress_block(BLOSC2, memoryview(raw), itemsize))
    oracle = bytearray(len(raw))
    blosc2.decompress2(packed, dst=oracle)
    assert bytes(oracle) == raw
    src: bytes | memoryview = packed
    if given_as == "writable":
        src = memoryview(bytearray(packed))
    elif given_as == "readonly":
        src = memoryview(packed)
    assert c_decoder.sizes(src) == (len(raw), len(packed))
    out = bytearray(len(raw))
    c_decoder.decompress(src, memoryview(out))
    assert bytes(out) == raw


@settings(max_examples=60, deadline=None)
@given(blocks(), st.data())
def test_a_damaged_block_is_a_value_error_from_both_decoders(
    c_decoder: blosc2_c.Decoder, block: tuple[bytes, int], data: st.DataObject
) -> None:
    raw, itemsize = block
    packed = bytearray(compress_block(BLOSC2, memoryview(raw), itemsize))
    how = data.draw(st.sampled_from(["flip", "truncate", "garbage"]))
    if how == "flip":
        at = data.draw(st.integers(0, len(packed) - 1))
        packed[at] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        del packed[data.draw(st.integers(32, max(32, len(packed) - 1))) :]
    else:
        packed[16:] = data.draw(st.binary(min_size=16, max_size=200))
    outcomes = []
    for d in (c_decoder, None):
        out = bytearray(len(raw))
        blosc2_c._decoder[:] = [d]
        try:
            decompress_block(BLOSC2.id, bytes(packed), memoryview(out), itemsize)
            outcomes.append(bytes(out))
        except ValueError:
            outcomes.append(None)
        finally:
            blosc2_c._decoder[:] = [c_decoder]
    # A block either decodes to the same bytes both ways, or is refused both ways (the
    # frame's sums catch a flip that still decodes; here only the codec is asked).
    assert outcomes[0] == outcomes[1]
    # A refused block leaves nothing behind in the thread's decoder: the next one decodes.
    good = bytearray(len(raw))
    c_decoder.decompress(bytes(compress_block(BLOSC2, memoryview(raw), itemsize)), memoryview(good))
    assert bytes(good) == raw


def test_a_block_that_lies_about_its_size_is_refused_before_decoding(
    c_decoder: blosc2_c.Decoder,
) -> None:
    raw = bytes(range(256)) * 64
    packed = bytes(compress_block(BLOSC2, memoryview(raw), 4))
    for size in (len(raw) - 4, len(raw) + 4):
        with pytest.raises(ValueError, match="claims 16384 raw bytes"):
            decompress_block(BLOSC2.id, packed, memoryview(bytearray(size)), 4)
    with pytest.raises(ValueError, match="shorter than its header"):
        decompress_block(BLOSC2.id, packed[:20], memoryview(bytearray(len(raw))), 4)


def test_threads_decode_at_once_each_with_its_own_context(c_decoder: blosc2_c.Decoder) -> None:
    raws = [bytes((i * k) & 0xFF for i in range(1 << 16)) for k in range(1, 9)]
    packed = [bytes(compress_block(BLOSC2, memoryview(r), 4)) for r in raws]
    outs = [bytearray(len(r)) for r in raws]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(20):
                c_decoder.decompress(packed[k], memoryview(outs[k]))
        except BaseException as e:  # reported below, from the test's own thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(raws))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert [bytes(o) for o in outs] == raws


def test_without_the_library_decoding_falls_back_to_python_blosc2(fallback: None) -> None:
    raw = bytes(range(256)) * 64
    packed = bytes(compress_block(BLOSC2, memoryview(raw), 4))
    out = bytearray(len(raw))
    decompress_block(BLOSC2.id, packed, memoryview(out), 4)
    assert bytes(out) == raw


@pytest.mark.parametrize("why", ["unknown major version", "probe decodes wrong", "turned off"])
def test_a_library_that_is_not_trusted_is_not_used(
    monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    if blosc2_c._library() is None:
        pytest.skip("no C-Blosc2 library beside python-blosc2 here")
    monkeypatch.setattr(blosc2_c, "_decoder", [])
    if why == "unknown major version":
        monkeypatch.setattr(blosc2_c, "_MAJORS", frozenset({99}))
    elif why == "probe decodes wrong":
        monkeypatch.setattr(blosc2_c, "_PROBE_RAW", bytes(512))
    else:
        monkeypatch.setenv("WEIGHTVAULT_BLOSC2_CTYPES", "0")
    assert blosc2_c.decoder() is None
    raw = bytes(range(256)) * 64
    out = bytearray(len(raw))
    decompress_block(
        BLOSC2.id, bytes(compress_block(BLOSC2, memoryview(raw), 4)), memoryview(out), 4
    )
    assert bytes(out) == raw  # through python-blosc2


_RESUME = """
import json, sys, torch
from torch import nn
from weightvault import Vault
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
with torch.no_grad():  # bf16's precision: whole weights that compress, so a load decodes
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).float())
if sys.argv[2] == "save":
    vault = Vault(sys.argv[1])
    vault.save(model)
    vault.compact()  # settled: the newest compressed
    vault.wait()
else:
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    Vault(sys.argv[1]).load(other)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  other.state_dict().values()))
    print(json.dumps({"same": same, "blosc2 imported": "blosc2" in sys.modules}))
"""


def test_a_resume_in_a_new_process_decodes_without_importing_python_blosc2(
    tmp_path: Path,
) -> None:
    if blosc2_c._library() is None:
        pytest.skip("no C-Blosc2 library beside python-blosc2 here")
    script = tmp_path / "resume.py"
    script.write_text(_RESUME)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    env.pop("WEIGHTVAULT_BLOSC2_CTYPES", None)
    run = [sys.executable, str(script), str(tmp_path / "v")]
    subprocess.run([*run, "save"], env=env, check=True, timeout=120)
    from weightvault import Vault
    from weightvault._vault.objects.frame import MAGIC

    heads = [p.read_bytes()[:10] for p in (tmp_path / "v" / "objects").rglob("*") if p.is_file()]
    assert sum(h[:8] == MAGIC and h[9] == BLOSC2.id for h in heads) == 2  # both weights
    assert Vault(tmp_path / "v").verify().ok
    for off in ("1", "0"):
        env["WEIGHTVAULT_BLOSC2_CTYPES"] = off
        done = subprocess.run(
            [*run, "load"], env=env, check=True, timeout=120, capture_output=True, text=True
        )
        got = json.loads(done.stdout.strip().splitlines()[-1])
        assert got == {"same": True, "blosc2 imported": off == "0"}
