"""A single file's header is sealed by its own checksum, checked by every read.

The tensors' bytes have their xxh3 sums in the manifest; the header that holds those sums,
and the optimizer's hyperparameters, the scheduler, the step counters, the RNG states, the
metadata and the ties, carries ``weightvault.header_sum`` (docs/format.md). A load checks
it before anything is assigned, whatever ``verify=`` says, and so do ``inspect``, ``diff``,
``convert`` and ``verify``. Files written before header sums load as they did.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import weightvault  # noqa: E402
import weightvault.numpy as wvn  # noqa: E402
import weightvault.torch as wvt  # noqa: E402
from weightvault._cli.app import main  # noqa: E402
from weightvault._file.header import HEADER_SUM_KEY, SEAL_PREFIX, header_sum, read_header  # noqa: E402
from weightvault._file.manifest import read_manifest  # noqa: E402

LR = 0.001234


# -- a training checkpoint: model, AdamW, LambdaLR and RNG state ----------------------------


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    lr = LR if seed == 0 else 0.5
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))
    return model, opt, sched


def train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=g)).square().mean().backward()
        opt.step()
        sched.step()


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """Leave the process' torch, numpy and Python RNG as they were (loads restore them)."""
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


def _saved() -> bytes:
    with kept_rng(), tempfile.TemporaryDirectory() as d:
        model, opt, sched = build(0)
        train(model, opt, sched, 3)
        torch.manual_seed(123)
        np.random.seed(456)
        random.seed(789)
        path = Path(d) / "ckpt.safetensors"
        wvt.save(model, path, optimizer=opt, scheduler=sched, rng=True, metadata={"run": "a"})
        return path.read_bytes()


_SAVED: bytes | None = None


def saved() -> bytes:
    """The checkpoint's bytes, saved once per process (Hypothesis calls this often)."""
    global _SAVED
    if _SAVED is None:
        _SAVED = _saved()
    return _SAVED


def header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def unsealed(data: bytes) -> bytes:
    """``data`` as weightvault wrote it before header sums: no sum, manifest version 1.

    The old writer's bytes exactly: the same JSON with the first entry and the version
    digit changed, padded to 8 bytes again (the data section here is under 16 MiB).
    """
    end = header_end(data)
    doc = json.loads(data[8:end])
    meta = doc["__metadata__"]
    del meta[HEADER_SUM_KEY]
    assert meta["weightvault"].startswith('{"version":2,')
    meta["weightvault"] = '{"version":1,' + meta["weightvault"][len('{"version":2,') :]
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body + data[end:]


def snapshot(model: nn.Module, opt: Any, sched: Any) -> dict[str, Any]:
    """Everything a load may change, the RNG states included, as comparable values."""
    return {
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": _copy(opt.state_dict()),
        "scheduler": _copy({k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}),
        "rng": (torch.get_rng_state(), np.random.get_state(), random.getstate()),
    }


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy(v) for v in value)
    return value


