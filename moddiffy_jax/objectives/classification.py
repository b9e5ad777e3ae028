"""Classification losses and metrics as pure functions.

Every task and attribute uses ``num_classes`` logits with softmax
cross-entropy, binary ones included (two logits). The MoDDiffy reference uses
one logit with BCE for binary labels; the two parametrisations express the
same family of classifiers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def cross_entropy(
    logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
    """Mean softmax cross-entropy.

    Args:
      logits: [..., B, C] float logits; leading axes (e.g. an ensemble axis)
        are averaged too.
      labels: [B] int class ids.
      weights: optional [B] per-example weights (e.g. 0 for padding). The mean
        is weighted; an all-zero weight vector gives 0.

    Returns:
      A scalar.
    """
    labels = jnp.broadcast_to(labels, logits.shape[:-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    )
    if weights is None:
        return jnp.mean(losses)
    weights = jnp.broadcast_to(weights.astype(jnp.float32), losses.shape)
    return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1e-12)


def accuracy(
    logits: jax.Array, labels: jax.Array, weights: jax.Array | None = None
) -> jax.Array:
    """Weighted accuracy of argmax predictions; logits [B, C], labels [B]."""
    correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    if weights is None:
        return jnp.mean(correct)
    return jnp.sum(correct * weights) / jnp.maximum(jnp.sum(weights), 1e-12)


def majority_vote(ensemble_logits: jax.Array) -> jax.Array:
    """Majority vote of an ensemble; ties go to the smallest class id.

    Args:
      ensemble_logits: [K, B, C] logits of K members.

    Returns:
      [B] int32 predictions.
    """
    num_classes = ensemble_logits.shape[-1]
    votes = jax.nn.one_hot(jnp.argmax(ensemble_logits, -1), num_classes)
    return jnp.argmax(jnp.sum(votes, axis=0), axis=-1).astype(jnp.int32)
