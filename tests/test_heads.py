"""Tests for moddiffy_jax.models.heads."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax.models import heads


def key(seed):
    """Test PRNG keys: "rbg" compiles much faster than threefry on CPU."""
    return jax.random.key(seed, impl="rbg")


def test_torch_linear_init_bounds():
    fan_in, fan_out = 64, 512
    kernel = heads.torch_linear_kernel_init()(key(0), (fan_in, fan_out))
    bias = heads.torch_linear_bias_init(fan_in)(key(1), (fan_out,))
    bound = 1 / math.sqrt(fan_in)
    for x in (kernel, bias):
        assert float(jnp.abs(x).max()) <= bound
    # Uniform on [-b, b]: fills the range, variance b^2 / 3.
    assert float(jnp.abs(kernel).max()) > 0.95 * bound
    np.testing.assert_allclose(float(kernel.var()), bound**2 / 3, rtol=0.05)


@pytest.mark.parametrize("num_hidden", [0, 2])
def test_classifier_head_shapes_and_names(num_hidden):
    head = heads.ClassifierHead(num_outputs=3, num_hidden=num_hidden, hidden_size=16)
    x = jnp.ones((4, 8))
    params = head.init(key(0), x)["params"]
    expected = {f"hidden_{i}" for i in range(num_hidden)} | {"output"}
    assert set(params) == expected
    assert params["output"]["kernel"].shape == ((16 if num_hidden else 8), 3)
    bound = 1 / math.sqrt(params["output"]["kernel"].shape[0])
    assert float(jnp.abs(params["output"]["bias"]).max()) <= bound
    assert head.apply({"params": params}, x).shape == (4, 3)


def test_classifier_head_dropout():
    head = heads.ClassifierHead(num_outputs=2, num_hidden=1, dropout=0.5)
    x = jax.random.normal(key(0), (4, 8))
    params = head.init(key(1), x)["params"]
    det = head.apply({"params": params}, x)
    np.testing.assert_array_equal(det, head.apply({"params": params}, x))
    drop = head.apply(
        {"params": params}, x, deterministic=False, rngs={"dropout": key(2)}
    )
    assert not np.allclose(det, drop)


def test_ensemble_shapes_and_members_differ():
    k, b, h, c = 5, 4, 8, 3
    ens = heads.HeadEnsemble(num_outputs=c, num_members=k, num_hidden=1)
    x = jax.random.normal(key(0), (b, h))
    params = jax.jit(ens.init)(key(1), x)["params"]
    kernel = params["members"]["hidden_0"]["kernel"]
    assert kernel.shape == (k, h, h)
    assert params["members"]["output"]["kernel"].shape == (k, h, c)
    for i in range(1, k):
        assert not np.allclose(kernel[0], kernel[i])
    logits = jax.jit(ens.apply)({"params": params}, x)
    assert logits.shape == (k, b, c)
    assert not np.allclose(logits[0], logits[1])


def test_ensemble_member_equals_single_head_and_dropout_per_member():
    k = 3
    ens = heads.HeadEnsemble(num_outputs=2, num_members=k, num_hidden=1, dropout=0.5)
    x = jax.random.normal(key(0), (6, 8))
    params = ens.init(key(1), x)["params"]
    # Member i with its slice of params is exactly a ClassifierHead.
    single = heads.ClassifierHead(num_outputs=2, num_hidden=1)
    member1 = jax.tree.map(lambda p: p[1], params["members"])
    np.testing.assert_allclose(
        ens.apply({"params": params}, x)[1],
        single.apply({"params": member1}, x),
        atol=1e-6,
    )
    # Identical members + dropout: outputs differ, so each member has its own rng.
    same = jax.tree.map(lambda p: jnp.broadcast_to(p[:1], p.shape), params)
    drop = jax.jit(ens.apply, static_argnames="deterministic")(
        {"params": same}, x, deterministic=False, rngs={"dropout": key(2)}
    )
    assert not np.allclose(drop[0], drop[1])
    det = ens.apply({"params": same}, x)
    np.testing.assert_allclose(det[0], det[1])
