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


# -----------------------------------------------------------------------------
# Structured gates with followers (whole channels).
# -----------------------------------------------------------------------------


def _conv_bn_relu(seed=0):
    import flax.linen as nn

    class ConvBNReLU(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3, 3), name="conv")(x)
            x = nn.BatchNorm(use_running_average=True, name="bn")(x)
            return nn.relu(x)

    rng = np.random.default_rng(seed)
    model = ConvBNReLU()
    x = jnp.asarray(rng.normal(size=(2, 5, 5, 3)), jnp.float32)
    variables = model.init(jax.random.PRNGKey(seed), x)
    f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    params = {
        "conv": {"kernel": variables["params"]["conv"]["kernel"], "bias": f32(4)},
        # beta > 0 and small mu: a zeroed pre-BN channel stays visible after
        # the ReLU (beta - gamma * mu / sigma > 0).
        "bn": {"scale": 1.0 + 0.2 * f32(4), "bias": 1.0 + jnp.abs(f32(4))},
    }
    stats = {"bn": {"mean": 0.1 * f32(4), "var": 0.5 + jnp.abs(f32(4))}}

    def apply(p):
        return model.apply({"params": p, "batch_stats": stats}, x)

    return params, apply


FOLLOWERS = {"conv/kernel": ("conv/bias", "bn/scale", "bn/bias")}


def test_structured_pruning_zeroes_whole_channels_after_bn_and_relu():
    params, apply = _conv_bn_relu()
    logits = {"conv": {"kernel": jnp.asarray([-0.5, 0.0, 1.0, -2.0], jnp.float32)}}
    state = gt.GateState(logits=logits)
    pruned = jax.jit(
        lambda p, s: gt.apply_structured_pruning(p, s, followers=FOLLOWERS)
    )(params, state)
    out, vanilla = apply(pruned), apply(params)
    gone = np.asarray([True, False, False, True])
    assert np.all(np.asarray(out)[..., gone] == 0.0)  # exactly zero
    np.testing.assert_array_equal(out[..., ~gone], vanilla[..., ~gone])
    assert np.any(np.asarray(vanilla)[..., gone] != 0)
    for path in ("conv/bias", "bn/scale", "bn/bias"):
        leaf = selection.flatten(pruned)[path]
        np.testing.assert_array_equal(
            leaf, np.where(gone, 0.0, selection.flatten(params)[path])
        )
    # Gating the kernel alone (apply_pruning) does not remove the channel:
    # eval-mode BN maps a zero pre-BN channel to beta - gamma * mu / sigma.
    kernel_only = gt.apply_pruning(
        {**params, "conv": {**params["conv"], "bias": jnp.zeros(4)}}, state
    )
    assert np.all(np.asarray(apply(kernel_only))[..., gone] > 0)
    # Masks for pruning_diff have every parameter's full shape.
    masks = selection.flatten(gt.pruning_masks(params, state, followers=FOLLOWERS))
    assert masks["conv/kernel"].shape == (3, 3, 3, 4)
    np.testing.assert_array_equal(masks["bn/scale"], ~gone)


def test_structured_soft_gate_scales_the_channel_after_bn():
    params, apply = _conv_bn_relu(1)
    logits = {"conv": {"kernel": jnp.asarray([-1.0, -0.2, 0.0, 3.0], jnp.float32)}}
    state = gt.GateState(logits=logits)
    t = 0.5
    gated = gt.apply_structured_gates(params, state, temperature=t, followers=FOLLOWERS)
    g = np.minimum(1.0, 2 * _sigmoid(np.asarray(logits["conv"]["kernel"]) / t))
    # The gate multiplies BN scale and bias (the last affine): g * relu(BN(conv)).
    np.testing.assert_allclose(
        apply(gated), g * np.asarray(apply(params)), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(gated["conv"]["kernel"], params["conv"]["kernel"])

    # The clamped-gradient rule holds through the structured transform too.
    def loss(lg):
        eff = gt.apply_structured_gates(
            params, gt.GateState(lg), temperature=t, followers=FOLLOWERS
        )
        return jnp.sum(eff["bn"]["scale"])

    grad = jax.grad(loss)(logits)["conv"]["kernel"]
    x = np.asarray(logits["conv"]["kernel"]) / t
    want = np.asarray(params["bn"]["scale"]) * 2 * _sigmoid(x) * (1 - _sigmoid(x)) / t
    np.testing.assert_allclose(grad, want, rtol=1e-5)
    assert grad[3] != 0  # forward clamped at 1, gradient of the unclamped 2σ
    # Near-zero temperature: soft and hard nets compute the same function.
    hard = gt.apply_structured_pruning(params, state, followers=FOLLOWERS)
    soft = gt.apply_structured_gates(
        params, state, temperature=1e-9, followers=FOLLOWERS
    )
    np.testing.assert_allclose(apply(soft), apply(hard), atol=1e-6)


def test_structured_without_bn_gates_kernel_and_own_bias():
    params = _params()
    state = gt.init_gates(params, INCLUDE, structured=True)
    followers = gt.default_followers(params, ["conv/kernel", "fc/kernel"])
    assert followers == {"conv/kernel": ("conv/bias",), "fc/kernel": ("fc/bias",)}
    assert gt.soft_gated_paths("fc/kernel", ("fc/bias",)) == ("fc/kernel", "fc/bias")
    logits = {"conv": {"kernel": jnp.full(4, -1.0)}, "fc": {"kernel": jnp.full(5, 0.5)}}
    out = gt.apply_structured_gates(
        params,
        gt.GateState(logits),
        temperature=1.0,
        followers={"fc/kernel": ("fc/bias",)},
    )
    g = np.minimum(1.0, 2 * _sigmoid(-1.0))
    np.testing.assert_allclose(
        out["conv"]["kernel"], params["conv"]["kernel"] * g, rtol=1e-6
    )
    np.testing.assert_array_equal(out["conv"]["bias"], params["conv"]["bias"])
    np.testing.assert_array_equal(out["fc"]["bias"], params["fc"]["bias"])  # g = 1
    del state


def test_structured_followers_are_checked():
    params = _params()
    logits = {"fc": {"kernel": jnp.zeros(5)}}
    state = gt.GateState(logits=logits)
    with pytest.raises(ValueError, match="shape"):
        gt.apply_structured_pruning(
            params, state, followers={"fc/kernel": ("bn/scale",)}
        )
    with pytest.raises(KeyError, match="not in the params"):
        gt.apply_structured_pruning(
            params, state, followers={"fc/kernel": ("fc/nope",)}
        )
    with pytest.raises(KeyError, match="no gate"):
        gt.apply_structured_pruning(params, state, followers={"conv/kernel": ()})
    unstructured = gt.GateState(logits={"fc": {"kernel": jnp.zeros((4, 5))}})
    with pytest.raises(ValueError, match="per output channel"):
        gt.apply_structured_pruning(
            params, unstructured, followers={"fc/kernel": ("fc/bias",)}
        )