def same(a: Any, b: Any) -> bool:
    """Exact equality through tensors, arrays, dicts and sequences (types included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def load_all(path: Path, *, verify: bool = False) -> tuple[dict[str, Any], Any]:
    """Load ``path`` into a fresh model, optimizer and scheduler, RNG included.

    Returns what the load left (weights, optimizer and scheduler state, the next torch,
    numpy and Python draws) and the error it raised, if any; on an error, it checks that
    the model, optimizer, scheduler and RNG are exactly as before.
    """
    with kept_rng():
        model, opt, sched = build(7)
        train(model, opt, sched, 1)  # state of its own, unlike the file's
        torch.manual_seed(1)
        np.random.seed(2)
        random.seed(3)
        before = snapshot(model, opt, sched)
        try:
            wvt.load(model, path, optimizer=opt, scheduler=sched, rng=True, verify=verify)
        except weightvault.FormatError as e:
            assert same(snapshot(model, opt, sched), before), "a failed load changed state"
            return {}, e
        after = snapshot(model, opt, sched)
        after["draws"] = (torch.rand(3), np.random.random(3), random.random())
        del after["rng"]
        return after, None


def _write(tmp_path: Path, data: bytes, name: str = "ckpt.safetensors") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


# -- the sum round-trips -------------------------------------------------------------------


def test_the_header_carries_its_sum_first_and_it_matches(tmp_path: Path) -> None:
    data = saved()
    raw = data[8 : header_end(data)]
    assert raw.startswith(SEAL_PREFIX)
    meta = json.loads(raw)["__metadata__"]
    assert next(iter(meta)) == HEADER_SUM_KEY
    assert meta[HEADER_SUM_KEY] == header_sum(raw)
    assert json.loads(meta["weightvault"])["version"] == 2
    # The sum is xxh3-128 of the bytes before the data, its own digits read as zeros.
    import xxhash

    zeroed = data[: 8 + len(SEAL_PREFIX)] + b"0" * 32 + data[8 + len(SEAL_PREFIX) + 32 :]
    assert meta[HEADER_SUM_KEY] == xxhash.xxh3_128_hexdigest(zeroed[: header_end(data)])

    path = _write(tmp_path, data)
    report = weightvault.verify(path)
    assert report.ok and report.has_header_sum and report.checked > 0
    assert weightvault.inspect(path).format_version == 2
    loaded, error = load_all(path)
    assert error is None
    assert loaded["optimizer"]["param_groups"][0]["lr"] == pytest.approx(LR / 4)
    assert loaded["optimizer"]["param_groups"][0]["initial_lr"] == LR
    assert _saved() == data  # deterministic: the same state gives the same bytes


def test_a_changed_learning_rate_digit_is_refused_by_every_reader(tmp_path: Path) -> None:
    """The damage that motivated the sum: one digit of the lr in the header's JSON."""
    data = saved()
    at = data.index(b"0.001234")
    bad = _write(tmp_path, data[:at] + b"0.001934" + data[at + 8 :], "bad.safetensors")
    good = _write(tmp_path, data, "good.safetensors")
    pattern = r"bad\.safetensors: the header .* does not match its checksum"
    for verify in (False, True):
        loaded, error = load_all(bad, verify=verify)
        assert isinstance(error, weightvault.ChecksumError), loaded
        assert error is not None and "restore the file from a good copy" in str(error)

    readers: list[Callable[[Path], Any]] = [
        wvt.load_file,
        lambda p: wvt.load_file(p, mmap=True, verify=True),
        wvn.load_file,
        weightvault.inspect,
        lambda p: weightvault.diff(good, p),
        lambda p: weightvault.diff(p, good),
        lambda p: weightvault.convert(p, tmp_path / "out.safetensors"),
    ]
    for read in readers:
        with pytest.raises(weightvault.ChecksumError, match=pattern):
            read(bad)
    assert not (tmp_path / "out.safetensors").exists()
    report = weightvault.verify(bad)
    assert not report.ok and re.search(pattern, report.problems[0])


def test_the_other_adapters_refuse_a_damaged_header(tmp_path: Path) -> None:
    data = saved()
    at = data.index(b'"run":"a"')
    bad = _write(tmp_path, data[:at] + b'"run":"b"' + data[at + 9 :])
    with pytest.raises(weightvault.ChecksumError, match="the header"):
        wvn.load({"0.weight": np.zeros((8, 4), np.float32)}, bad, strict=False)
    keras = pytest.importorskip("keras")
    import weightvault.keras as wvk

    with pytest.raises(weightvault.ChecksumError, match="the header"):
        wvk.load_file(bad)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    kpath = tmp_path / "k.safetensors"
    wvk.save(model, kpath)
    kdata = kpath.read_bytes()
    at = kdata.index(b'"shape":[3]')
    _write(tmp_path, kdata[:at] + b'"shape":[4]' + kdata[at + 11 :], "k.safetensors")
    before = [np.array(w) for w in model.get_weights()]
    with pytest.raises(weightvault.ChecksumError, match="the header"):
        wvk.load(model, kpath)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    jax = pytest.importorskip("jax")
    import weightvault.jax as wvj

    assert jax is not None
    with pytest.raises(weightvault.ChecksumError, match="the header"):
        wvj.load_file(bad)


def test_the_cli_refuses_a_damaged_header(tmp_path: Path, capsys: Any) -> None:
    data = saved()
    at = data.index(b"0.001234")
    bad = _write(tmp_path, data[:at] + b"0.001934" + data[at + 8 :], "bad.safetensors")
    good = _write(tmp_path, data, "good.safetensors")
    out = io.StringIO()
    assert main(["verify", str(bad)], out=out) == 1
    assert "DAMAGED" in out.getvalue() and "does not match its checksum" in out.getvalue()
    out = io.StringIO()
    assert main(["verify", str(good)], out=out) == 0
    assert "OK" in out.getvalue() and "no header sum" not in out.getvalue()
    for argv in (
        ["inspect", str(bad)],
        ["diff", str(good), str(bad)],
        ["convert", str(bad), str(tmp_path / "c.safetensors")],
    ):
        capsys.readouterr()
        assert main(argv, out=io.StringIO()) == 3, argv  # an input that cannot be read
        assert "does not match its checksum" in capsys.readouterr().err, argv
    assert not (tmp_path / "c.safetensors").exists()


