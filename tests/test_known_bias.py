"""Tests for the known-bias debiasing losses (PoE, reweighting, conf-reg)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax.objectives import (
    KNOWN_BIAS_LOSSES,
    confidence_regularization_loss,
    cross_entropy,
    example_reweighting_loss,
    get_known_bias_loss,
    product_of_experts_loss,
)

LN2, LN3 = np.log(2.0), np.log(3.0)


def _np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _random_batch(seed, b=5, c=3):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, c)).astype(np.float32)
    labels = rng.integers(0, c, size=b).astype(np.int32)
    bias = rng.dirichlet(np.ones(c), size=b).astype(np.float32)
    teacher = rng.dirichlet(np.ones(c), size=b).astype(np.float32)
    return logits, labels, bias, teacher


# ---- hand-computed examples ------------------------------------------------


def test_poe_hand_example():
    # Ex 1: p = [1/2, 1/2], p^b = [0.8, 0.2] -> product ∝ [0.8, 0.2]; y=0.
    # Ex 2: p = [1/4, 3/4], p^b = [3/4, 1/4] -> product ∝ [3, 3] (uniform); y=1.
    logits = jnp.array([[0.0, 0.0], [0.0, LN3]])
    bias = jnp.array([[0.8, 0.2], [0.75, 0.25]])
    labels = jnp.array([0, 1])
    expected = (-np.log(0.8) + LN2) / 2
    got = product_of_experts_loss(logits, labels, bias)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_reweighting_hand_example():
    # Ex 1: uniform over 3 -> CE = ln 3, p^b_y = 0.5 -> w = 0.5.
    # Ex 2: p = [1/2, 1/4, 1/4], y=0 -> CE = ln 2, p^b_y = 0.9 -> w = 0.1.
    logits = jnp.array([[0.0, 0.0, 0.0], [LN2, 0.0, 0.0]])
    labels = jnp.array([0, 0])
    bias = jnp.array([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]])
    expected = (0.5 * LN3 + 0.1 * LN2) / 0.6  # by sum of weights, not by B
    got = example_reweighting_loss(logits, labels, bias)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert not np.isclose(got, (0.5 * LN3 + 0.1 * LN2) / 2)


def test_conf_reg_hand_example():
    # Ex 1: t = [0.8, 0.2], p^b_y = 0.5 -> s = 0.5 -> t~ ∝ sqrt(t) = [2/3, 1/3];
    #   p = softmax([ln 2, 0]) = [2/3, 1/3] -> CE = H(2/3, 1/3).
    # Ex 2: t = [0.9, 0.1], p^b_y = 1 -> s = 0 -> t~ = [1/2, 1/2];
    #   p = softmax([ln 3, 0]) = [3/4, 1/4] -> CE = -(ln 3/4 + ln 1/4) / 2.
    logits = jnp.array([[LN2, 0.0], [LN3, 0.0]])
    labels = jnp.array([0, 1])
    bias = jnp.array([[0.5, 0.5], [0.0, 1.0]])
    teacher = jnp.array([[0.8, 0.2], [0.9, 0.1]])
    ce1 = -(2 / 3 * np.log(2 / 3) + 1 / 3 * np.log(1 / 3))
    ce2 = -(np.log(0.75) + np.log(0.25)) / 2
    got = confidence_regularization_loss(logits, labels, bias, teacher)
    np.testing.assert_allclose(got, (ce1 + ce2) / 2, rtol=1e-6)


# ---- against an independent numpy implementation ---------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_losses_match_numpy(seed):
    logits, labels, bias, teacher = _random_batch(seed)
    rows = np.arange(len(labels))
    log_p = _np_log_softmax(logits.astype(np.float64))
    ce = -log_p[rows, labels]
    pb_y = bias[rows, labels].astype(np.float64)

    poe = -_np_log_softmax(log_p + np.log(bias))[rows, labels].mean()
    w = 1.0 - pb_y
    rew = (w * ce).sum() / w.sum()
    scaled = teacher.astype(np.float64) ** (1.0 - pb_y)[:, None]
    targets = scaled / scaled.sum(-1, keepdims=True)
    conf = -(targets * log_p).sum(-1).mean()

    np.testing.assert_allclose(
        product_of_experts_loss(logits, labels, bias), poe, rtol=1e-5
    )
    np.testing.assert_allclose(
        example_reweighting_loss(logits, labels, bias), rew, rtol=1e-5
    )
    np.testing.assert_allclose(
        confidence_regularization_loss(logits, labels, bias, teacher),
        conf,
        rtol=1e-5,
    )


# ---- limiting cases --------------------------------------------------------


def test_poe_uniform_bias_is_cross_entropy():
    logits, labels, _, _ = _random_batch(2)
    uniform = jnp.full(logits.shape, 1.0 / logits.shape[-1])
    np.testing.assert_allclose(
        product_of_experts_loss(logits, labels, uniform),
        cross_entropy(logits, labels),
        rtol=1e-6,
    )


def _bias_with_zero_on_label(labels, c):
    # Put all bias mass on the class after the label: p^b_y = 0.
    return jax.nn.one_hot((labels + 1) % c, c)


def test_reweighting_zero_bias_on_label_is_cross_entropy():
    logits, labels, _, _ = _random_batch(3)
    bias = _bias_with_zero_on_label(labels, logits.shape[-1])
    np.testing.assert_allclose(
        example_reweighting_loss(logits, labels, bias),
        cross_entropy(logits, labels),
        rtol=1e-6,
    )


def test_reweighting_all_weights_zero_is_finite():
    logits, labels, _, _ = _random_batch(4)
    bias = jax.nn.one_hot(labels, logits.shape[-1])
    assert float(example_reweighting_loss(logits, labels, bias)) == 0.0


def test_conf_reg_zero_bias_on_label_is_ce_against_teacher():
    logits, labels, _, teacher = _random_batch(5)
    bias = _bias_with_zero_on_label(labels, logits.shape[-1])
    log_p = _np_log_softmax(logits.astype(np.float64))
    expected = -(teacher * log_p).sum(-1).mean()
    np.testing.assert_allclose(
        confidence_regularization_loss(logits, labels, bias, teacher),
        expected,
        rtol=1e-5,
    )


def test_poe_zero_bias_prob_is_finite():
    logits = jnp.array([[1.0, -1.0, 0.0]])
    bias = jnp.array([[0.0, 0.5, 0.5]])
    loss = product_of_experts_loss(logits, jnp.array([0]), bias)
    grads = jax.grad(product_of_experts_loss)(logits, jnp.array([0]), bias)
    assert np.isfinite(loss) and np.all(np.isfinite(grads))


# ---- gradients and jit -----------------------------------------------------


def _loss_with_teacher(name):
    fn = get_known_bias_loss(name)
    if name == "conf_reg":
        return fn
    return lambda logits, labels, bias, teacher: fn(logits, labels, bias)


@pytest.mark.parametrize("name", sorted(KNOWN_BIAS_LOSSES))
def test_no_gradient_into_bias_or_teacher(name):
    logits, labels, bias, teacher = _random_batch(6)
    fn = _loss_with_teacher(name)
    g_logits, g_bias, g_teacher = jax.grad(fn, argnums=(0, 2, 3))(
        logits, labels, bias, teacher
    )
    assert np.any(g_logits != 0)
    np.testing.assert_array_equal(g_bias, 0.0)
    np.testing.assert_array_equal(g_teacher, 0.0)


@pytest.mark.parametrize("name", sorted(KNOWN_BIAS_LOSSES))
def test_jit_matches_eager(name):
    logits, labels, bias, teacher = _random_batch(7)
    fn = _loss_with_teacher(name)
    eager = fn(logits, labels, bias, teacher)
    jitted = jax.jit(fn)(logits, labels, bias, teacher)
    assert jitted.shape == ()
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)


def test_unknown_name_lists_valid_ones():
    with pytest.raises(KeyError, match="conf_reg.*poe.*reweighting"):
        get_known_bias_loss("focal")
