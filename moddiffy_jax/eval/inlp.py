"""Iterative Nullspace Projection (INLP; Ravfogel et al., 2020).

A post-hoc baseline on frozen representations: repeatedly fit a linear
classifier for the protected attribute on the projected representations,
collect the directions it uses, and project them out. The final projection
is ``P = I - Q Q^T`` where ``Q`` [H, r] is an orthonormal basis of the span of
*all* collected directions (the projection onto the intersection of the
classifiers' nullspaces), computed by SVD, not as a product of per-step
projections.

Directions: a softmax classifier with kernel ``W`` [H, C] depends only on the
differences of its columns (adding a vector to every column leaves the
softmax unchanged), so each iteration contributes the span of the centered
columns ``W - mean_c W[:, c]``: rank ``C - 1`` (one direction for a binary
attribute, as in the paper's binary SVM).

Stopping: after ``n_iterations`` iterations, or earlier once a classifier's
dev accuracy is within ``stop_margin`` of the dev majority-class rate (its
directions are then not added: there is nothing left to remove linearly, and
the deterministic fit would find the same thing again).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from moddiffy_jax.eval import metrics
from moddiffy_jax.eval.probe_inputs import check_splits
from moddiffy_jax.eval.probes import fit_logistic_regression

__all__ = ["INLPResult", "apply_projection", "fit_inlp", "nullspace_projection"]


@dataclasses.dataclass(frozen=True)
class INLPResult:
    """Outcome of :func:`fit_inlp`.

    Attributes:
      projection: [H, H] float32 symmetric projection ``P = I - Q Q^T``.
      directions: [H, r] float32 orthonormal basis ``Q`` of the removed span.
      dev_accuracy: [T] dev accuracy of the classifier fit at each iteration
        (before its directions were removed); ``T`` iterations were run.
      dev_balanced_accuracy: [T] the same, balanced (``NaN`` if undefined).
      majority_rate: Dev majority-class rate (the chance level of accuracy).
      num_removed: Iterations whose directions were removed.
    """

    projection: np.ndarray
    directions: np.ndarray
    dev_accuracy: np.ndarray
    dev_balanced_accuracy: np.ndarray
    majority_rate: float
    num_removed: int


def nullspace_projection(directions, *, dim: int, rank_tol: float = 1e-6):
    """Projection onto the orthogonal complement of ``span(directions)``.

    Args:
      directions: [H, m] column vectors (any scale, possibly dependent); may
        have ``m = 0``.
      dim: ``H``.
      rank_tol: Singular values below ``rank_tol * max singular value`` count
        as zero.

    Returns:
      ``(P [H, H], Q [H, r])`` in float64 with ``P = I - Q Q^T`` and ``Q`` an
      orthonormal basis of the span.
    """
    directions = np.asarray(directions, dtype=np.float64).reshape(dim, -1)
    if directions.shape[1] == 0 or not np.any(directions):
        return np.eye(dim), np.zeros((dim, 0))
    u, s, _ = np.linalg.svd(directions, full_matrices=False)
    basis = u[:, s > rank_tol * s.max()]
    return np.eye(dim) - basis @ basis.T, basis


def apply_projection(h, projection):
    """Projects representations: ``h @ P`` (P is symmetric).

    Args:
      h: [..., H] numpy or jax array.
      projection: [H, H] projection matrix from :func:`fit_inlp`.

    Returns:
      [..., H] projected representations, same array type as ``h``.
    """
    return h @ projection.astype(h.dtype)


def fit_inlp(
    train_h,
    train_y,
    dev_h,
    dev_y,
    *,
    num_classes: int,
    n_iterations: int = 10,
    stop_margin: float | None = 0.01,
    l2: float = 1e-3,
    max_steps: int = 500,
    tol: float = 1e-5,
    class_weighted: bool = False,
    rank_tol: float = 1e-6,
) -> INLPResult:
    """Runs INLP for a protected attribute.

    Args:
      train_h: [N_train, H] representations the classifiers are fit on.
      train_y: [N_train] int attribute labels in ``[0, num_classes)``.
      dev_h: [N_dev, H] representations for the stopping criterion.
      dev_y: [N_dev] int labels.
      num_classes: Number of attribute values ``C >= 2``.
      n_iterations: Maximum number of classifiers.
      stop_margin: Stop once dev accuracy <= majority rate + ``stop_margin``;
        ``None`` runs all ``n_iterations``.
      l2: L2 penalty of the logistic regressions.
      max_steps: L-BFGS iteration cap per classifier.
      tol: L-BFGS gradient-norm tolerance.
      class_weighted: Class-balanced loss weights (for skewed attributes).
      rank_tol: Relative singular-value cutoff for the removed span.

    Returns:
      An :class:`INLPResult`.

    Raises:
      ValueError: On malformed inputs or a single-class train split.
    """
    if n_iterations < 1:
        raise ValueError(f"n_iterations must be >= 1, got {n_iterations}.")
    splits, _ = check_splits(
        {"train": (train_h, train_y), "dev": (dev_h, dev_y)}, num_classes
    )
    (x_train, y_train), (x_dev, y_dev) = splits["train"], splits["dev"]
    dim = x_train.shape[1]
    majority_rate = float(np.bincount(y_dev).max() / y_dev.size)

    collected = np.zeros((dim, 0))
    projection, basis = np.eye(dim), np.zeros((dim, 0))
    dev_acc, dev_bacc = [], []
    for _ in range(n_iterations):
        p32 = projection.astype(np.float32)
        kernel, bias, _, _ = fit_logistic_regression(
            x_train @ p32,
            y_train,
            num_classes=num_classes,
            l2=l2,
            max_steps=max_steps,
            tol=tol,
            class_weighted=class_weighted,
        )
        pred = np.argmax((x_dev @ p32) @ kernel + bias, axis=-1)
        dev_acc.append(metrics.accuracy(y_dev, pred))
        dev_bacc.append(metrics.balanced_accuracy(y_dev, pred, num_classes))
        if stop_margin is not None and dev_acc[-1] <= majority_rate + stop_margin:
            break
        # The classifier saw x @ P, so its effective directions are P @ W.
        centered = projection @ (kernel - kernel.mean(axis=1, keepdims=True))
        collected = np.concatenate([collected, centered], axis=1)
        projection, basis = nullspace_projection(collected, dim=dim, rank_tol=rank_tol)
    num_removed = collected.shape[1] // max(num_classes, 1)
    return INLPResult(
        projection=projection.astype(np.float32),
        directions=basis.astype(np.float32),
        dev_accuracy=np.asarray(dev_acc),
        dev_balanced_accuracy=np.asarray(dev_bacc),
        majority_rate=majority_rate,
        num_removed=num_removed,
    )
