"""Adversarial removal with a gradient reversal layer (Ganin & Lempitsky 2015).

The adversaries minimise their classification loss on ``grl(h)``; the encoder
(or the diff) receives ``-lambda`` times that gradient, so one backward pass
trains both sides.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moddiffy_jax.objectives.classification import cross_entropy


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gradient_reversal(x: jax.Array, scale: float) -> jax.Array:
    """Identity in the forward pass; multiplies the gradient by ``-scale``."""
    return x


def _grl_fwd(x, scale):
    return x, None


def _grl_bwd(scale, _, g):
    return (jax.tree.map(lambda t: -scale * t, g),)


gradient_reversal.defvjp(_grl_fwd, _grl_bwd)


def adversarial_loss(
    ensemble_logits: jax.Array,
    labels: jax.Array,
    weights: jax.Array | None = None,
) -> jax.Array:
    """Mean cross-entropy over the K ensemble members; logits [K, B, C]."""
    return cross_entropy(ensemble_logits, labels, weights)


def confusion_loss(ensemble_logits: jax.Array, target: jax.Array) -> jax.Array:
    """KL(target || softmax(logits)), mean over members and examples.

    The encoder side of adversarial removal without gradient reversal
    (domain confusion, Tzeng et al. 2015): the representation is trained so
    that the adversaries' prediction is ``target`` [B, C], e.g. the attribute
    distribution the task label alone implies. Minimised at 0 by a
    representation that tells the adversaries nothing more, where reversing
    their gradient is "won" by flipping the attribute's signal (which a
    fresh probe reads as well as the original).

    Args:
      ensemble_logits: [K, B, C] logits of the (frozen) adversaries.
      target: [B, C] probabilities.
    """
    logp = jax.nn.log_softmax(ensemble_logits.astype(jnp.float32), -1)
    t = target.astype(jnp.float32)
    ent = jnp.sum(jnp.where(t > 0, t * jnp.log(jnp.where(t > 0, t, 1.0)), 0.0), -1)
    return jnp.mean(ent[None] - jnp.sum(t[None] * logp, -1))


def grl_scale(lambda_: float) -> float:
    """Validates the GRL strength (a plain, non-negative float)."""
    lambda_ = float(lambda_)
    if not lambda_ >= 0:
        raise ValueError(f"The GRL lambda must be >= 0, got {lambda_}.")
    return lambda_


__all__ = ["adversarial_loss", "confusion_loss", "gradient_reversal", "grl_scale"]
