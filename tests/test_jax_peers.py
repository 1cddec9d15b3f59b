"""weightvault.jax as Equinox and Flax users resume training (issue 18).

Oracles: ``eqx.tree_serialise_leaves``/``tree_deserialise_leaves`` for Equinox state,
Flax's ``nnx.Optimizer`` and optax for optimizer steps, ``eqx.partition`` for filter
specs, and ``jax.sharding`` for where arrays land.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import weightvault  # noqa: E402
import weightvault.jax as wvj  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _assert_bitwise(got: Any, want: Any) -> None:
    """The same array paths, and every array the same dtype, shape and bits."""
    # Paths, not tree structures: an eqx.nn.State's structure holds markers of its own.
    got_leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(got, eqx.is_array))
    want_leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(want, eqx.is_array))
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, g), (_, w) in zip(got_leaves, want_leaves, strict=True):
        assert isinstance(g, jax.Array), path
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


# -- Equinox state (StateIndex) -------------------------------------------------------------


class BNNet(eqx.Module):
    """A linear layer and a BatchNorm: the BatchNorm's running stats live in ``eqx.nn.State``."""

    linear: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __init__(self, key: jax.Array) -> None:
        self.linear = eqx.nn.Linear(3, 4, key=key)
        self.bn = eqx.nn.BatchNorm(4, axis_name="batch", mode="batch")

    def __call__(self, x: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, eqx.nn.State]:
        return self.bn(self.linear(x), state)


def _trained_bn() -> tuple[BNNet, eqx.nn.State]:
    model = BNNet(jax.random.key(0))
    state = eqx.nn.State(model)  # not make_with_state, which drops the init arrays
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    for i in range(2):  # two steps: the running stats move away from their init arrays
        _, state = batched(jnp.arange(12.0).reshape(4, 3) * (i + 1), state)
    return model, state


def test_equinox_batchnorm_resumes_like_tree_deserialise_leaves(tmp_path):
    """``eqx.nn.State(model)`` holds the init arrays themselves: that is no tie to keep."""
    model, state = _trained_bn()
    path = tmp_path / "bn.safetensors"
    assert wvj.save((model, state), path).aliases == {}  # the stats moved: nothing shared
    eqx.tree_serialise_leaves(tmp_path / "bn.eqx", (model, state))

    fresh = BNNet(jax.random.key(1))
    template = (fresh, eqx.nn.State(fresh))
    expected = eqx.tree_deserialise_leaves(tmp_path / "bn.eqx", template)
    loaded, report = wvj.load(template, path)
    assert report.ok and report.tied == []
    _assert_bitwise(loaded, expected)
    _assert_bitwise(loaded, (model, state))

    # Resumed in inference mode, the running statistics give the original's outputs.
    x = jnp.ones(3)
    want, _ = eqx.nn.inference_mode(model)(x, state)
    got, _ = eqx.nn.inference_mode(loaded[0])(x, loaded[1])
    np.testing.assert_array_equal(got, want)


def test_equinox_state_saved_before_training_round_trips(tmp_path):
    """Before a step the state *is* the init arrays: stored once, loaded into a fresh pair."""
    model = BNNet(jax.random.key(0))
    state = eqx.nn.State(model)
    path = tmp_path / "bn0.safetensors"
    assert wvj.save((model, state), path).aliases  # one array object under two names
    fresh = BNNet(jax.random.key(1))
    loaded, report = wvj.load((fresh, eqx.nn.State(fresh)), path)
    assert report.ok
    _assert_bitwise(loaded, (model, state))


def test_one_array_object_in_a_template_is_no_tie(tmp_path):
    """A pytree that holds one array object twice loads two different values into it."""
    path = tmp_path / "two.safetensors"
    wvj.save({"a": jnp.ones(2), "b": jnp.full(2, 2.0)}, path)
    z = jnp.zeros(2)
    tree, report = wvj.load({"a": z, "b": z}, path)
    assert report.ok and report.tied == [] and report.untied == []
    np.testing.assert_array_equal(tree["a"], np.ones(2))
    np.testing.assert_array_equal(tree["b"], np.full(2, 2.0))

    # What the file records as one tensor comes back as one array object, in any template.
    tied = tmp_path / "tied.safetensors"
    w = jnp.arange(2.0)
    wvj.save({"a": w, "b": w}, tied)
    tree, report = wvj.load({"a": jnp.zeros(2), "b": jnp.ones(2)}, tied)
    assert tree["a"] is tree["b"] and report.tied == [("a", "b")]


