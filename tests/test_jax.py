"""weightvault.jax: Flax NNX modules, Equinox modules and pytrees, checked against real JAX.

Oracles: Flax, optax and Equinox compute the outputs and the optimizer steps; the
``safetensors`` package reads the files; PyTorch runs the cross-framework direction.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import weightvault  # noqa: E402
import weightvault.jax as wvj  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# -- models --------------------------------------------------------------------------------


class Conv(nnx.Module):
    """Seed 004: one 3x3 convolution, no bias, kernel rows [1, 2, 3]."""

    def __init__(self) -> None:
        self.conv = nnx.Conv(1, 1, (3, 3), use_bias=False, padding="VALID", rngs=nnx.Rngs(0))
        self.conv.kernel.set_value(jnp.array([[1.0, 2, 3]] * 3).reshape(3, 3, 1, 1))


class Tied(nnx.Module):
    def __init__(self, seed: int) -> None:
        rngs = nnx.Rngs(seed)
        self.a = nnx.Linear(4, 4, rngs=rngs)
        self.b = nnx.Linear(4, 4, rngs=rngs)
        self.b.kernel = self.a.kernel  # one Variable in two places

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.b(self.a(x))


class Untied(Tied):
    def __init__(self, seed: int) -> None:
        rngs = nnx.Rngs(seed)
        self.a = nnx.Linear(4, 4, rngs=rngs)
        self.b = nnx.Linear(4, 4, rngs=rngs)


class Head(nnx.Module):
    """GPT-2's ``lm_head``: holds the embedding Variable, like ``lm_head.weight = wte.weight``."""

    def __init__(self, weight: nnx.Param) -> None:
        self.weight = weight

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight[...].T


class Attention(nnx.Module):
    """GPT-2's attention with its names (``c_attn``, ``c_proj``), one head, causal."""

    def __init__(self, d: int, rngs: nnx.Rngs) -> None:
        self.c_attn = nnx.Linear(d, 3 * d, rngs=rngs)
        self.c_proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((x.shape[-2], x.shape[-2]), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        return self.c_proj(weights @ v)


class Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs) -> None:
        self.ln_1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = Attention(d, rngs)
        self.ln_2 = nnx.LayerNorm(d, rngs=rngs)
        self.c_fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.c_proj = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(nnx.gelu(self.c_fc(self.ln_2(x))))