# -- plain readers see a plain safetensors file ----------------------------------------------


def test_plain_safetensors_opens_the_sealed_file(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = _write(tmp_path, saved())
    ours = wvt.load_file(path)
    theirs = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["run"] == "a"
        assert len(f.metadata()[HEADER_SUM_KEY]) == 32
        assert sorted(f.keys()) == sorted(theirs)
    model, *_ = build(0)
    for name in model.state_dict():
        assert torch.equal(theirs[name], ours[name]), name


def test_transformers_opens_a_sealed_gpt2(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    wvt.save(model, tmp_path / "model.safetensors")
    config.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes()[8:].startswith(SEAL_PREFIX)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


# -- no one-byte change passes: Hypothesis and an exhaustive sweep ---------------------------


@st.composite
def one_byte_changed(draw: st.DrawFn) -> tuple[int, bytes]:
    data = bytearray(saved())
    at = draw(st.integers(0, header_end(data) - 1))
    new = draw(st.sampled_from(b'0123456789abcdef-[]{}",:.eE \t') | st.integers(0, 255))
    if new == data[at]:
        new ^= 1
    data[at] = new
    return at, bytes(data)


_EXACT: dict[str, Any] | None = None


def exact() -> dict[str, Any]:
    """What a load of the untouched file leaves: the oracle of every damaged load."""
    global _EXACT
    if _EXACT is None:
        with tempfile.TemporaryDirectory() as d:
            _EXACT, error = load_all(_write(Path(d), saved()))
            assert error is None
    return _EXACT


PROPERTY = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@PROPERTY
@given(case=one_byte_changed())
def test_any_one_byte_change_of_the_header_is_an_error_or_an_exact_load(
    tmp_path: Path, case: tuple[int, bytes]
) -> None:
    at, data = case
    loaded, error = load_all(_write(tmp_path, data))
    if error is None:
        assert same(loaded, exact()), f"byte {at} changed what the load returns"


@PROPERTY
@given(case=one_byte_changed())
def test_verify_reports_every_header_change_a_load_refuses(
    tmp_path: Path, case: tuple[int, bytes]
) -> None:
    at, data = case
    path = _write(tmp_path, data)
    _, error = load_all(path)
    report = weightvault.verify(path)
    if error is not None:
        assert not report.ok, f"verify passed byte {at}, which a load refuses ({error})"
        assert str(error) in report.problems
    else:
        assert report.ok and report.has_header_sum


def _opens(data: bytes) -> bool:
    """Whether the file's header and manifest read, as SafetensorsFile reads them."""
    try:
        header = read_header(io.BytesIO(data), "x")
        read_manifest(header.metadata, header.tensors, "x", sealed=header.sealed)
    except weightvault.FormatError:
        return False
    return True


def test_every_byte_of_the_header_is_covered() -> None:
    """Each byte before the data, changed two ways, makes the file unreadable: nothing in
    a sealed header can change unnoticed, not its length, padding, keys or sum."""
    data = saved()
    assert _opens(data)
    passed = []
    for at in range(header_end(data)):
        for mask in (0x01, 0x24):
            changed = bytearray(data)
            changed[at] ^= mask
            if _opens(bytes(changed)):
                passed.append((at, mask))
    assert passed == []


# -- the version rule: a sealed file cannot pass as an unsealed one ---------------------------


def _edited(data: bytes, edit: Callable[[dict[str, Any]], None], *, seal: bool) -> bytes:
    end = header_end(data)
    doc = json.loads(data[8:end])
    edit(doc)
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(8 + len(body)) % 8)
    out = struct.pack("<Q", len(body)) + body + data[end:]
    if seal:
        at = 8 + len(SEAL_PREFIX)
        out = out[:at] + header_sum(body).encode() + out[at + 32 :]
    return out


def _set_version(version: int) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        manifest = json.loads(doc["__metadata__"]["weightvault"])
        manifest["version"] = version
        doc["__metadata__"]["weightvault"] = json.dumps(manifest, separators=(",", ":"))

    return edit


def _drop_sum(doc: dict[str, Any]) -> None:
    del doc["__metadata__"][HEADER_SUM_KEY]


def _move_sum(doc: dict[str, Any]) -> None:
    meta = doc["__metadata__"]
    meta[HEADER_SUM_KEY] = meta.pop(HEADER_SUM_KEY)


@pytest.mark.parametrize(
    ("edit", "seal", "pattern"),
    [
        (_set_version(1), True, r"carries a checksum .* but its manifest is version 1"),
        (_drop_sum, False, r"lacks the checksum .* every file of manifest version 2"),
        (_move_sum, False, r"not as the header's first entry"),
        (_set_version(3), True, r"manifest version '3' is not supported.*upgrade"),
    ],
    ids=["sealed-v1", "unsealed-v2", "sum-moved", "future-version"],
)
def test_the_version_and_the_sum_must_agree(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None], seal: bool, pattern: str
) -> None:
    path = _write(tmp_path, _edited(saved(), edit, seal=seal))
    _, error = load_all(path)
    assert isinstance(error, weightvault.FormatError) and re.search(pattern, str(error)), error
    assert not weightvault.verify(path).ok


