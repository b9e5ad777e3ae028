"""Linear erasure with memory: the whitened group-mean distance, read from
a running estimate of where the groups' means differ.

No linear probe beats the floor once the attribute groups' means agree
(within each task class), LEACE's condition (Belrose et al. 2023); what a
fresh linear probe reads is their distance in the metric of the
within-group covariance (the Mahalanobis distance; Fisher's discriminant).
The whitened linear MMD (:mod:`objectives.mmd`) estimates that distance
from one batch, and on small per-batch groups the estimate is mostly noise:
with ``n`` members per group in ``D`` whitened dimensions the sampling
noise in the squared distance is about ``D (1/n_a + 1/n_b)`` (96 for groups
of 8 in 384 dimensions), while a MiniLM diff that fools the paper's attacker
still leaves a squared distance of about 25 (docs/efficacy.md, "Stop 13").
Its gradient then mostly chases each batch's own noise.

:func:`fisher_loss` keeps an exponential moving average of each group
pair's mean difference (not differentiated) and differentiates the first-
order expansion of the squared distance around it::

    L = (2 d . b - d . d) / D

``b`` the batch's whitened mean difference (differentiated), ``d`` the
running one (this batch included). The value is the squared distance to
first order; the gradient ``2 d . db / D`` points along the persistent
direction the groups differ in (a running LDA direction), and its noise
shrinks with the average's length. Both vectors are divided by the square
root of the batch's own whitened scale (the median variance of the seen
coordinates, :func:`objectives.mmd.whitened_scale`, differentiated), so
shrinking the representation lowers nothing; the running difference is
stored in units of the batch's spread, so a representation whose scale
drifts is still compared in the same units.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def init_mean_differences(num_pairs: int, dim: int) -> dict[str, jax.Array]:
    """Empty running mean differences of ``num_pairs`` group pairs."""
    return {
        "diff": jnp.zeros((num_pairs, dim), jnp.float32),
        "weight": jnp.zeros((num_pairs,), jnp.float32),
    }


def pair_weights(
    labels: jax.Array,
    strata: Sequence[jax.Array],
    num_classes: int,
) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """``(a, b, size)`` member weights of every (stratum, one-vs-rest split).

    ``strata`` are [B] non-negative weights (a task class's members, or the
    whole batch, possibly reweighted); a binary attribute has one split
    (value 0 against 1), a multi-class one a split per value.
    """
    splits = range(1) if num_classes == 2 else range(num_classes)
    out = []
    for s in strata:
        for c in splits:
            out.append((s * (labels == c), s * (labels != c), jnp.sum(s > 0)))
    return out


def _mean_difference(h, a, b):
    mean_a = (a @ h) / jnp.maximum(jnp.sum(a), 1e-12)
    mean_b = (b @ h) / jnp.maximum(jnp.sum(b), 1e-12)
    valid = (jnp.sum(a > 0) >= 1) & (jnp.sum(b > 0) >= 1)
    return mean_a - mean_b, valid


def fisher_loss(
    h: jax.Array,
    pairs: Sequence[tuple[jax.Array, jax.Array, jax.Array]],
    state: dict[str, jax.Array],
    *,
    white: jax.Array,
    scale: jax.Array,
    decay: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The running-direction squared distance of the groups, and the new state.

    Args:
      h: [B, D] representations (raw; only their detached group means are
        stored).
      pairs: from :func:`pair_weights`.
      state: from :func:`init_mean_differences` with ``len(pairs)`` rows.
      white: [D, D] the whitening map (``h @ white`` is the whitened batch;
        not differentiated).
      scale: the batch's whitened scale (differentiated).
      decay: the running average's decay per step.

    Returns:
      ``(loss, new_state)``: the loss is the mean over the valid pairs,
      weighted by their stratum's batch size (0 if none is valid).
    """
    h = h.astype(jnp.float32)
    white = jax.lax.stop_gradient(white)
    d = h.shape[-1]
    spread = jax.lax.stop_gradient(jnp.sqrt(jnp.mean(jnp.var(h, 0))) + 1e-12)
    root = jnp.sqrt(scale)
    rows, weights, total, norm = [], [], 0.0, 0.0
    for i, (a, b, size) in enumerate(pairs):
        diff, valid = _mean_difference(h, a, b)
        keep = jnp.where(valid, decay, 1.0)
        stored = keep * state["diff"][i] + jnp.where(
            valid, (1.0 - decay) * jax.lax.stop_gradient(diff) / spread, 0.0
        )
        weight = keep * state["weight"][i] + jnp.where(valid, 1.0 - decay, 0.0)
        rows.append(stored)
        weights.append(weight)
        running = stored / jnp.maximum(weight, 1e-12) * spread
        run_w = jax.lax.stop_gradient((running @ white) / root)
        batch_w = (diff @ white) / root
        value = (2.0 * run_w @ batch_w - run_w @ run_w) / d
        total = total + jnp.where(valid, size * value, 0.0)
        norm = norm + jnp.where(valid, size, 0.0)
    new = {"diff": jnp.stack(rows), "weight": jnp.stack(weights)}
    return total / jnp.maximum(norm, 1.0), new
