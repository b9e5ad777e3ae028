"""A gradient projection: the removal's step that does not work against the
task (``config.method.task_projection``, methods/common.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def task_projected(h: jax.Array, toward: jax.Array) -> jax.Array:
    """``h`` unchanged; the gradient that flows back through it loses, per
    row, its component against ``toward`` (that row's task gradient):
    ``g - min(0, g . t) / (t . t) t``. A descent step on a loss of the
    result then does not raise a loss whose gradient is ``toward``, to first
    order in each row (PCGrad's projection, Yu et al. 2020, row by row).
    No gradient flows to ``toward``."""
    return h


def _projected_fwd(h, toward):
    return h, toward


def _projected_bwd(toward, g):
    t = toward.astype(jnp.float32)
    g32 = g.astype(jnp.float32)
    dot = jnp.sum(g32 * t, axis=-1, keepdims=True)
    norm = jnp.sum(t * t, axis=-1, keepdims=True)
    scale = jnp.where(norm > 0.0, jnp.minimum(dot, 0.0) / jnp.maximum(norm, 1e-30), 0.0)
    return (g32 - scale * t).astype(g.dtype), jnp.zeros_like(toward)


task_projected.defvjp(_projected_fwd, _projected_bwd)
