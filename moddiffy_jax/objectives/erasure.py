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


# --------------------------------------------------------------------------
# Erased targets: the core's representation with the attribute's cell
# offsets taken out.


def init_cell_means(num_task_classes: int, num_classes: int, dim: int):
    """Empty running means of each (task class, attribute value) cell."""
    return {
        "sum": jnp.zeros((num_task_classes, num_classes, dim), jnp.float32),
        "weight": jnp.zeros((num_task_classes, num_classes), jnp.float32),
    }


def update_cell_means(
    state: dict[str, jax.Array],
    h: jax.Array,
    task: jax.Array,
    labels: jax.Array,
    *,
    decay: float,
) -> dict[str, jax.Array]:
    """One EMA step of the cells' sums and member counts (``h`` detached).

    A cell absent from the batch keeps its estimate: the decay applies only
    to cells with members, so a rare cell's mean is not diluted towards 0.
    """
    h = jax.lax.stop_gradient(h.astype(jnp.float32))
    t, c = state["weight"].shape
    onehot = jax.nn.one_hot(task, t)[:, :, None] * jax.nn.one_hot(labels, c)[:, None]
    count = jnp.sum(onehot, 0)  # [T, C]
    sums = jnp.einsum("btc,bd->tcd", onehot, h)
    keep = jnp.where(count > 0, decay, 1.0)
    return {
        "sum": keep[..., None] * state["sum"]
        + jnp.where(count[..., None] > 0, (1.0 - decay) * sums, 0.0),
        "weight": keep * state["weight"]
        + jnp.where(count > 0, (1.0 - decay) * count, 0.0),
    }


def cell_offsets(state: dict[str, jax.Array]) -> jax.Array:
    """[T, C, D] each cell's running mean minus its task class's mean (the
    cells' means weighted by their running member counts); 0 for a cell not
    yet seen, or a class with a single seen cell."""
    weight = state["weight"]
    means = state["sum"] / jnp.maximum(weight, 1e-12)[..., None]
    return jnp.where(
        (weight > 0.0)[..., None], means - class_means(state)[:, None], 0.0
    )


def class_means(state: dict[str, jax.Array]) -> jax.Array:
    """[T, D] each task class's running mean (over all its cells)."""
    total = jnp.maximum(jnp.sum(state["weight"], 1), 1e-12)
    return jnp.sum(state["sum"], 1) / total[:, None]


#: How :func:`erased_target_loss` erases the anchor: ``"project"`` takes
#: each row's within-class deviation along the cells' (whitened) offset
#: directions out; ``"shift"`` moves each row by its own cell's offset.
TARGET_MODES = ("project", "shift")


def offset_directions(state: dict[str, jax.Array], white: jax.Array) -> jax.Array:
    """[D, D] the orthogonal projection onto the span of the attribute's
    whitened within-class offsets: for each value, the mean over its members
    of their cell's offset from its task class's mean. These ``C`` rows sum
    to 0 weighted by the values' sizes, so they span ``C - 1`` directions
    (near-zero singular directions are left out)."""
    weight = state["weight"]
    pooled = (
        jnp.einsum("tc,tcd->cd", weight, cell_offsets(state))
        / jnp.maximum(jnp.sum(weight, 0), 1e-12)[:, None]
    )
    u, s, _ = jnp.linalg.svd((pooled @ white).T, full_matrices=False)
    keep = (s > 1e-4 * jnp.maximum(jnp.max(s), 1e-12)).astype(u.dtype)
    return (u * keep) @ u.T


def overall_mean(state: dict[str, jax.Array]) -> jax.Array:
    """[D] the running mean over every cell."""
    return jnp.sum(state["sum"], (0, 1)) / jnp.maximum(jnp.sum(state["weight"]), 1e-12)


def erased_target_loss(
    h: jax.Array,
    anchor: jax.Array,
    task: jax.Array,
    labels: jax.Array,
    state: dict[str, jax.Array],
    *,
    white: jax.Array,
    mode: str = "project",
) -> jax.Array:
    """Mean whitened squared distance of ``h`` to its erased target.

    ``anchor`` [B, D] is the undebiased representation of the same inputs
    (the core's, under the same dropout). The target of row ``i``:

    * ``"project"``: in the whitened metric, the anchor with its component
      along the attribute's running within-class offset directions (pooled
      over the task classes) set to the running mean's: an oblique
      projection, LEACE's eraser (Belrose et al. 2023) along the
      directions in which the attribute's groups differ *within* a task
      class, so the task's own separation elsewhere is not erased. Every
      row then shares its coordinate along those directions, whether or not
      its attribute can be told from its input, and the target is a linear
      function of the anchor (a centring on each row's task class would
      make it depend on the gold label, and the least-squares fit would
      keep the attribute to guess the label; measured on toy data);
    * ``"shift"``: the anchor moved by its own (task class, attribute value)
      cell's offset to its class's mean; the groups' means then agree, but
      only where the diff can tell each row's attribute from its input
      (otherwise the least-squares fit shrinks the difference instead of
      removing it).

    The rest of the representation stays the core's, so the task is kept.
    Each row's target is fixed (anchor and statistics are not
    differentiated): the minimum does not move with the batch's noise.
    """
    if mode not in TARGET_MODES:
        raise ValueError(f"erased target mode {mode!r} is not one of {TARGET_MODES}.")
    offsets = jax.lax.stop_gradient(cell_offsets(state))
    white = jax.lax.stop_gradient(white)
    anchor = jax.lax.stop_gradient(anchor.astype(jnp.float32))
    moved = (h.astype(jnp.float32) - anchor) @ white
    if mode == "shift":
        resid = moved + offsets[task, labels] @ white
    else:
        state = jax.lax.stop_gradient(state)
        deviation = (anchor - overall_mean(state)) @ white
        resid = moved + deviation @ offset_directions(state, white)
    return jnp.mean(jnp.sum(resid**2, -1)) / h.shape[-1]