class GPT(nnx.Module):
    def __init__(self, seed: int, vocab: int = 50, d: int = 16, layers: int = 2) -> None:
        rngs = nnx.Rngs(seed)
        self.wte = nnx.Embed(vocab, d, rngs=rngs)
        self.wpe = nnx.Embed(8, d, rngs=rngs)
        self.h = nnx.List([Block(d, rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.lm_head = Head(self.wte.embedding)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[-1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class EqxTied(eqx.Module):
    """``eqx.nn.Shared``: an embedding whose matrix is also the output layer's weight."""

    shared: eqx.nn.Shared

    def __init__(self, seed: int) -> None:
        k1, k2 = jax.random.split(jax.random.key(seed))
        emb = eqx.nn.Embedding(10, 4, key=k1)
        out = eqx.nn.Linear(4, 10, key=k2)
        self.shared = eqx.nn.Shared((emb, out), lambda p: p[1].weight, lambda p: p[0].weight)

    def __call__(self, i: jax.Array) -> jax.Array:
        emb, out = self.shared()
        return out(emb(i))


def _values(model: nnx.Module) -> dict[str, np.ndarray]:
    return {
        ".".join(map(str, p)): np.asarray(v[...])
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


# -- seed 004 --------------------------------------------------------------------------------


def _step(model: Conv, optimizer: nnx.Optimizer) -> tuple[float, float]:
    x = jnp.array([[1.0, 2, 3]] * 3).reshape(1, 3, 3, 1)

    def loss(m: Conv) -> jax.Array:
        return m.conv(x).sum()

    before = loss(model)
    grads = nnx.grad(loss, argnums=nnx.DiffState(0, wvj.trainable(model)))(model)
    optimizer.update(model, grads)
    return float(before), float(loss(model))


def test_seed_004_frozen_conv_kernel_never_moves(tmp_path):
    """Seed 004 in JAX: frozen 42 -> 42, trainable 42 -> 41.58, and the flag survives a load."""
    frozen = Conv()
    assert wvj.freeze(frozen, "conv.kernel") == ["conv.kernel"]
    opt = nnx.Optimizer(frozen, optax.sgd(0.01), wrt=wvj.trainable(frozen))
    assert _step(frozen, opt) == (42.0, 42.0)

    free = Conv()
    opt = nnx.Optimizer(free, optax.sgd(0.01), wrt=wvj.trainable(free))
    before, after = _step(free, opt)
    assert before == 42.0 and after == pytest.approx(41.58, abs=1e-5)

    path = tmp_path / "conv.safetensors"
    assert wvj.save(frozen, path).frozen == ["conv.kernel"]
    fresh = Conv()
    same, report = wvj.load(fresh, path, restore_frozen=True)
    assert same is fresh and report.frozen == ["conv.kernel"]
    opt = nnx.Optimizer(fresh, optax.sgd(0.01), wrt=wvj.trainable(fresh))
    assert _step(fresh, opt) == (42.0, 42.0)

    # Without restore_frozen the flag on disk is ignored; unfreeze makes it train again.
    other, report = wvj.load(Conv(), path)
    assert report.frozen == [] and len(nnx.state(other, wvj.trainable(other))) == 1
    assert wvj.unfreeze(fresh) == ["conv.kernel"]
    opt = nnx.Optimizer(fresh, optax.sgd(0.01), wrt=wvj.trainable(fresh))
    assert _step(fresh, opt)[1] == pytest.approx(41.58, abs=1e-5)


def test_frozen_flag_travels_with_clone_and_split():
    model = Tied(0)
    assert wvj.freeze(model, "a.kernel") == ["a.kernel", "b.kernel"]  # both names of one Variable
    for copy in (nnx.clone(model), nnx.merge(*nnx.split(model))):
        names = [
            ".".join(map(str, p))
            for p, _ in nnx.to_flat_state(nnx.state(copy, wvj.trainable(copy)))
        ]
        assert names == ["a.bias", "b.bias"]


# -- sharing --------------------------------------------------------------------------------


def test_tied_nnx_variable_is_stored_once_and_comes_back_shared(tmp_path):
    from safetensors.numpy import load_file as st_load

    model = Tied(0)
    path = tmp_path / "tied.safetensors"
    report = wvj.save(model, path)
    assert report.aliases == {"b.kernel": "a.kernel"}
    assert "b.kernel" not in report.stored and report.bytes_saved >= 4 * 4 * 4
    # A plain safetensors reader sees the stored arrays with the model's values.
    plain = st_load(path)
    np.testing.assert_array_equal(plain["a.kernel"], np.asarray(model.a.kernel[...]))

    fresh = Tied(1)
    assert not np.array_equal(fresh.a.kernel[...], model.a.kernel[...])
    _, rep = wvj.load(fresh, path)
    assert fresh.a.kernel is fresh.b.kernel and rep.untied == []
    x = jnp.ones((2, 4))
    np.testing.assert_array_equal(fresh(x), model(x))


def test_model_holding_tied_names_apart_gets_both_filled_and_reported(tmp_path):
    path = tmp_path / "tied.safetensors"
    wvj.save(Tied(0), path)
    untied = Untied(1)
    _, report = wvj.load(untied, path)
    assert report.untied == [("a.kernel", "b.kernel")]
    assert untied.a.kernel is not untied.b.kernel
    np.testing.assert_array_equal(untied.a.kernel[...], untied.b.kernel[...])


def test_tie_conflict_leaves_model_untouched(tmp_path):
    path = tmp_path / "untied.safetensors"
    wvj.save(Untied(0), path)
    model = Tied(1)
    before = _values(model)
    with pytest.raises(weightvault.TieConflictError, match=r"a\.kernel / b\.kernel"):
        wvj.load(model, path)
    assert all(np.array_equal(v, _values(model)[k]) for k, v in before.items())


def test_gpt2_like_nnx_model_with_tied_embedding(tmp_path):
    from safetensors.flax import load_file as st_flax

    model = GPT(0)
    ids = jnp.array([[1, 5, 7, 3]])
    path = tmp_path / "gpt.safetensors"
    report = wvj.save(model, path)  # the tie alone: equal LN scales stay copies on disk
    assert report.aliases == {"wte.embedding": "lm_head.weight"}
    assert report.bytes_saved == 50 * 16 * 4
    assert sorted(st_flax(path)) == sorted(report.stored)

    fresh = GPT(1)
    assert not np.allclose(fresh(ids), model(ids))
    _, rep = wvj.load(fresh, path, verify=True)
    assert rep.ok and fresh.lm_head.weight is fresh.wte.embedding
    np.testing.assert_allclose(fresh(ids), model(ids), rtol=1e-6)
    # Freezing the embedding through one name freezes the shared Variable under both.
    assert wvj.freeze(fresh, "wte") == ["lm_head.weight", "wte.embedding"]


def test_equinox_shared_round_trip(tmp_path):
    model = EqxTied(0)
    path = tmp_path / "eqx.safetensors"
    report = wvj.save(model, path)
    # Shared keeps one copy in its pytree; its placeholder and callables are not arrays.
    assert report.stored == ["shared.pytree.0.weight", "shared.pytree.1.bias"]
    fresh = EqxTied(1)
    loaded, rep = wvj.load(fresh, path)
    assert rep.ok and loaded is not fresh and isinstance(loaded, EqxTied)
    i = jnp.array(3)
    np.testing.assert_array_equal(loaded(i), model(i))
    assert not np.array_equal(fresh(i), model(i))  # the original is left as it was
    emb, out = loaded.shared()
    assert out.weight is emb.weight


def test_pytree_same_array_twice_is_an_alias_and_stays_shared(tmp_path):
    w = jnp.arange(6.0).reshape(2, 3)
    path = tmp_path / "p.safetensors"
    assert wvj.save({"enc": {"w": w}, "dec": {"w": w}}, path).aliases == {"enc.w": "dec.w"}
    z = jnp.zeros((2, 3))
    tree, report = wvj.load({"enc": {"w": z}, "dec": {"w": z}}, path)
    assert tree["enc"]["w"] is tree["dec"]["w"] and report.untied == []
    np.testing.assert_array_equal(tree["enc"]["w"], w)
    arrays = wvj.load_file(path)
    assert arrays["enc.w"] is arrays["dec.w"] and isinstance(arrays["enc.w"], jax.Array)


# -- across frameworks -----------------------------------------------------------------------


def test_torch_linear_loads_into_nnx_and_back(tmp_path):
    torch = pytest.importorskip("torch")
    import weightvault.torch as wvt

    class Net(nnx.Module):
        def __init__(self, seed: int) -> None:
            self.fc = nnx.Linear(3, 5, rngs=nnx.Rngs(seed))

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.fc(x)

    tnet = torch.nn.Sequential(torch.nn.Linear(3, 5))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    path = tmp_path / "torch.safetensors"
    wvt.save(tnet, path)
    net = Net(0)
    rules = [("0.weight", "fc.kernel"), ("0.*", "fc.*")]
    # A rename alone would put (out, in) numbers into an (in, out) kernel: refused.
    with pytest.raises(weightvault.ShapeMismatchError, match=r"fc\.kernel"):
        wvj.load(net, path, rules=rules)
    _, report = wvj.load(net, path, rules=rules, transforms={"*.kernel": "transpose"})
    assert report.ok and report.renamed == [("0.weight", "fc.kernel"), ("0.bias", "fc.bias")]
    with torch.no_grad():
        expected = tnet(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(net(jnp.asarray(x))), expected, rtol=1e-6)

    # The reverse: an NNX file into a fresh torch Linear.
    back = tmp_path / "nnx.safetensors"
    wvj.save(Net(3), back)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 5))
    rep = wvt.load(
        fresh,
        back,
        rules=[("fc.kernel", "0.weight"), ("fc.*", "0.*")],
        transforms={"*.weight": "transpose"},
    )
    assert rep.ok
    with torch.no_grad():
        got = fresh(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, np.asarray(Net(3)(jnp.asarray(x))), rtol=1e-6)


# -- dtypes and devices ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "name"),
    [
        (jnp.bfloat16, "BF16"),
        (jnp.float8_e4m3fn, "F8_E4M3"),
        (jnp.float8_e5m2, "F8_E5M2"),
        (jnp.float16, "F16"),
        (jnp.int8, "I8"),
        (jnp.bool_, "BOOL"),
    ],
)
def test_narrow_dtypes_round_trip_through_ml_dtypes(tmp_path, dtype, name):
    from safetensors import safe_open

    a = (jnp.arange(12).reshape(3, 4) % 5).astype(dtype)
    path = tmp_path / "d.safetensors"
    wvj.save({"a": a}, path)
    with safe_open(path, "np") as f:
        assert f.get_slice("a").get_dtype() == name
    tree, _ = wvj.load({"a": jnp.zeros((3, 4), dtype)}, path)
    assert tree["a"].dtype == dtype
    np.testing.assert_array_equal(np.asarray(tree["a"]), np.asarray(a))


def _torch_views(torch_dtype_name: str) -> tuple[dict, dict]:
    """Views of one tensor of every bit pattern of ``torch_dtype_name``, saved by torch.

    Returns ``(views, bits)``: the torch views to save, and each view's bit patterns (the
    oracle) as unsigned integers, from torch itself.
    """
    torch = pytest.importorskip("torch")
    dtype = getattr(torch, torch_dtype_name)
    width = torch.tensor([], dtype=dtype).element_size()
    words = {1: torch.uint8, 2: torch.int16}[width]
    # Every bit pattern, NaNs and infinities included: a decoder may not touch one bit.
    count = 256 if width == 1 else 4096
    codes = (torch.arange(count, dtype=torch.int64) * (1 if width == 1 else 16)) % (1 << 8 * width)
    if width == 2:
        codes = torch.where(codes >= 1 << 15, codes - (1 << 16), codes)
    base = codes.to(words).view(dtype).reshape(16, count // 16)
    views = {
        "base": base,
        "t": base.t(),  # a transposed view: strides (1, n)
        "row": base[3],
        "col": base[:, 5],  # a stride-n column
        "steps": base[1::3, 2::5],  # an offset into the storage, two strides
    }
    bits = {k: v.contiguous().view(words).numpy() for k, v in views.items()}
    return views, bits


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).view({1: np.uint8, 2: np.int16}[np.asarray(a).dtype.itemsize])


@pytest.mark.parametrize(
    "dtype",
    ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float16"],
)
def test_narrow_dtype_views_read_bitwise(tmp_path, dtype):
    """Strided views of bf16 and fp8 tensors (saved by torch) read bit for bit."""
    import weightvault.torch as wvt

    views, bits = _torch_views(dtype)
    path = tmp_path / "views.safetensors"
    report = wvt.save(views, path)
    assert set(report.views) >= {"t", "col", "steps"}  # really stored as views
    want = np.dtype(getattr(ml_dtypes, dtype, None) or dtype)
    arrays = wvj.load_file(path)
    for name, expected in bits.items():
        assert arrays[name].dtype == want, name
        np.testing.assert_array_equal(_bits(arrays[name]), expected, err_msg=name)
    tree = {k: jnp.zeros(v.shape, want) for k, v in bits.items()}
    loaded, rep = wvj.load(tree, path)
    assert rep.ok
    for name, expected in bits.items():
        np.testing.assert_array_equal(_bits(loaded[name]), expected, err_msg=name)


def test_default_save_keeps_copies_visible_to_plain_readers(tmp_path):
    """Equal but separate arrays are stored under every name, as torch, Keras and numpy do."""
    from safetensors.numpy import load_file

    tree = {"enc": {"scale": jnp.ones(4)}, "dec": {"scale": jnp.ones(4)}}
    path = tmp_path / "copies.safetensors"
    report = wvj.save(tree, path)
    assert report.copies == {}
    plain = load_file(path)
    assert sorted(plain) == ["dec.scale", "enc.scale"]
    np.testing.assert_array_equal(plain["enc.scale"], np.ones(4, np.float32))
    deduped = tmp_path / "deduped.safetensors"
    assert wvj.save(tree, deduped, dedupe_copies=True).copies == {"enc.scale": "dec.scale"}
    assert sorted(wvj.load_file(deduped)) == ["dec.scale", "enc.scale"]


def test_cast_converts_and_numpy_leaves_stay_numpy(tmp_path):
    path = tmp_path / "f32.safetensors"
    wvj.save({"w": jnp.full((2, 2), 1.5, jnp.float32)}, path)
    with pytest.raises(weightvault.ShapeMismatchError, match="cast=True"):
        wvj.load({"w": jnp.zeros((2, 2), jnp.bfloat16)}, path)
    tree, _ = wvj.load({"w": jnp.zeros((2, 2), jnp.bfloat16)}, path, cast=True)
    assert tree["w"].dtype == jnp.bfloat16 and float(tree["w"][0, 0]) == 1.5
    tree, _ = wvj.load({"w": np.zeros((2, 2), ml_dtypes.bfloat16)}, path, cast=True)
    assert isinstance(tree["w"], np.ndarray) and tree["w"].dtype == ml_dtypes.bfloat16


def test_sharded_array_is_saved_whole_and_loaded_with_its_sharding(tmp_path):
    """On two host devices: a sharded array is gathered to one tensor, and placed back."""
    script = textwrap.dedent(
        """
        import sys
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        import weightvault.jax as wvj
        assert len(jax.devices()) == 2
        mesh = Mesh(np.array(jax.devices()), ("x",))
        sharding = NamedSharding(mesh, P("x"))
        w = jax.device_put(jnp.arange(16.0).reshape(4, 4), sharding)
        path = sys.argv[1]
        wvj.save({"w": w}, path)
        from safetensors.numpy import load_file
        assert load_file(path)["w"].shape == (4, 4)
        tree, _ = wvj.load({"w": jax.device_put(jnp.zeros((4, 4)), sharding)}, path)
        assert tree["w"].sharding == sharding
        np.testing.assert_array_equal(np.asarray(tree["w"]), np.arange(16.0).reshape(4, 4))
        print("ok")
        """
    )
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT / "src"),
    }
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "s.safetensors")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# -- freezing pytrees ------------------------------------------------------------------------


