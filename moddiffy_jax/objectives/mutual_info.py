"""Plug-in mutual information between a bias label and soft bias predictions (FFW).

FFW ("Debiasing surgeon", Nahon et al., ECCV 2024) penalises the mutual
information between the true bias label ``b`` and a bias extractor's soft
prediction ``b_hat`` (the estimator comes from IRENE). For a batch of ``N``
examples with one-hot bias labels ``B`` ``[N, C]`` and predicted
probabilities ``Q`` ``[N, C]``:

    J  = max(B^T Q, 1e-15) / N            soft joint [C, C], clamp BEFORE / N
    pb = J 1   (row sums),  pq = 1^T J    (column sums)
    M  = max(pb pq^T, 1e-15)
    I  = sum_ij J_ij ln(J_ij / M_ij) / ln C

``C`` is the number of bias classes, so ``I`` is normalised to about
``[0, 1]``: 0 when the predictions carry no information about ``b``, 1 when
they recover a uniformly distributed ``b`` exactly. The estimate is per batch
(the plug-in on soft predictions); it is differentiable in ``Q``, which is
how the gates receive the MI gradient.

With per-example ``weights`` (0 for padding rows) the joint is
``max(B^T diag(w) Q, 1e-15) / sum(w)``: with all-ones weights this is the
formula above exactly, and with 0/1 weights it equals the estimate on the
real rows alone, so a padded last batch gives the same value as the
reference's smaller last batch without a recompilation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

EPS = 1e-15


def mutual_information(
    bias_labels: jax.Array,
    probs: jax.Array,
    *,
    num_classes: int,
    weights: jax.Array | None = None,
) -> jax.Array:
    """Normalised plug-in MI ``I(b, b_hat)`` of one batch (see module docstring).

    Args:
      bias_labels: [N] int bias labels in ``[0, num_classes)``.
      probs: [N, C] predicted bias probabilities (rows sum to 1), with
        ``C == num_classes``.
      num_classes: ``C >= 2``, the number of bias classes (static).
      weights: optional [N] non-negative per-example weights (0 = padding).

    Returns:
      A float32 scalar. Jit-able; differentiable with respect to ``probs``.

    Raises:
      ValueError: if ``num_classes < 2`` or ``probs`` has another width.
    """
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}.")
    if probs.shape[-1] != num_classes:
        raise ValueError(
            f"probs has {probs.shape[-1]} columns, expected num_classes={num_classes}."
        )
    probs = probs.astype(jnp.float32)
    onehot = jax.nn.one_hot(bias_labels, num_classes, dtype=jnp.float32)
    if weights is None:
        n = jnp.float32(probs.shape[0])
    else:
        weights = weights.astype(jnp.float32)
        onehot = onehot * weights[:, None]
        n = jnp.maximum(jnp.sum(weights), 1e-12)
    joint = jnp.maximum(onehot.T @ probs, EPS) / n  # clamp, then divide by N
    p_b = jnp.sum(joint, axis=1, keepdims=True)  # [C, 1] true bias
    p_hat = jnp.sum(joint, axis=0, keepdims=True)  # [1, C] predicted bias
    marginals = jnp.maximum(p_b * p_hat, EPS)
    return jnp.sum(joint * jnp.log(joint / marginals)) / math.log(num_classes)
