"""Compressed vault objects, and weights-only history (issues 20 and 27).

Every object stays named by the blake3 of its raw bytes whatever its file holds, so the
oracles are the raw bytes themselves: loads must give them back bitwise, ``verify`` must
hash them, and a plain safetensors reader must read exports. A vault written before
objects were compressed (``tests/fixtures/legacy_vault``) must keep loading.
"""

from __future__ import annotations

import json
import shutil
import struct
import threading
from pathlib import Path
from typing import Any

import blake3
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import weightvault._vault.writing.commit as commit_module  # noqa: E402
from _vault_workers import assert_bitwise, build, snapshot  # noqa: E402
from weightvault import TrainingStateError, Vault  # noqa: E402
from weightvault._file.layout import is_training  # noqa: E402
from weightvault._vault.objects.encoding import SMALL, Encoder  # noqa: E402
from weightvault._vault.objects.frame import HEADER_SIZE, MAGIC, parse_frame_header  # noqa: E402

# These tests poke objects/ by path: packs have their own (test_vault_packs.py).
pytestmark = pytest.mark.usefixtures("loose_saves")

FIXTURE = Path(__file__).with_name("fixtures") / "legacy_vault"


def object_file(root: Path, digest: str) -> Path:
    return root / "objects" / digest[:2] / digest


def _objects(root: Path, name: str) -> dict[str, str]:
    return json.loads((root / "checkpoints" / f"{name}.json").read_text())["objects"]


def frames(root: Path, name: str) -> dict[str, Any]:
    """``{stored tensor: frame header or None (raw)}`` of checkpoint ``name``."""
    doc = json.loads((root / "checkpoints" / f"{name}.json").read_text())
    out = {}
    for stored, digest in doc["objects"].items():
        head = object_file(root, digest).read_bytes()[:HEADER_SIZE]
        out[stored] = parse_frame_header(memoryview(head)) if head[:8] == MAGIC else None
    return out


def trained(steps: int, seed: int = 0, width: int = 64) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        step(model, opt)
    return model, opt