def test_pytree_freeze_mask_drives_optax_and_survives_save_load(tmp_path):
    params = {"enc": {"w": jnp.ones((2, 2))}, "head": {"w": jnp.ones((2,))}}
    assert wvj.freeze(params, "enc") == ["enc.w"]
    mask = wvj.trainable(params)
    assert mask == {"enc": {"w": False}, "head": {"w": True}}
    tx = optax.multi_transform({True: optax.sgd(1.0), False: optax.set_to_zero()}, mask)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    stepped = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(stepped["enc"]["w"], params["enc"]["w"])
    assert float(stepped["head"]["w"][0]) == 0.0
    # The record belongs to the structure, so the stepped tree is still frozen.
    path = tmp_path / "p.safetensors"
    assert wvj.save(stepped, path).frozen == ["enc.w"]
    assert wvj.unfreeze(stepped) == ["enc.w", "head.w"]
    assert wvj.trainable(params) == {"enc": {"w": True}, "head": {"w": True}}
    _, report = wvj.load(params, path, restore_frozen=True)
    assert report.frozen == ["enc.w"]
    assert wvj.trainable(params)["enc"]["w"] is False
    wvj.unfreeze(params)


def test_equinox_mask_drives_optax_multi_transform():
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    assert wvj.freeze(model, "layers.0") == ["layers.0.weight", "layers.0.bias"]
    mask = wvj.trainable(model)
    params = eqx.filter(model, eqx.is_array)
    # One leaf for each of the model's (False for non-arrays): a prefix of ``params``.
    assert jax.tree.structure(mask) == jax.tree.structure(model)
    # An Equinox module is callable, and optax would call a callable mask: wrap it.
    tx = optax.multi_transform({True: optax.sgd(1.0), False: optax.set_to_zero()}, lambda _: mask)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = eqx.apply_updates(model, updates)
    np.testing.assert_array_equal(new.layers[0].weight, model.layers[0].weight)
    assert not np.array_equal(new.layers[1].weight, model.layers[1].weight)
    wvj.unfreeze(model)


