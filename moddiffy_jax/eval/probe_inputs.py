"""Input checks and preprocessing shared by the probes (``eval.probes``)
and INLP (``eval.inlp``): shape and label checks, the train split's
standardization, class weights and padding to evaluation chunks."""

from __future__ import annotations

import numpy as np


def check_split(h, y, num_classes: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    h = np.asarray(h)
    y = np.asarray(y)
    if h.ndim != 2 or y.ndim != 1:
        raise ValueError(
            f"{name}: h must be [N, H] and y [N], got {h.shape}, {y.shape}."
        )
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"{name}: h has {h.shape[0]} rows but y has {y.shape[0]}.")
    if h.shape[0] == 0:
        raise ValueError(f"{name} split is empty.")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{name}: labels must be integers, got {y.dtype}.")
    if y.min() < 0 or y.max() >= num_classes:
        raise ValueError(f"{name}: labels outside [0, {num_classes}).")
    if not np.all(np.isfinite(h)):
        raise ValueError(f"{name}: representations contain NaN or inf.")
    return h.astype(np.float32), y.astype(np.int32)


def check_splits(splits: dict, num_classes: int) -> tuple[dict, list[str]]:
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}.")
    checked = {k: check_split(*v, num_classes, k) for k, v in splits.items()}
    widths = {h.shape[1] for h, _ in checked.values()}
    if len(widths) != 1:
        raise ValueError(f"Splits differ in feature width: {widths}.")
    n_train_classes = np.unique(checked["train"][1]).size
    if n_train_classes < 2:
        raise ValueError(
            "train split has a single class: a probe cannot be trained and "
            "balanced accuracy is undefined."
        )
    notes = []
    for k, (_, y) in checked.items():
        if k != "train" and np.unique(y).size < 2:
            notes.append(f"{k} balanced_accuracy undefined: one class in {k} split.")
    return checked, notes


def standardizer(train_h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(mean, scale)`` of the train representations, per feature.

    A probe reads ``(h - mean) / scale``, so its leakage does not depend on
    the representation's scale: a diff that shrinks the representation
    (the L2 penalty and the fixed learning rate then act as a far stronger
    regulariser) does not look like removal. Features that are constant on
    train get scale 1.

    Both are summed in float64. numpy's float32 reductions sum in blocks
    that depend on where the array sits in memory, so a column that is
    exactly constant (a coordinate a diff holds at its mean: the task
    bottleneck, the discriminant's diff) got a spurious scale of 1e-7 to
    4e-5 or none, by the array's address; with one, such columns became
    hundreds of constant inputs of size up to 1, and the converged MLP read
    dwmw17's bottleneck row at chance (0.500) where the same bytes at
    another address read 0.845 (stop 76).
    """
    mean = np.mean(train_h, axis=0, dtype=np.float64)
    scale = np.std(train_h, axis=0, dtype=np.float64)
    tiny = scale <= 1e-6 * max(float(scale.max()), 1e-30)
    return mean.astype(np.float32), np.where(tiny, 1.0, scale).astype(np.float32)


def standardized(splits: dict, enabled: bool) -> tuple[dict, np.ndarray, np.ndarray]:
    width = splits["train"][0].shape[1]
    if not enabled:
        return splits, np.zeros(width, np.float32), np.ones(width, np.float32)
    mean, scale = standardizer(splits["train"][0])
    out = {k: ((h - mean) / scale, y) for k, (h, y) in splits.items()}
    return out, mean, scale


def whitener(train_h: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    """``(mean, matrix)``: a probe reads ``(h - mean) @ matrix``, the train
    representations in the metric of their own covariance (ZCA, with a
    ridge of ``ridge`` times the mean eigenvalue).

    Any invertible linear map of a representation carries the same
    information; whitened, the probe's leakage does not depend on which
    directions hold little variance. Per-feature standardization is not
    enough: a diff can move an attribute into a direction of small variance
    across features, where a probe trained by gradient steps with weight
    decay underfits (measured on MiniLM: an age diff read at 0.75 balanced
    accuracy standardized and at 0.92 whitened, docs/efficacy.md "Stop 23").
    """
    x = train_h.astype(np.float64)
    mean = x.mean(0)
    cov = np.cov(x - mean, rowvar=False).reshape(x.shape[1], x.shape[1])
    eig, vec = np.linalg.eigh(cov)
    eig = np.maximum(eig, 0.0)
    floor = ridge * max(float(eig.mean()), 1e-30)
    matrix = (vec / np.sqrt(eig + floor)) @ vec.T
    return mean.astype(np.float32), matrix.astype(np.float32)


def prepared(splits: dict, *, standardize: bool, whiten: bool, ridge: float) -> dict:
    """``splits`` whitened (:func:`whitener`), else standardized
    (:func:`standardized`) or as they are."""
    if not whiten:
        return standardized(splits, standardize)[0]
    mean, matrix = whitener(splits["train"][0], ridge)
    return {k: ((h - mean) @ matrix, y) for k, (h, y) in splits.items()}


def class_weights(y: np.ndarray, num_classes: int, enabled: bool) -> np.ndarray:
    """``N / (C * n_c)`` (sklearn "balanced"); 1 everywhere when disabled."""
    if not enabled:
        return np.ones(num_classes, np.float32)
    counts = np.bincount(y, minlength=num_classes).astype(np.float64)
    weights = y.size / (num_classes * np.maximum(counts, 1))
    return weights.astype(np.float32)


def pad_to_chunks(h: np.ndarray, y: np.ndarray, chunk: int):
    """[N, H], [N] -> [n, chunk, H], [n, chunk], mask [n, chunk]."""
    chunk = min(chunk, h.shape[0])
    n = -(-h.shape[0] // chunk)
    pad = n * chunk - h.shape[0]
    mask = np.concatenate([np.ones(h.shape[0], bool), np.zeros(pad, bool)])
    h = np.concatenate([h, np.zeros((pad, h.shape[1]), h.dtype)])
    y = np.concatenate([y, np.zeros(pad, y.dtype)])
    return (
        h.reshape(n, chunk, -1),
        y.reshape(n, chunk),
        mask.reshape(n, chunk),
    )
