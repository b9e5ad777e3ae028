"""Attribute removal by maximum mean discrepancy (MMD) between attribute groups.

The MoDDiffy paper removes an attribute by minimising the MMD (Gretton et al.
2012) between the representations of the attribute's groups. The reference
code has no MMD, so the choices here are ours, and they are made so that the
minimiser is *removal*, not collapse:

* **Unbiased estimator** (the U-statistic, Gretton et al. 2012, eq. 3): the
  within-group sums leave out the diagonal. The biased V-statistic adds
  ``E k(x, x) / n`` terms that shrink when the groups shrink, so on small
  per-batch groups it rewards collapsing the representation; its floor on
  random features with a 6/26 split is about 0.45, where the unbiased one is
  0 in expectation. A group needs at least 2 members in the batch.
* **Scale-invariant kernels.** ``gaussian``: a mean of Gaussian kernels with
  bandwidths ``s_j^2 = m * 2**j``, ``j in (-2, ..., 2)``, where ``m`` is the
  batch's mean pairwise squared distance, *differentiated through* (no
  stop-gradient), so shrinking or inflating the representation changes
  nothing. ``linear``: ``k(x, y) = x . y / v`` with ``v`` the batch's total
  variance (also differentiated through); its MMD^2 is the squared distance
  between the group means, so driving it to zero is first-moment matching:
  the condition under which no linear probe beats a constant (LEACE, Belrose
  et al. 2023). ``both`` sums the two.
* **Task-conditional** (``task`` given): the groups are compared within each
  task class and the per-class values averaged (weighted by class size), or,
  with ``joint`` (the training data's task/attribute table), reweighted so
  that each group has the marginal task distribution. A
  representation that keeps the task then keeps only the attribute
  information the task label implies (the "floor"), instead of fighting the
  task when the attribute correlates with it.
* Multi-class attributes: one-vs-rest, averaged over the splits whose two
  sides have at least 2 members.
* **Whitening** (optional, :func:`whiten` with a running covariance from
  :func:`update_covariance`): the kernels then see the representations in
  the metric of their within-group covariance, the metric a linear probe
  (Fisher's discriminant) reads them in. Without it, a diff can meet raw
  Euclidean MMD while a fresh probe still separates the groups along
  low-variance directions; and it can inflate one irrelevant direction to
  blunt the Gaussian kernels' median bandwidth. Both were measured on
  MiniLM (docs/efficacy.md): the age diff cut the squared distance of the
  group means by 99% and their Mahalanobis distance by only 3x, and 82% of
  the within-group variance sat in one direction it had blown up.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

DEFAULT_BANDWIDTH_EXPONENTS = (-2, -1, 0, 1, 2)
KERNELS = ("gaussian", "linear", "both")


def _sq_distances(h: jax.Array) -> jax.Array:
    sq = jnp.sum(h * h, -1)
    return jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * h @ h.T, 0.0)


def kernel_matrix(
    h: jax.Array,
    weights: jax.Array | None = None,
    *,
    kernel: str = "gaussian",
    exponents=DEFAULT_BANDWIDTH_EXPONENTS,
    whitened: bool = False,
    seen: jax.Array | None = None,
) -> jax.Array:
    """Scale-invariant kernel matrix of the rows of ``h`` [B, D] -> [B, B].

    Args:
      h: [B, D] representations.
      weights: optional [B]; rows with weight 0 (padding) do not enter the
        bandwidth or the variance.
      kernel: ``"gaussian"``, ``"linear"`` or ``"both"`` (see module docstring).
      exponents: bandwidth exponents of the Gaussian kernels.
      whitened: ``h`` comes from :func:`whiten`. The kernels' scale is then
        ``s``, the median over the coordinates of the batch's variance
        (differentiated through): the linear kernel is ``x . y / (D s)`` and
        the Gaussian bandwidths are ``2 D s 2**j``. Dividing by the batch's
        total variance instead would let the representation shrink the mean
        difference's weight by inflating one irrelevant direction (measured
        on the tiny regression test: the diff then raised the leakage); a
        fixed ``D`` (the running covariance's scale) let it shrink the whole
        representation, which the lagging statistics read as removal
        (measured on MiniLM: the age diff cut the representation's spread
        24-fold and kept its task accuracy, at a task loss near ln 2).
      seen: optional [D] 0/1 mask of the whitened coordinates whose variance
        sets the scale (from ``whiten(..., return_seen=True)``): a young
        running covariance has seen few directions, and the median over the
        rest would be the noise of its null space.
    """
    if kernel not in KERNELS:
        raise ValueError(f"Unknown MMD kernel {kernel!r}; valid: {KERNELS}.")
    h = h.astype(jnp.float32)
    w = jnp.ones(h.shape[0], jnp.float32) if weights is None else weights
    w = (w > 0).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w), 2.0)
    d = h.shape[-1]
    mean = jnp.sum(h * w[:, None], 0) / n
    centered = (h - mean) * w[:, None]
    if whitened:
        scale = whitened_scale(h, weights, seen)
    out = 0.0
    if kernel in ("gaussian", "both"):
        d2 = _sq_distances(h)
        if whitened:
            mean_d2 = 2.0 * d * scale
        else:
            pair_w = w[:, None] * w[None, :] * (1.0 - jnp.eye(h.shape[0]))
            mean_d2 = jnp.maximum(jnp.sum(d2 * pair_w) / (n * (n - 1.0)), 1e-12)
        out = out + sum(jnp.exp(-d2 / (2.0 * mean_d2 * 2.0**e)) for e in exponents) / (
            len(exponents)
        )
    if kernel in ("linear", "both"):
        if whitened:
            var = d * scale
        else:
            var = jnp.maximum(jnp.sum(centered * centered) / (n - 1.0), 1e-12)
        out = out + (centered @ centered.T) / var
    return out


def whitened_scale(
    h: jax.Array, weights: jax.Array | None = None, seen: jax.Array | None = None
) -> jax.Array:
    """The batch's scale in the whitened basis: the median over the (seen)
    coordinates of their variance, differentiated through.

    Shrinking the whole representation (the statistics lag behind) changes
    nothing once divided by it, and inflating a few directions does not
    move it. ``seen`` (from ``whiten(..., return_seen=True)``) limits the
    median to the directions the running statistics have seen.
    """
    h = h.astype(jnp.float32)
    w = jnp.ones(h.shape[0], jnp.float32) if weights is None else weights
    w = (w > 0).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w), 2.0)
    centered = (h - jnp.sum(h * w[:, None], 0) / n) * w[:, None]
    coord_var = jnp.sum(centered * centered, 0) / (n - 1.0)
    if seen is not None:
        coord_var = jnp.where(seen > 0, coord_var, jnp.nan)
    return jnp.maximum(jnp.nanmedian(coord_var), 1e-12)


def unbiased_mmd2(
    k: jax.Array, a: jax.Array, b: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Unbiased MMD^2 between two (weighted) groups over ``k``'s rows.

    Args:
      k: [B, B] kernel matrix.
      a: [B] non-negative weights of group A's members (0/1 for plain groups).
      b: [B] weights of group B's members (disjoint from A).

    Returns:
      ``(value, valid)``: the weighted U-statistic (pairs ``i != j`` only,
      normalised by the pairs' total weight), and whether both groups have
      at least 2 members (``value`` is 0 where not).
    """
    off = 1.0 - jnp.eye(k.shape[0], dtype=k.dtype)
    valid = (jnp.sum(a > 0) >= 2) & (jnp.sum(b > 0) >= 2)

    def within(w):
        pairs = jnp.sum(w) ** 2 - jnp.sum(w * w)
        return (w @ (k * off) @ w) / jnp.maximum(pairs, 1e-12)

    kab = (a @ k @ b) / jnp.maximum(jnp.sum(a) * jnp.sum(b), 1e-12)
    return jnp.where(valid, within(a) + within(b) - 2.0 * kab, 0.0), valid


def importance_weights(joint: Any, task: jax.Array, labels: jax.Array) -> jax.Array:
    """[B] ``P(a) / P(a | y)`` of each row from the train split's [T][C]
    joint table ``P(y, a)``: so weighted, the attribute's groups carry the
    same task mix (what ``mmd_conditional="reweight"`` compares)."""
    joint = jnp.asarray(joint, jnp.float32)
    p_a = jnp.sum(joint, 0)
    p_a_given_y = joint / jnp.maximum(jnp.sum(joint, 1, keepdims=True), 1e-12)
    return p_a[labels] / jnp.maximum(p_a_given_y[task, labels], 1e-12)


def mmd_loss(
    h: jax.Array,
    labels: jax.Array,
    *,
    num_classes: int,
    task: jax.Array | None = None,
    num_task_classes: int = 0,
    joint: jax.Array | None = None,
    weights: jax.Array | None = None,
    kernel: str = "gaussian",
    exponents=DEFAULT_BANDWIDTH_EXPONENTS,
    center_task: bool = False,
    whitened: bool = False,
    seen: jax.Array | None = None,
) -> jax.Array:
    """Unbiased, optionally task-conditional, one-vs-rest MMD^2 of an attribute.

    Args:
      h: [B, D] representations.
      labels: [B] int attribute values in ``[0, num_classes)``.
      num_classes: number of attribute classes (static).
      task: optional [B] int task labels; if given, the groups are compared
        within each task class (``num_task_classes`` of them, static).
      num_task_classes: number of task classes (needed with ``task``).
      joint: optional [T, C] joint distribution of (task, attribute) on the
        training data. With ``task`` and ``joint``, the groups are not split by
        task class but *reweighted*: member ``i`` gets ``P(a_i) / P(a_i |
        y_i)``, so every attribute group has the marginal task distribution,
        and the whole batch enters one comparison (stratifying instead leaves
        cells of 0-2 members when the attribute follows the task).
      weights: optional [B] example weights; 0 drops an example (padding).
      kernel: ``"gaussian"``, ``"linear"`` or ``"both"``.
      exponents: bandwidth exponents of the Gaussian kernels.
      center_task: with ``task``, first subtract from each row the batch mean
        of its task class (differentiated through), so the groups are
        compared on what is left once the task is accounted for. With
        ``joint`` this is the ``residual`` conditioning: reweighting alone
        leaves the distance between the task classes in the kernel, where
        the sampling noise of a few heavily weighted members is largest, and
        shrinking that distance (losing the task) then lowers the estimate.
      whitened: ``h`` comes from :func:`whiten` (see :func:`kernel_matrix`).
      seen: see :func:`kernel_matrix`.

    Returns:
      A scalar: the mean over the valid (task class, one-vs-rest split) pairs,
      weighted by the task class's batch size; 0 if no pair is valid.
    """
    w = jnp.ones(h.shape[0], jnp.float32) if weights is None else weights
    w = (w > 0).astype(jnp.float32)
    if center_task:
        if task is None or num_task_classes < 1:
            raise ValueError("center_task needs task labels and num_task_classes.")
        h, _ = _centre_in_groups(h, task, num_task_classes, w)
    k = kernel_matrix(
        h, weights, kernel=kernel, exponents=exponents, whitened=whitened, seen=seen
    )
    if task is not None and joint is not None:
        iw = w * importance_weights(joint, task, labels)
        splits = range(1) if num_classes == 2 else range(num_classes)
        total, norm = 0.0, 0.0
        for c in splits:
            value, valid = unbiased_mmd2(k, iw * (labels == c), iw * (labels != c))
            total = total + value
            norm = norm + valid.astype(jnp.float32)
        return total / jnp.maximum(norm, 1.0)
    if task is None:
        strata = [w]
    else:
        if num_task_classes < 1:
            raise ValueError("mmd_loss with task labels needs num_task_classes >= 1.")
        strata = [w * (task == t) for t in range(num_task_classes)]
    splits = range(1) if num_classes == 2 else range(num_classes)
    total, norm = 0.0, 0.0
    for s in strata:
        size = jnp.sum(s)
        for c in splits:
            value, valid = unbiased_mmd2(k, s * (labels == c), s * (labels != c))
            total = total + size * value
            norm = norm + size * valid.astype(jnp.float32)
    return total / jnp.maximum(norm, 1.0)


def within_group_scatter(
    h: jax.Array,
    labels: jax.Array,
    *,
    num_classes: int,
    task: jax.Array | None = None,
    num_task_classes: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Scatter of ``h`` about its (task class, attribute value) cell means.

    Args:
      h: [B, D] representations.
      labels: [B] int attribute values in ``[0, num_classes)``.
      num_classes: number of attribute classes (static).
      task: optional [B] task labels; cells are (task, attribute) pairs if
        given, attribute values otherwise.
      num_task_classes: number of task classes (needed with ``task``).

    Returns:
      ``(scatter, dof)``: the [D, D] sum of outer products of the centred rows
      and its degrees of freedom (rows minus non-empty cells), so that
      ``scatter / dof`` is the pooled within-cell covariance.
    """
    cell = labels.astype(jnp.int32)
    n_cells = num_classes
    if task is not None:
        cell = task.astype(jnp.int32) * num_classes + cell
        n_cells = num_classes * max(num_task_classes, 1)
    centred, counts = _centre_in_groups(h.astype(jnp.float32), cell, n_cells)
    dof = h.shape[0] - jnp.sum(counts > 0)
    return centred.T @ centred, dof.astype(jnp.float32)


def _centre_in_groups(
    h: jax.Array, groups: jax.Array, num_groups: int, weights: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``h`` minus its group's mean (rows of weight 0 neither count nor move)."""
    onehot = jax.nn.one_hot(groups, num_groups, dtype=jnp.float32)
    if weights is not None:
        onehot = onehot * weights[:, None]
    counts = jnp.sum(onehot, 0)
    means = (onehot.T @ h) / jnp.maximum(counts, 1.0)[:, None]
    return h - onehot @ means, counts


def init_covariance(dim: int) -> dict[str, jax.Array]:
    """Empty running statistics for :func:`update_covariance` (all zeros).

    Every leaf is its own buffer: the train step donates the trainable tree,
    and one array in two leaves would be donated twice.
    """
    return {
        "cov": jnp.zeros((dim, dim), jnp.float32),
        "weight": jnp.zeros((), jnp.float32),
        "weight_sq": jnp.zeros((), jnp.float32),
        "rows": jnp.zeros((), jnp.float32),
    }


def update_covariance(
    stats: dict[str, jax.Array],
    h: jax.Array,
    labels: jax.Array,
    *,
    num_classes: int,
    task: jax.Array | None = None,
    num_task_classes: int = 0,
    decay: float = 0.98,
) -> dict[str, jax.Array]:
    """One step of a running (exponential moving average) within-cell covariance.

    ``stats`` is ``{"cov": [D, D], "weight": [], "weight_sq": [], "rows": []}``,
    all zeros at the start; ``stats["cov"] / stats["weight"]`` is the
    bias-corrected estimate (as in Adam). ``weight_sq`` (the sum of squared
    EMA weights) and ``rows`` (the EMA of each batch's degrees of freedom)
    give the estimate's effective sample size, which :func:`whiten` uses to
    shrink a young estimate. A batch with fewer than 2 degrees of freedom
    leaves the statistics unchanged. No gradient flows into them.
    """
    scatter, dof = within_group_scatter(
        jax.lax.stop_gradient(h),
        labels,
        num_classes=num_classes,
        task=task,
        num_task_classes=num_task_classes,
    )
    ok = dof >= 2.0
    batch_cov = scatter / jnp.maximum(dof, 1.0)

    def ema(key, value, power=1):
        mixed = decay**power * stats[key] + (1.0 - decay) ** power * value
        return jnp.where(ok, mixed, stats[key])

    return {
        "cov": ema("cov", batch_cov),
        "weight": ema("weight", 1.0),
        "weight_sq": ema("weight_sq", 1.0, power=2),
        "rows": ema("rows", dof),
    }


def effective_rows(stats: dict[str, jax.Array]) -> jax.Array:
    """Effective number of rows behind a running covariance (Kish's formula).

    With EMA weights ``w_i`` on batches of ``dof_i`` rows this is
    ``sum(w_i dof_i) * sum(w_i) / sum(w_i^2)``: the batch's rows after one
    step, about ``dof (1 + decay) / (1 - decay)`` at steady state. Statistics
    without the counters (written by hand) count as fully estimated.
    """
    if "rows" not in stats or "weight_sq" not in stats:
        return jnp.asarray(jnp.inf, jnp.float32)
    return stats["rows"] * stats["weight"] / jnp.maximum(stats["weight_sq"], 1e-30)


def whiten(
    h: jax.Array,
    stats: dict[str, jax.Array],
    *,
    shrinkage: float = 0.1,
    return_seen: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``h`` in the metric of the running covariance: ``(h V) (L + r)^-1/2``.

    ``V L V^T = C`` is the bias-corrected running covariance's
    eigendecomposition, so squared distances become Mahalanobis distances
    (in ``C + r I``) and any linear kernel on the result measures the Fisher
    separation of the groups. The ridge is ``r = shrinkage * g``, ``g`` the
    geometric mean of the ``k`` largest eigenvalues, ``k`` the estimate's
    effective number of rows (:func:`effective_rows`, at most ``D``):

    - the geometric, not the arithmetic, mean: a representation that
      inflates one direction would otherwise raise the ridge and hide every
      other direction from the kernel;
    - of the ``k`` largest only: a young estimate from a few batches has
      rank far below ``D``, and the mean over its null space is near 0, so
      the ridge would vanish and whitening blow the null space up (the first
      steps' loss is then noise thousands of times the signal, and a dense
      diff that follows it loses the task). Statistics without the counters
      (written by hand) use all ``D``.

    With ``return_seen``, also the [D] 0/1 mask of those ``k`` coordinates
    (the kernels' scale is read from them, :func:`kernel_matrix`).

    The whitening matrix is not differentiated (the representation cannot
    move it). Before any statistics exist (weight 0), ``h`` is returned
    unchanged.
    """
    h = h.astype(jnp.float32)
    matrix, seen = whitening_map(stats, shrinkage=shrinkage)
    white = h @ matrix
    if return_seen:
        return white, seen
    return white


def whitening_map(
    stats: dict[str, jax.Array], *, shrinkage: float = 0.1
) -> tuple[jax.Array, jax.Array]:
    """The [D, D] map :func:`whiten` applies (``V (L + r)^-1/2``; the identity
    before any statistics exist) and its [D] seen mask. Not differentiated."""
    d = stats["cov"].shape[-1]
    weight = jax.lax.stop_gradient(stats["weight"])
    cov = jax.lax.stop_gradient(stats["cov"]) / jnp.maximum(weight, 1e-12)
    eigval, eigvec = jnp.linalg.eigh(cov)  # ascending
    eigval = jnp.maximum(eigval, 0.0)
    floor = 1e-3 * jnp.mean(eigval) + 1e-9
    seen = jnp.clip(jax.lax.stop_gradient(effective_rows(stats)), 1.0, d)
    top = (jnp.arange(d) >= d - seen).astype(jnp.float32)
    geo_mean = jnp.exp(jnp.sum(top * jnp.log(eigval + floor)) / jnp.sum(top))
    ridge = shrinkage * geo_mean + 1e-6
    matrix = eigvec * jax.lax.rsqrt(eigval + ridge)[None, :]
    started = weight > 0.0
    matrix = jnp.where(started, matrix, jnp.eye(d, dtype=jnp.float32))
    return matrix, jnp.where(started, top, jnp.ones_like(top))