# -- errors ----------------------------------------------------------------------------------


def test_renamed_model_fails_helpfully_and_is_untouched(tmp_path):
    path = tmp_path / "tied.safetensors"
    wvj.save(Tied(0), path)

    class Renamed(nnx.Module):
        def __init__(self) -> None:
            rngs = nnx.Rngs(2)
            self.first = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 4, rngs=rngs)

    model = Renamed()
    before = _values(model)
    with pytest.raises(weightvault.KeyMismatchError) as info:
        wvj.load(model, path)
    assert isinstance(info.value, ValueError) and "tied.safetensors" in str(info.value)
    assert info.value.rule == ("a.*", "first.*")
    after = _values(model)
    assert all(np.array_equal(v, after[k]) for k, v in before.items())
    _, report = wvj.load(model, path, rules=[info.value.rule], strict=False)
    assert "first.kernel" in report.loaded


def test_shape_mismatch_names_the_tensor_and_leaves_model_as_it_was(tmp_path):
    path = tmp_path / "m.safetensors"
    wvj.save({"a": jnp.ones((2, 3)), "b": jnp.ones(3)}, path)
    target = {"a": jnp.zeros((3, 2)), "b": jnp.zeros(3)}
    with pytest.raises(weightvault.ShapeMismatchError, match=r"a: F32\[2, 3\] on disk"):
        wvj.load(target, path)
    tree, report = wvj.load(target, path, strict=False)
    assert report.mismatched and report.loaded == ["b"]
    assert tree["a"] is target["a"] and float(tree["b"][0]) == 1.0


