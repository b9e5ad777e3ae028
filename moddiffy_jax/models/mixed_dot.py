"""Dense-layer dots for bf16 compute: bf16 inputs, float32 accumulation.

In bf16 mode (``config.model.dtype="bfloat16"``) a ``nn.Dense`` casts its
input and kernel to bf16 and calls ``lax.dot_general``, whose result is
bf16. XLA's CPU backend runs a bf16 x bf16 -> bf16 dot at the float32 rate
(183 against 186 GFLOP/s for a MiniLM feed-forward shape on the project's
2-core AVX-512-bf16 CPU), but a bf16 x bf16 -> float32 dot
(``preferred_element_type=float32``) at twice that (381 GFLOP/s), the rate
torch's oneDNN bf16 matmul reaches on the same machine
(``benchmarks/matmul_rate.py``; docs/speed.md, stop 35).

:func:`dense_dot_general` is what the library's Dense layers use as their
``dot_general``: for two bf16 operands it accumulates in float32 and rounds
the result to bf16 once, and its backward pass does the same for the input
and kernel gradients (an explicit VJP: JAX's own transpose of a float32-output
dot would take the float32 cotangent into a mixed bf16 x float32 dot, which
runs at the slow rate). Every other dtype goes to ``lax.dot_general``
unchanged, so float32 runs are bit for bit what they were.

The sums are float32 instead of bf16, so bf16 runs move by bf16 rounding
(closer to float32 than before); the gradients keep the dtypes they had.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _dense_dims(lhs_ndim: int):
    return (((lhs_ndim - 1,), (0,)), ((), ()))


@jax.custom_vjp
def _dense_mixed(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    out = lax.dot_general(
        lhs, rhs, _dense_dims(lhs.ndim), preferred_element_type=jnp.float32
    )
    return out.astype(lhs.dtype)


def _dense_mixed_fwd(lhs, rhs):
    return _dense_mixed(lhs, rhs), (lhs, rhs)


def _dense_mixed_bwd(res, g):
    lhs, rhs = res
    # d lhs [..., in] = g [..., out] . rhs [in, out] over out.
    d_lhs = lax.dot_general(
        g, rhs, (((g.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    # d rhs [in, out] = lhs [..., in] . g [..., out] over every leading axis.
    lead = tuple(range(lhs.ndim - 1))
    d_rhs = lax.dot_general(
        lhs, g, ((lead, lead), ((), ())), preferred_element_type=jnp.float32
    )
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


_dense_mixed.defvjp(_dense_mixed_fwd, _dense_mixed_bwd)


def dense_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    **kwargs,
) -> jax.Array:
    """``lax.dot_general`` with ``nn.Dense``'s signature; two bf16 operands
    of a Dense contraction (last axis of ``lhs`` with the first of a 2-D
    ``rhs``) accumulate in float32 (see the module docstring)."""
    if (
        lhs.dtype == rhs.dtype
        and lhs.dtype == jnp.bfloat16
        and rhs.ndim == 2
        and preferred_element_type is None
        and not kwargs
        and tuple(map(tuple, dimension_numbers[0])) == ((lhs.ndim - 1,), (0,))
        and not any(dimension_numbers[1])
    ):
        return _dense_mixed(lhs, rhs)
    return lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        **kwargs,
    )