def coarse(model: nn.Module) -> nn.Module:
    """``model`` with its weights rounded to bf16 precision (kept fp32): the low half of
    each float zero, so they compress to about half, as bf16-trained weights do. Weights
    of trained precision (about 0.9) stay raw: every read of a delta reads its anchor."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def step(model: nn.Module, opt: Any) -> None:
    x = torch.randn(8, model[0].in_features)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def optimizer_state(opt: Any) -> dict[str, torch.Tensor]:
    return {
        f"{i}/{k}": v.clone()
        for i, st in opt.state_dict()["state"].items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }


# -- vaults written before this change --------------------------------------------------


def legacy(tmp_path: Path) -> tuple[Path, dict[str, dict[str, str]]]:
    root = tmp_path / "legacy"
    shutil.copytree(FIXTURE, root)
    expected = json.loads(FIXTURE.with_name("legacy_vault.expected.json").read_text())
    return root, expected


def fixture_model() -> nn.Module:
    m = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 4), nn.Linear(4, 6, bias=False))
    m[2].weight = m[0].weight
    m[1].bias.requires_grad_(False)
    return m


def fixture_optimizer(m: nn.Module) -> Any:
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)


def test_a_vault_written_before_compression_loads_bitwise_and_verifies(tmp_path: Path) -> None:
    root, expected = legacy(tmp_path)
    vault = Vault(root)
    assert vault.verify().ok
    assert [r.name for r in vault.list()] == ["step-1", "step-2", "dcp"]
    for name in ("step-1", "step-2", "dcp"):
        model = fixture_model()
        opt = fixture_optimizer(model)
        if name == "dcp":  # saved by plain dcp.save under "model."
            vault.load(model, name, rules=[("model.*", "*")])
        else:
            vault.load(model, name, optimizer=opt)
        for key, value in model.state_dict().items():
            assert value.numpy().tobytes().hex() == expected[name][f"model/{key}"], (name, key)
        if name != "dcp":
            for key, value in optimizer_state(opt).items():
                assert value.numpy().tobytes().hex() == expected[name][f"optim/{key}"], key
    # Every object there is raw bytes (no frame), as the old code wrote them.
    assert all(f is None for f in frames(root, "step-2").values())


def test_new_compressed_saves_into_an_old_vault_keep_both_loadable(tmp_path: Path) -> None:
    root, expected = legacy(tmp_path)
    vault = Vault(root)
    model = fixture_model()
    opt = fixture_optimizer(model)
    vault.load(model, "step-2", optimizer=opt)
    with torch.no_grad():
        model[1].weight.add_(0.001)
    vault.save(model, "step-3", optimizer=opt)
    vault.gc()
    assert vault.verify().ok
    for name in ("step-1", "step-2"):
        fresh = fixture_model()
        vault.load(fresh, name)
        got = {k: v.numpy().tobytes().hex() for k, v in fresh.state_dict().items()}
        assert got == {k[6:]: v for k, v in expected[name].items() if k.startswith("model/")}


# -- compressed objects ------------------------------------------------------------------


def test_objects_are_compressed_named_by_their_raw_bytes_and_export_plain(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model, opt = trained(3, width=128)
    vault = Vault(tmp_path / "v")
    rec = vault.save(model, optimizer=opt)
    assert rec.written_bytes == rec.new_bytes  # a save writes raw bytes: least work
    vault.compact()  # settled: the newest's objects compressed too (wait leaves them raw)
    with vault.open("latest") as ckpt:
        for stored, digest in ckpt.objects.items():
            raw = ckpt.raw(stored)
            assert blake3.blake3(raw).hexdigest() == digest  # the name is the raw bytes'
            on_disk = object_file(tmp_path / "v", digest).stat().st_size
            if raw.nbytes >= SMALL and is_training(stored):  # moments compress
                assert on_disk < 0.95 * raw.nbytes, stored
            else:
                # Weights of about 0.9 stay raw: the newest is read by every resume and is
                # the anchor of the deltas after it. A bias stays raw: decoding it would
                # cost a load more than it saves.
                assert on_disk == raw.nbytes, stored
    assert (
        sum(f.stat().st_size for f in (tmp_path / "v" / "objects").rglob("*") if f.is_file())
        < 0.95 * rec.new_bytes
    )
    assert vault.verify().ok
    out = tmp_path / "plain.safetensors"
    vault.export("latest", out)
    plain, want = load_file(str(out)), snapshot(model)
    assert_bitwise({k: plain[k] for k in want}, want)
    fresh, fresh_opt = trained(0, seed=5, width=128)
    vault.load(fresh, "latest", optimizer=fresh_opt)
    assert_bitwise(snapshot(fresh), snapshot(model))
    assert_bitwise(optimizer_state(fresh_opt), optimizer_state(opt))


def test_compression_none_writes_raw_objects(tmp_path: Path) -> None:
    model = build(1, width=64)
    vault = Vault(tmp_path, compression=None)
    rec = vault.save(model)
    assert rec.written_bytes == rec.new_bytes
    assert all(f is None for f in frames(tmp_path, rec.name).values())
    vault.save(build(2, width=64))  # changed head: still raw, no delta
    assert all(f is None for f in frames(tmp_path, "000002").values())


def test_an_unknown_compression_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown compression 'lz77'"):
        Vault(tmp_path, compression="lz77")


def test_raw_bytes_that_look_like_a_frame_are_stored_unambiguously(tmp_path: Path) -> None:
    """A tensor whose bytes start with the frame magic and do not compress."""
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    noise[:8] = torch.tensor(list(MAGIC), dtype=torch.uint8)
    for compression in ("blosc2", None):
        vault = Vault(tmp_path / str(compression), compression=compression)
        vault.save({"w": noise})
        with vault.open("latest") as ckpt:
            assert bytes(ckpt.raw("w")) == noise.numpy().tobytes()
        assert vault.verify().ok


def test_dcp_chunks_stay_raw_and_a_compressed_chunk_still_reads_by_range(
    tmp_path: Path,
) -> None:
    # DCP loads read each rank's ranges straight into the destination tensors, so the
    # writer keeps chunks raw; a chunk stored compressed (as a vault may hold one) is
    # still read, range by range, through its frame.
    pytest.importorskip("torch.distributed.checkpoint")
    import torch.distributed.checkpoint as dcp

    import weightvault.dcp as wdcp
    from weightvault._vault.objects.codec import CODECS, DEFAULT

    model, _ = trained(2, width=128)
    state = {"model": model.state_dict()}
    with pytest.warns(UserWarning):
        dcp.save(state, storage_writer=wdcp.VaultWriter(tmp_path, "d"), no_dist=True)
    doc = json.loads((tmp_path / "checkpoints" / "d.json").read_text())
    record = doc["dcp"]
    tensors = record.get("tensors") or {}
    digests = [c[2] for t in tensors.values() for c in t["chunks"]]
    if not digests:  # per-rank tables: every object but the tables is a chunk
        digests = [p.name for p in (tmp_path / "objects").rglob("*") if p.is_file()]
    raw = [d for d in digests if object_file(tmp_path, d).read_bytes()[:8] != MAGIC]
    assert raw, "DCP chunks are stored raw"
    reframed = 0
    for digest in raw:
        data = object_file(tmp_path, digest).read_bytes()
        framed = b"".join(Encoder(CODECS[DEFAULT]).encode_parts(digest, data))
        if bytes(framed[:8]) == MAGIC:
            object_file(tmp_path, digest).write_bytes(bytes(framed))
            reframed += 1
    assert reframed, "no chunk compressed: the test reads no frame"
    fresh, _ = trained(0, seed=4, width=128)
    target = {"model": fresh.state_dict()}
    with pytest.warns(UserWarning):
        dcp.load(target, storage_reader=wdcp.VaultReader(tmp_path, "d"), no_dist=True)
    assert_bitwise(snapshot(fresh), snapshot(model))
    assert Vault(tmp_path).verify().ok


# -- weights-only history ------------------------------------------------------------------


def test_retain_training_state_last_keeps_weights_and_resumes_bitwise(tmp_path: Path) -> None:
    model, opt = trained(1)
    vault = Vault(tmp_path)
    saved = []
    for _ in range(4):
        step(model, opt)
        vault.save(model, optimizer=opt, rng=True)
        saved.append(snapshot(model))
    before = vault.disk_bytes()
    assert vault.retain(training_state_last=1) == []
    assert [r.weights_only for r in vault.list()] == [True, True, True, False]
    assert vault.gc() > 0 and vault.disk_bytes() < before
    assert vault.verify().ok
    for rec, weights in zip(vault.list(), saved, strict=True):
        fresh, _ = trained(0, seed=7)
        vault.load(fresh, rec.name)
        assert_bitwise(snapshot(fresh), weights)
    fresh, fresh_opt = trained(0, seed=7)
    with pytest.raises(TrainingStateError, match=r"000002\.json holds weights only"):
        vault.load(fresh, "000002", optimizer=fresh_opt)

    # Resume from the newest in a fresh vault object: the next step matches bitwise.
    fresh, fresh_opt = trained(0, seed=7)
    Vault(tmp_path).load(fresh, "latest", optimizer=fresh_opt, rng=True)
    torch.manual_seed(123)
    step(model, opt)
    torch.manual_seed(123)
    step(fresh, fresh_opt)
    assert_bitwise(snapshot(fresh), snapshot(model))
    assert_bitwise(optimizer_state(fresh_opt), optimizer_state(opt))


def test_the_vault_option_drops_old_training_state_at_each_save(tmp_path: Path) -> None:
    model, opt = trained(1)
    vault = Vault(tmp_path, training_state_last=2)
    for _ in range(4):
        step(model, opt)
        vault.save(model, optimizer=opt)
    assert [r.weights_only for r in vault.list()] == [True, True, False, False]
    vault.gc()
    names = {n for r in vault.list() for n in frames(tmp_path, r.name)}
    assert any(n.startswith("__weightvault__.train/") for n in names)
    # Deltas point back: the newest training state is whole, so the dropped state is
    # nobody's base and gc freed it.
    for stored, f in frames(tmp_path, vault.list()[-1].name).items():
        if stored.startswith("__weightvault__.train/") and f is not None:
            assert f.base is None, stored
    kept = {d for r in vault.list() for d in _objects(tmp_path, r.name).values()}
    on_disk = {p.name for p in (tmp_path / "objects").rglob("*") if p.is_file()}
    bases = {f.base for r in vault.list() for f in frames(tmp_path, r.name).values() if f}
    assert on_disk == kept | (bases - {None})
    assert vault.verify().ok


# -- background saves ----------------------------------------------------------------------


def test_a_background_save_compresses_off_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: set[str] = set()
    real = Encoder.encode_parts

    def spy(self: Encoder, digest: str, data: Any) -> Any:
        threads.add(threading.current_thread().name)
        return real(self, digest, data)

    monkeypatch.setattr(Encoder, "encode_parts", spy)
    model, opt = trained(1, width=128)
    vault = Vault(tmp_path)
    handle = vault.save(model, optimizer=opt, background=True)
    expected = snapshot(model)
    step(model, opt)  # training goes on while the save compresses
    handle.wait()
    assert threads and threading.current_thread().name not in threads
    fresh, _ = trained(0, seed=2, width=128)
    vault.load(fresh, "latest")
    assert_bitwise(snapshot(fresh), expected)


def test_the_default_store_missing_compresses_without_deltas(tmp_path: Path) -> None:
    """What weightvault.dcp's writer gets: frames, never deltas."""
    vault = Vault(tmp_path, create=True)
    raw = memoryview(torch.linspace(0, 1, 1 << 14).numpy().tobytes())
    digest = blake3.blake3(raw).hexdigest()
    written = commit_module.store_missing(vault.store, {digest: (raw.nbytes, lambda: raw)})
    head = object_file(tmp_path, digest).read_bytes()
    assert written == {digest: len(head)} and head[:8] == MAGIC
    assert struct.unpack_from("<B", head, 11)[0] == 0  # kind: a full object, not a delta