def test_damaged_bytes_are_caught_by_verify_before_any_change(tmp_path):
    path = tmp_path / "m.safetensors"
    model = Tied(0)
    wvj.save(model, path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = Tied(1)
    before = _values(fresh)
    with pytest.raises(weightvault.ChecksumError):
        wvj.load(fresh, path, verify=True)
    assert all(np.array_equal(v, _values(fresh)[k]) for k, v in before.items())


def test_hostile_file_and_unsupported_dtype(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(weightvault.FormatError):
        wvj.load({"a": jnp.zeros(2)}, bad)
    with pytest.raises(weightvault.FormatError):
        wvj.load_file(bad)
    with pytest.raises(wvj.UnsupportedDtypeError, match="'k'") as info:
        wvj.save({"k": jax.random.key(0)}, tmp_path / "k.safetensors")
    assert isinstance(info.value, TypeError) and isinstance(
        info.value, weightvault.WeightvaultError
    )
    with pytest.raises(weightvault.RuleError, match=r"Did you mean 'a\.kernel'"):
        wvj.freeze(Tied(0), "a.kernl")


# -- the vault -------------------------------------------------------------------------------


def test_vault_saves_and_loads_nnx_and_equinox(tmp_path):
    vault = weightvault.Vault(tmp_path / "v")
    model = GPT(0)
    wvj.freeze(model, "wte")
    rec = vault.save(model)
    assert rec.logical_bytes - rec.stored_bytes >= 50 * 16 * 4
    fresh = GPT(1)
    same, report = vault.load(fresh, restore_frozen=True)
    assert same is fresh and report.ok and fresh.lm_head.weight is fresh.wte.embedding
    assert report.frozen == ["lm_head.weight", "wte.embedding"]
    ids = jnp.array([[2, 4]])
    np.testing.assert_allclose(fresh(ids), model(ids), rtol=1e-6)

    emodel = EqxTied(0)
    vault.save(emodel, "eqx")
    loaded, _ = vault.load(EqxTied(5), "eqx")
    np.testing.assert_array_equal(loaded(jnp.array(1)), emodel(jnp.array(1)))
