"""bf16 Dense dots accumulate in float32, forward and backward; float32 dots
are untouched (models/mixed_dot.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from moddiffy_jax.models import bert_model
from moddiffy_jax.models.mixed_dot import dense_dot_general

DENSE = lambda x: (((x.ndim - 1,), (0,)), ((), ()))  # noqa: E731


def _operands(dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((3, 5, 64), np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((64, 48), np.float32) * 0.1, dtype)
    return x, w


def test_float32_is_lax_dot_general_bit_for_bit():
    x, w = _operands(jnp.float32)
    np.testing.assert_array_equal(
        dense_dot_general(x, w, DENSE(x)), lax.dot_general(x, w, DENSE(x))
    )
    f = lambda d: lambda x, w: jnp.sum(jnp.sin(d(x, w, DENSE(x))))  # noqa: E731
    for a, b in zip(
        jax.grad(f(dense_dot_general), (0, 1))(x, w),
        jax.grad(f(lax.dot_general), (0, 1))(x, w),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_bf16_sums_in_float32_forward_and_backward():
    """Values and gradients as the float32 dot of the same bf16 numbers,
    rounded to bf16 once; a bf16-accumulated dot is further off."""
    x, w = _operands(jnp.bfloat16)
    y = dense_dot_general(x, w, DENSE(x))
    assert y.dtype == jnp.bfloat16
    want = lax.dot_general(x.astype(jnp.float32), w.astype(jnp.float32), DENSE(x))
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(want), rtol=2**-8, atol=1e-6
    )

    g = jnp.asarray(np.random.default_rng(1).standard_normal(y.shape), jnp.bfloat16)
    _, vjp = jax.vjp(lambda a, b: dense_dot_general(a, b, DENSE(a)), x, w)
    dx, dw = vjp(g)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    _, vjp32 = jax.vjp(
        lambda a, b: lax.dot_general(a, b, DENSE(a)),
        x.astype(jnp.float32),
        w.astype(jnp.float32),
    )
    dx32, dw32 = vjp32(g.astype(jnp.float32))
    for got, ref in ((dx, dx32), (dw, dw32)):
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(ref), rtol=2**-8, atol=1e-5
        )


def test_bf16_encoder_step_has_only_float32_accumulating_dense_dots(tiny):
    """In a bf16 encoder's forward-backward pass every Dense dot takes bf16
    inputs and accumulates in float32: the fast CPU path (a bf16 x bf16 ->
    bf16 dot, or a mixed bf16 x float32 one, runs at the float32 rate on
    the project's CPU)."""
    config, params = tiny
    ids = jnp.ones((2, 8), jnp.int32)
    mask = jnp.ones((2, 8), jnp.int32)

    def loss(p):
        module = bert_model.BertEncoder(config, dtype=jnp.bfloat16)
        out = module.apply({"params": p}, ids, mask).last_hidden_state
        return jnp.sum(out.astype(jnp.float32) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
    dots = []

    def walk(jp):
        for eqn in jp.eqns:
            if eqn.primitive.name == "dot_general":
                dots.append(eqn)
            for sub in jax.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    # Dense dots have no batch axes (the attention's einsums do).
    dense = [e for e in dots if not any(e.params["dimension_numbers"][1])]
    # 2 layers x 6 kernels, forward and the two gradients each (+ the pooler).
    assert len(dense) >= 2 * 6 * 3
    for e in dense:
        assert [v.aval.dtype for v in e.invars] == [jnp.bfloat16] * 2, e
        assert e.params["preferred_element_type"] == jnp.float32, e


@pytest.fixture(scope="module")
def tiny():
    config = bert_model.BertConfig.tiny(vocab_size=128)
    module = bert_model.BertEncoder(config)
    params = module.init(
        jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32)
    )["params"]
    return config, params
