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
pair's mean difference (not differentiated), whitens it into a unit
direction ``u`` (a running LDA direction, from the batches before this
one), and differentiates the batch's Fisher ratio along ``u`` only::

    L = ((m_a - m_b)^2 - var(m_a) - var(m_b)) / s^2 / D

``m_a``, ``m_b`` the batch's group means of the rows' coordinate along
``u``, ``var(m)`` their sampling variances (so the numerator is unbiased:
0 in expectation when the groups agree), ``s^2`` the groups' pooled
variance along ``u`` in the same batch, differentiated: shrinking the
representation, as a whole or along ``u`` only, lowers nothing. The noise of
the other ``D - 1`` directions is not in the gradient, and the minimum is
where the current batch's groups agree along the running direction.

Two earlier forms failed, measured: following the running difference itself
(``2 d . b``) has no minimum in the batch and, under Adam, drove the groups
past each other until the average turned (tiny regression test leakage
0.80 -> 0.88); dividing by the median whitened scale instead of the
variance along ``u`` let the MiniLM age diff shrink the directions the age
information sat in while the lagging covariance still called them wide
(in the loop the separation read ~0, a fresh probe still read 0.926).
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


def _group_stats(z, w):
    """Weighted mean, the variance of that mean, and the members' scatter
    about it, of the scalars ``z`` over the members of weight ``w``
    (effective size ``(sum w)^2 / sum w^2``)."""
    total = jnp.maximum(jnp.sum(w), 1e-12)
    mean = (w @ z) / total
    var = (w @ (z - mean) ** 2) / total
    eff = total**2 / jnp.maximum(jnp.sum(w * w), 1e-12)
    return mean, var / jnp.maximum(eff - 1.0, 1.0), var * total


def fisher_loss(
    h: jax.Array,
    pairs: Sequence[tuple[jax.Array, jax.Array, jax.Array]],
    state: dict[str, jax.Array],
    *,
    white: jax.Array,
    decay: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The groups' squared separation along their running direction, and the
    new state.

    Args:
      h: [B, D] representations (raw; only their detached group means are
        stored).
      pairs: from :func:`pair_weights`.
      state: from :func:`init_mean_differences` with ``len(pairs)`` rows.
      white: [D, D] the whitening map (``h @ white`` is the whitened batch;
        not differentiated).
      decay: the running average's decay per step.

    Returns:
      ``(loss, new_state)``: the loss is the mean over the valid pairs (both
      groups with at least 2 members, and a direction from earlier
      batches), weighted by their stratum's batch size (0 if none is
      valid).
    """
    h = h.astype(jnp.float32)
    white = jax.lax.stop_gradient(white)
    d = h.shape[-1]
    spread = jax.lax.stop_gradient(jnp.sqrt(jnp.mean(jnp.var(h, 0))) + 1e-12)
    rows, weights, total, norm = [], [], 0.0, 0.0
    for i, (a, b, size) in enumerate(pairs):
        mean_a = (a @ h) / jnp.maximum(jnp.sum(a), 1e-12)
        mean_b = (b @ h) / jnp.maximum(jnp.sum(b), 1e-12)
        diff = jax.lax.stop_gradient(mean_a - mean_b)
        seen = (jnp.sum(a > 0) >= 1) & (jnp.sum(b > 0) >= 1)
        valid = (jnp.sum(a > 0) >= 2) & (jnp.sum(b > 0) >= 2)
        keep = jnp.where(seen, decay, 1.0)
        stored = keep * state["diff"][i] + jnp.where(
            seen, (1.0 - decay) * diff / spread, 0.0
        )
        weight = keep * state["weight"][i] + jnp.where(seen, 1.0 - decay, 0.0)
        rows.append(stored)
        weights.append(weight)
        # The running difference whitened, as a unit vector; each row's
        # whitened coordinate along it.
        # From the batches before this one: a direction that includes this
        # batch's own noise would bias the separation along it upwards.
        direction = (state["diff"][i] / jnp.maximum(state["weight"][i], 1e-12)) @ white
        direction = direction / jnp.maximum(jnp.linalg.norm(direction), 1e-12)
        valid = valid & (state["weight"][i] > 0.0)
        z = h @ (white @ direction)
        za, noise_a, scatter_a = _group_stats(z, a)
        zb, noise_b, scatter_b = _group_stats(z, b)
        # The batch's own within-group variance along the direction
        # (differentiated): shrinking along it lowers nothing.
        pooled = (scatter_a + scatter_b) / jnp.maximum(
            jnp.sum(a) + jnp.sum(b) - 2.0, 1.0
        )
        value = ((za - zb) ** 2 - noise_a - noise_b) / (pooled + 1e-12) / d
        total = total + jnp.where(valid, size * value, 0.0)
        norm = norm + jnp.where(valid, size, 0.0)
    new = {"diff": jnp.stack(rows), "weight": jnp.stack(weights)}
    return total / jnp.maximum(norm, 1.0), new