# -- Equinox filter specs ---------------------------------------------------------------------


def test_trainable_is_an_equinox_filter_spec():
    """The Equinox FAQ's freezing idiom: ``eqx.partition(model, spec)``, train the first half."""
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    wvj.freeze(model, "layers.0")
    try:
        spec = wvj.trainable(model)
        diff, static = eqx.partition(model, spec)
        assert jax.tree.structure(spec) == jax.tree.structure(model)
        assert diff.layers[0].weight is None and static.layers[0].weight is not None
        assert diff.layers[1].weight is not None and static.activation is model.activation

        @eqx.filter_grad
        def grad(diff: Any, static: Any, x: jax.Array) -> jax.Array:
            return eqx.combine(diff, static)(x).sum()

        grads = grad(diff, static, jnp.ones(3))
        new = eqx.combine(jax.tree.map(lambda p, g: p - g, diff, grads), static)
        np.testing.assert_array_equal(new.layers[0].weight, model.layers[0].weight)
        assert not np.array_equal(new.layers[1].weight, model.layers[1].weight)
    finally:
        wvj.unfreeze(model)


# -- Flax NNX: optimizers, shared modules, abstract models ----------------------------------


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, use_running_average=False, rngs=rngs)
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.bn(self.linear(x))))


def _train(model: Net, optimizer: nnx.Optimizer, steps: int) -> None:
    x = jnp.arange(15.0).reshape(5, 3) / 10

    def loss(m: Net) -> jax.Array:
        return (m(x) ** 2).mean()

    for _ in range(steps):
        optimizer.update(model, nnx.grad(loss)(model))