def test_the_sum_key_is_reserved(tmp_path: Path) -> None:
    with pytest.raises(weightvault.ReservedNameError, match=HEADER_SUM_KEY):
        wvt.save({"w": torch.zeros(2)}, tmp_path / "x.safetensors", metadata={HEADER_SUM_KEY: "x"})
    # An alias named like it stays in the manifest, and the sum stays the header's first.
    shared = torch.zeros(2)
    wvt.save({"w": shared, HEADER_SUM_KEY: shared}, tmp_path / "t.safetensors")
    loaded = wvt.load_file(tmp_path / "t.safetensors")
    assert loaded[HEADER_SUM_KEY] is loaded["w"]
    assert weightvault.verify(tmp_path / "t.safetensors").has_header_sum


# -- files written before header sums --------------------------------------------------------


def test_an_old_file_without_a_sum_loads_bitwise_and_verify_says_so(tmp_path: Path) -> None:
    old = _write(tmp_path, unsealed(saved()), "old.safetensors")
    assert b"header_sum" not in old.read_bytes()
    loaded, error = load_all(old)
    assert error is None and same(loaded, exact())
    report = weightvault.verify(old)
    assert report.ok and not report.has_header_sum and report.checked > 0
    assert weightvault.inspect(old).format_version == 1
    out = io.StringIO()
    assert main(["verify", str(old)], out=out) == 0
    assert "no header sum" in out.getvalue()
    # Its header is not covered: the same digit change loads, as it always did.
    data = old.read_bytes()
    at = data.index(b"0.001234")
    _write(tmp_path, data[:at] + b"0.001934" + data[at + 8 :], "old.safetensors")
    loaded, error = load_all(old)
    assert error is None and loaded["optimizer"]["param_groups"][0]["initial_lr"] == 0.001934


def test_a_plain_safetensors_file_verifies_without_a_header_sum(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(3)}, str(tmp_path / "plain.safetensors"), {"format": "pt"})
    report = weightvault.verify(tmp_path / "plain.safetensors")
    assert report.ok and not report.has_header_sum and not report.has_checksums
    assert torch.equal(wvt.load_file(tmp_path / "plain.safetensors")["w"], torch.ones(3))


def test_a_vault_keeps_unsealed_headers_and_exports_sealed_files(tmp_path: Path) -> None:
    """A record seals the header it holds (manifest version 1); an exported file is a
    file like any other, sealed, and its damaged header refused."""
    model, opt, sched = build(0)
    vault = weightvault.Vault(tmp_path / "vault")
    with kept_rng():
        vault.save(model, optimizer=opt, scheduler=sched, rng=True)
    with vault.open("latest") as ckpt:
        assert ckpt.manifest.version == 1
    restored, *_ = build(3)
    vault.load(restored, "latest")
    for name, value in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], value), name
    path = tmp_path / "exported.safetensors"
    vault.export("latest", path)
    data = path.read_bytes()
    assert data[8:].startswith(SEAL_PREFIX) and weightvault.verify(path).has_header_sum
    at = data.index(b'"shape":[8,4]')
    _write(tmp_path, data[:at] + b'"shape":[4,8]' + data[at + 13 :], "exported.safetensors")
    with pytest.raises(weightvault.ChecksumError, match="the header"):
        wvt.load(restored, path)
