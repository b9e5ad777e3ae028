"""Tests for moddiffy_jax.subnets.gates on tiny hand-made pytrees."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moddiffy_jax.subnets import gates as gt
from moddiffy_jax.subnets import selection

INCLUDE = r".*kernel"


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "conv": {
            "kernel": jnp.asarray(rng.normal(size=(3, 3, 2, 4)), jnp.float32),
            "bias": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
        },
        "bn": {"scale": jnp.ones(4), "bias": jnp.zeros(4)},
        "fc": {
            "kernel": jnp.asarray(rng.normal(size=(4, 5)), jnp.float32),
            "bias": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
        },
    }


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.parametrize("structured", [False, True])
def test_init_gates_are_open_and_identity(structured):
    params = _params()
    state = gt.init_gates(params, INCLUDE, structured=structured)
    assert set(selection.flatten(state.logits)) == {"conv/kernel", "fc/kernel"}
    shapes = jax.tree.map(jnp.shape, state.logits)
    if structured:
        assert shapes == {"conv": {"kernel": (4,)}, "fc": {"kernel": (5,)}}
    else:
        assert shapes == {"conv": {"kernel": (3, 3, 2, 4)}, "fc": {"kernel": (4, 5)}}
    for temperature in (1.0, 1e-3):
        values = gt.gate_values(state.logits, temperature=temperature)
        assert all(bool(jnp.all(v == 1.0)) for v in jax.tree.leaves(values))
        gated = jax.jit(gt.apply_gates)(params, state, temperature=temperature)
        chex.assert_trees_all_equal(gated, params)  # bit-identical at init
    eager = gt.apply_gates(params, state, temperature=1.0)
    assert eager["bn"]["scale"] is params["bn"]["scale"]


def test_structured_one_d_leaf_is_per_entry():
    params = {"w": {"kernel": jnp.ones((6,)), "scalar": jnp.ones(())}}
    state = gt.init_gates(params, r"w/.*", structured=True)
    assert state.logits["w"]["kernel"].shape == (6,)
    assert state.logits["w"]["scalar"].shape == ()


def test_gate_value_clamp_and_unclamped_gradient():
    temperature = 0.5
    m = np.asarray([-4.0, -1.0, -0.25, 0.0, 0.25, 1.0, 4.0], np.float32)
    x = m / temperature
    want_value = np.minimum(1.0, 2.0 * _sigmoid(x))
    want_grad = 2.0 * _sigmoid(x) * (1.0 - _sigmoid(x)) / temperature

    value_fn = jax.jit(lambda m, t: gt.gate_values(m, temperature=t))
    np.testing.assert_allclose(value_fn(m, temperature), want_value, rtol=1e-6)
    grad = jax.jit(jax.grad(lambda m, t: jnp.sum(gt.gate_values(m, temperature=t))))(
        m, temperature
    )
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5)
    clamped = m > 0
    assert np.all(np.asarray(value_fn(m, temperature))[clamped] == 1.0)
    assert np.all(np.asarray(grad)[clamped] > 0)  # gradient of the unclamped 2σ
    # Contrast: autodiff through the plain min() would give zero there.
    plain = jax.grad(lambda m: jnp.sum(jnp.minimum(1.0, 2 * jax.nn.sigmoid(m / 0.5))))(
        m
    )
    assert np.all(np.asarray(plain)[m > 0] == 0)


def test_apply_gates_structured_broadcast_and_gradient():
    params = _params()
    rng = np.random.default_rng(1)
    logits = {
        "conv": {"kernel": jnp.asarray(rng.normal(size=(4,)), jnp.float32)},
        "fc": {"kernel": jnp.asarray(rng.normal(size=(5,)), jnp.float32)},
    }
    state = gt.GateState(logits=logits)
    temperature = 0.7
    out = jax.jit(gt.apply_gates)(params, state, temperature=temperature)
    for path, shape_fn in (
        ("conv", lambda g: g[None, None, None, :]),
        ("fc", lambda g: g[None, :]),
    ):
        g = np.minimum(
            1.0, 2 * _sigmoid(np.asarray(logits[path]["kernel"]) / temperature)
        )
        want = np.asarray(params[path]["kernel"]) * shape_fn(g)
        np.testing.assert_allclose(out[path]["kernel"], want, rtol=1e-6)
        np.testing.assert_array_equal(out[path]["bias"], params[path]["bias"])

    # Gradient wrt a structured logit sums over the channel's weights.
    def loss(lg):
        eff = gt.apply_gates(params, gt.GateState(logits=lg), temperature=temperature)
        return jnp.sum(eff["fc"]["kernel"] ** 2)

    grad = jax.jit(jax.grad(loss))(logits)["fc"]["kernel"]
    lf = np.asarray(logits["fc"]["kernel"], np.float64)
    g = np.minimum(1.0, 2 * _sigmoid(lf / temperature))
    dg = 2 * _sigmoid(lf / temperature) * (1 - _sigmoid(lf / temperature)) / temperature
    w = np.asarray(params["fc"]["kernel"], np.float64)
    want = np.sum(2 * g * w**2, axis=0) * dg
    np.testing.assert_allclose(grad, want, rtol=1e-5)


def test_bad_gate_shape_raises():
    params = _params()
    state = gt.GateState(logits={"fc": {"kernel": jnp.zeros((4,))}})  # in, not out
    with pytest.raises(ValueError, match="last axis"):
        gt.apply_gates(params, state, temperature=1.0)


def test_prune_rule_apply_pruning_and_pruned_fraction():
    params = _params()
    conv_logits = jnp.asarray([-1.0, 0.0, 2.0, -0.0], jnp.float32)  # [out]
    fc_logits = jnp.asarray(
        [[1.0, -1.0, 0.0, -2.0, 3.0]] * 2 + [[-1.0] * 5] * 2, jnp.float32
    )  # [4, 5] unstructured
    state = gt.GateState(
        logits={"conv": {"kernel": conv_logits}, "fc": {"kernel": fc_logits}}
    )
    keep = gt.prune_rule(state)
    np.testing.assert_array_equal(keep["conv"]["kernel"], [False, True, True, True])
    np.testing.assert_array_equal(keep["fc"]["kernel"], np.asarray(fc_logits) >= 0)

    pruned = jax.jit(gt.apply_pruning)(params, state)
    conv = np.asarray(params["conv"]["kernel"])
    np.testing.assert_array_equal(
        pruned["conv"]["kernel"],
        np.where(np.asarray(keep["conv"]["kernel"]), conv, 0.0),
    )
    fc = np.asarray(params["fc"]["kernel"])
    np.testing.assert_array_equal(
        pruned["fc"]["kernel"], np.where(fc_logits >= 0, fc, 0.0)
    )
    np.testing.assert_array_equal(pruned["conv"]["bias"], params["conv"]["bias"])

    overall, per_leaf = jax.jit(gt.pruned_fraction)(state)
    assert float(per_leaf["conv/kernel"]) == pytest.approx(0.25)
    assert float(per_leaf["fc/kernel"]) == pytest.approx(14 / 20)
    assert float(overall) == pytest.approx((1 + 14) / (4 + 20))
    # Weighted by weights: a conv channel stands for 3*3*2 = 18 weights.
    overall_w, per_leaf_w = gt.pruned_fraction(state, params=params)
    assert float(per_leaf_w["conv/kernel"]) == pytest.approx(0.25)
    assert float(overall_w) == pytest.approx((18 + 14) / (72 + 20))
    # Zero-temperature limit: gated and pruned nets coincide.
    gated = gt.apply_gates(params, state, temperature=1e-9)
    chex.assert_trees_all_close(gated, pruned)


def test_frozen_base_bit_identical_after_jitted_optax_step():
    params = _params()
    base_copy = jax.tree.map(np.array, params)
    state = gt.init_gates(params, INCLUDE)
    opt = optax.chain(
        optax.add_decayed_weights(1e-4), optax.scale_by_adam(), optax.scale(-1e-1)
    )
    opt_state = opt.init(state.logits)

    def loss_fn(logits, base, temperature):
        eff = gt.apply_gates(base, gt.GateState(logits=logits), temperature=temperature)
        return jnp.sum(eff["fc"]["kernel"] ** 2) + jnp.sum(eff["conv"]["kernel"] ** 2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(logits, opt_state, base, temperature):
        grads = jax.grad(loss_fn)(logits, base, temperature)
        updates, opt_state = opt.update(grads, opt_state, logits)
        return optax.apply_updates(logits, updates), opt_state

    logits = state.logits
    for temperature in (1.0, 0.1, 0.01):  # a temperature change does not retrace
        logits, opt_state = step(logits, opt_state, params, jnp.float32(temperature))
    chex.assert_trees_all_equal(params, base_copy)
    assert all(
        bool(jnp.all(m < 0)) for m in jax.tree.leaves(logits)
    )  # every gate closes