def _make(seed: int) -> tuple[Net, nnx.Optimizer]:
    model = Net(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def test_nnx_model_and_optimizer_resume_in_place(tmp_path):
    """``(model, optimizer)`` is filled in place; the next Adam step matches the original's."""
    model, optimizer = _make(0)
    _train(model, optimizer, 2)
    path = tmp_path / "run.safetensors"
    report = wvj.save((model, optimizer), path)
    assert {"0.linear.kernel", "1.step", "1.opt_state.0.mu.linear.kernel"} <= set(report.stored)

    target = _make(1)
    loaded, report = wvj.load(target, path)
    assert loaded is target and report.ok
    assert int(target[1].step[...]) == 2
    _train(model, optimizer, 1)
    _train(*target, 1)
    _assert_bitwise(nnx.state(target), nnx.state((model, optimizer)))


def test_nnx_optimizer_alone_is_named_by_its_attributes(tmp_path):
    _, optimizer = _make(0)
    path = tmp_path / "opt.safetensors"
    stored = wvj.save(optimizer, path).stored
    assert "step" in stored and "opt_state.0.nu.out.bias" in stored
    _, other = _make(1)
    same, report = wvj.load(other, path)
    assert same is other and report.ok


def test_a_file_saved_when_containers_were_pytrees_still_loads_in_place(tmp_path):
    # Before (model, optimizer) was named like a module, every name ended in ".value"
    # ("1.step.value"); such files must keep loading, with no rule from the user.
    model, optimizer = _make(0)
    _train(model, optimizer, 2)
    new = tmp_path / "new.safetensors"
    wvj.save((model, optimizer), new)
    old = tmp_path / "old.safetensors"
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    arrays = safetensors_numpy.load_file(str(new))
    safetensors_numpy.save_file({f"{k}.value": v for k, v in arrays.items()}, str(old))

    target = _make(1)
    loaded, report = wvj.load(target, old)
    assert loaded is target and report.ok
    assert ("1.step.value", "1.step") in report.renamed
    _assert_bitwise(nnx.state(target), nnx.state((model, optimizer)))


class Siamese(nnx.Module):
    """One encoder module in two places, as a shared tower."""

    def __init__(self, seed: int) -> None:
        self.left = nnx.Linear(4, 4, rngs=nnx.Rngs(seed))
        self.right = self.left

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.right(self.left(x))


def test_nnx_shared_module_is_stored_once_and_stays_shared(tmp_path):
    model = Siamese(0)
    path = tmp_path / "siamese.safetensors"
    report = wvj.save(model, path)
    assert report.aliases == {"right.bias": "left.bias", "right.kernel": "left.kernel"}
    fresh = Siamese(1)
    _, rep = wvj.load(fresh, path)
    assert rep.ok and rep.untied == [] and fresh.left is fresh.right
    x = jnp.ones((1, 4))
    np.testing.assert_array_equal(fresh(x), model(x))


def test_abstract_nnx_model_loads_without_allocating_twice(tmp_path):
    """``nnx.eval_shape`` gives a model of ``ShapeDtypeStruct``s: load fills it with arrays."""
    model = Net(nnx.Rngs(0))
    path = tmp_path / "net.safetensors"
    wvj.save(model, path)
    x = jnp.ones((2, 3))
    want = nnx.merge(*nnx.split(model))
    want.eval()

    abstract = nnx.eval_shape(lambda: Net(nnx.Rngs(1)))
    same, report = wvj.load(abstract, path)
    assert same is abstract and report.ok and isinstance(abstract.linear.kernel[...], jax.Array)
    abstract.eval()
    np.testing.assert_array_equal(abstract(x), want(x))

    # The Flax guide's way: restore the abstract state, then merge it with the graph.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Net(nnx.Rngs(2))))
    state, report = wvj.load(state, path)
    assert report.ok
    restored = nnx.merge(graphdef, state)
    restored.eval()
    np.testing.assert_array_equal(restored(x), want(x))


def test_abstract_equinox_model_loads(tmp_path):
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    path = tmp_path / "mlp.safetensors"
    wvj.save(model, path)
    abstract = eqx.filter_eval_shape(eqx.nn.MLP, 3, 2, 4, 1, key=jax.random.key(1))
    loaded, report = wvj.load(abstract, path)
    assert report.ok
    _assert_bitwise(loaded, model)


def test_saving_an_abstract_model_names_the_array(tmp_path):
    abstract = nnx.eval_shape(lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(weightvault.UnsupportedValueError, match=r"'bias'.*ShapeDtypeStruct"):
        wvj.save(abstract, tmp_path / "a.safetensors")
    assert not (tmp_path / "a.safetensors").exists()


# -- sharding --------------------------------------------------------------------------------

SHARDED = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import weightvault.jax as wvj

    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows, cols = NamedSharding(mesh, P("x")), NamedSharding(mesh, P(None, "x"))
    path = sys.argv[1]

    # An NNX model sharded by rows is saved whole and loaded into one sharded by columns.
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    model.kernel.set_value(jax.device_put(model.kernel[...], rows))
    assert len(model.kernel[...].sharding.device_set) == 2
    wvj.save(model, path)
    other = nnx.Linear(4, 4, rngs=nnx.Rngs(1))
    other.kernel.set_value(jax.device_put(other.kernel[...], cols))
    wvj.load(other, path)
    assert other.kernel[...].sharding == cols
    np.testing.assert_array_equal(other.kernel[...], model.kernel[...])

    # An abstract state whose structs carry shardings: each array lands with its own.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(2))))
    state["kernel"].set_value(jax.ShapeDtypeStruct((4, 4), jnp.float32, sharding=rows))
    state, report = wvj.load(state, path)
    restored = nnx.merge(graphdef, state)
    assert report.ok and restored.kernel[...].sharding == rows
    np.testing.assert_array_equal(restored.kernel[...], model.kernel[...])
    print("ok")
    """
)


def test_sharded_nnx_and_abstract_shardings_on_two_devices(tmp_path):
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT / "src"),
    }
    out = subprocess.run(
        [sys.executable, "-c", SHARDED, str(tmp_path / "s.safetensors")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