def test_keras_model_round_trips_through_a_compressed_vault(tmp_path: Path) -> None:
    keras = pytest.importorskip("keras")
    import numpy as np

    def build_keras(seed: int) -> Any:
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((32,))
        return keras.Model(inputs, keras.layers.Dense(8)(keras.layers.Dense(64)(inputs)))

    model = build_keras(0)
    vault = Vault(tmp_path)
    vault.save(model)
    for _ in range(2):
        for w in model.weights:
            w.assign(w.numpy() * 1.001)
        vault.save(model)
    vault.wait()
    fresh = build_keras(1)
    vault.load(fresh, "latest")
    for a, b in zip(fresh.weights, model.weights, strict=True):
        assert np.array_equal(a.numpy().view(np.uint8), b.numpy().view(np.uint8)), a.path
    # The oldest is the anchor, the one after it a delta on the oldest's objects; the
    # newest is whole.
    first = _objects(tmp_path, "000001")
    assert all(f is None or not f.base for f in frames(tmp_path, "000001").values())
    second = frames(tmp_path, "000002")
    assert any(f is not None and f.base for f in second.values())
    assert all(f.base == first[k] for k, f in second.items() if f is not None and f.base)
    assert all(f is None or not f.base for f in frames(tmp_path, "000003").values())
    assert vault.verify().ok


def test_jax_pytree_round_trips_through_a_compressed_vault(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    tree = {"dense": {"kernel": jnp.linspace(-1, 1, 64 * 64).reshape(64, 64)}}
    vault = Vault(tmp_path)
    vault.save(tree)
    tree2 = {"dense": {"kernel": tree["dense"]["kernel"] * 1.001}}
    vault.save(tree2)
    vault.wait()
    like = {"dense": {"kernel": jnp.zeros((64, 64))}}
    got, _ = vault.load(like, "latest")
    assert np.array_equal(np.asarray(got["dense"]["kernel"]), np.asarray(tree2["dense"]["kernel"]))
    assert vault.verify().ok
    first = _objects(tmp_path, "000001")["dense.kernel"]
    assert object_file(tmp_path, first).stat().st_size < 64 * 64 * 4


def test_decoded_objects_outlive_the_checkpoint_that_staged_them(tmp_path: Path) -> None:
    # stage() decodes the objects it keeps into one shared mapping; a view of it that a
    # caller still holds must keep its bytes after the checkpoint is closed.
    model, _ = trained(0, width=512)  # 1 MiB weights: enough to decode into the mapping
    coarse(model)  # compressible: stored compressed, so the load decodes
    vault = Vault(tmp_path / "v")
    rec = vault.save(model)
    vault.compact()  # the newest compressed, so the load decodes
    assert any(f is not None for f in frames(tmp_path / "v", rec.name).values())
    with vault.open("latest") as ckpt:
        names = list(ckpt.stored)
        ckpt.stage(names, verify=True)
        views = {name: ckpt.raw(name) for name in names}
    for name, view in views.items():
        got = torch.frombuffer(bytearray(view), dtype=torch.float32)
        assert torch.equal(got, model.state_dict()[name].flatten()), name


@pytest.mark.parametrize("before", [False, True])
def test_a_load_leaves_blosc2s_gil_switch_as_it_found_it(
    tmp_path: Path, before: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decoding through python-blosc2 (where C-Blosc2's library cannot be called
    # directly) turns its process-wide set_releasegil on while it runs; the caller's own
    # setting must come back afterwards, whatever it was.
    import blosc2

    from weightvault._vault.objects import blosc2_c

    monkeypatch.setattr(blosc2_c, "_decoder", [None])

    model, _ = trained(0, width=256)
    coarse(model)  # compressible: stored compressed, so the load decodes
    vault = Vault(tmp_path / "v")
    vault.save(model)
    vault.compact()  # the newest compressed, so the load decodes
    assert any(f is not None for f in frames(tmp_path / "v", vault.resolve()).values())
    blosc2.set_releasegil(before)
    try:
        vault.load(trained(0, seed=1, width=256)[0])
        assert blosc2.set_releasegil(False) is before
    finally:
        blosc2.set_releasegil(False)
