"""Host-side classification and fairness metrics (pure numpy).

Every function takes 1-D integer arrays of equal length ``N``: true labels
``y``, predictions ``pred`` and, where relevant, a protected attribute
``groups``. Empty inputs raise ``ValueError``; so do mismatched lengths and
labels outside ``[0, num_classes)``.

Undefined values are ``NaN``, never a made-up number, and each function says
when it returns one:

* :func:`balanced_accuracy` is the mean recall over the classes *present in*
  ``y``; with fewer than two classes present it is ``NaN`` (one present class
  makes it plain recall, which says nothing about balance; sklearn returns
  that recall with a warning instead).
* :func:`tpr_gap` is ``NaN`` for a class that occurs in fewer than two groups.
* Accuracy of an empty subset (a group, or the bias-conflicting examples) is
  ``NaN``.

The fairness metric of bias-in-bios (De-Arteaga et al., 2019) is
:func:`rms_tpr_gap`: for each class ``c`` the TPR gap is the spread (max - min)
over groups of the recall of ``c`` within the group (for a binary attribute,
``|TPR_{g=0,c} - TPR_{g=1,c}|``), and the summary is the root-mean-square over
classes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = [
    "accuracy",
    "accuracy_from_confusion",
    "balanced_accuracy",
    "balanced_accuracy_from_confusion",
    "bias_aligned_conflicting_accuracy",
    "confusion_matrix",
    "macro_f1",
    "per_group_accuracy",
    "rms_tpr_gap",
    "task_report",
    "tpr_gap",
]


def _as_labels(x, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}.")
    if arr.size == 0:
        raise ValueError(f"{name} is empty.")
    if not (np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_):
        if not np.all(np.equal(np.mod(arr, 1), 0)):
            raise ValueError(f"{name} must hold integer labels, got {arr.dtype}.")
    return arr.astype(np.int64)


def _check_pair(y, pred, num_classes: int | None = None):
    y = _as_labels(y, "y")
    pred = _as_labels(pred, "pred")
    if y.shape != pred.shape:
        raise ValueError(f"y {y.shape} and pred {pred.shape} differ in length.")
    if num_classes is not None:
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}.")
        for name, arr in (("y", y), ("pred", pred)):
            if arr.min() < 0 or arr.max() >= num_classes:
                raise ValueError(
                    f"{name} has labels outside [0, {num_classes}): "
                    f"min {arr.min()}, max {arr.max()}."
                )
    return y, pred


def _check_groups(groups, n: int) -> np.ndarray:
    groups = _as_labels(groups, "groups")
    if groups.shape[0] != n:
        raise ValueError(f"groups has length {groups.shape[0]}, expected {n}.")
    return groups


def confusion_matrix(y, pred, num_classes: int) -> np.ndarray:
    """Counts of (true, predicted) pairs.

    Args:
      y: [N] int true labels in ``[0, num_classes)``.
      pred: [N] int predictions in ``[0, num_classes)``.
      num_classes: Number of classes ``C``.

    Returns:
      [C, C] int64 matrix; row = true class, column = predicted class.
    """
    y, pred = _check_pair(y, pred, num_classes)
    flat = np.bincount(y * num_classes + pred, minlength=num_classes**2)
    return flat.reshape(num_classes, num_classes)


def accuracy_from_confusion(cm) -> np.ndarray:
    """Accuracy from confusion matrices [..., C, C]; ``NaN`` where empty."""
    cm = np.asarray(cm, dtype=np.float64)
    total = cm.sum(axis=(-2, -1))
    correct = np.trace(cm, axis1=-2, axis2=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, correct / np.maximum(total, 1), np.nan)


def balanced_accuracy_from_confusion(cm) -> np.ndarray:
    """Mean per-class recall over the classes present (non-empty rows).

    Args:
      cm: [..., C, C] confusion matrices (rows = true class).

    Returns:
      [...] float64 balanced accuracies; ``NaN`` where fewer than two classes
      are present.
    """
    cm = np.asarray(cm, dtype=np.float64)
    support = cm.sum(axis=-1)
    present = support > 0
    recall = np.diagonal(cm, axis1=-2, axis2=-1) / np.maximum(support, 1)
    n_present = present.sum(axis=-1)
    mean = np.sum(np.where(present, recall, 0.0), axis=-1) / np.maximum(n_present, 1)
    return np.where(n_present >= 2, mean, np.nan)


def accuracy(y, pred, weights=None) -> float:
    """(Weighted) fraction of correct predictions.

    Args:
      y: [N] int true labels.
      pred: [N] int predictions.
      weights: Optional [N] non-negative per-example weights.

    Returns:
      ``sum(w * [y == pred]) / sum(w)``.

    Raises:
      ValueError: On empty inputs, or weights that are negative or sum to 0.
    """
    y, pred = _check_pair(y, pred)
    correct = (y == pred).astype(np.float64)
    if weights is None:
        return float(correct.mean())
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != y.shape:
        raise ValueError(f"weights {weights.shape} must match y {y.shape}.")
    if np.any(weights < 0) or weights.sum() <= 0:
        raise ValueError("weights must be non-negative with a positive sum.")
    return float(np.sum(correct * weights) / np.sum(weights))


def balanced_accuracy(y, pred, num_classes: int) -> float:
    """Mean per-class recall over the classes present in ``y``.

    Classes absent from ``y`` are ignored (their recall is undefined); this
    matches ``sklearn.metrics.balanced_accuracy_score`` whenever two or more
    classes are present.

    Args:
      y: [N] int true labels in ``[0, num_classes)``.
      pred: [N] int predictions in ``[0, num_classes)``.
      num_classes: Number of classes ``C``.

    Returns:
      The balanced accuracy, or ``NaN`` if fewer than two classes occur in
      ``y``; callers should report that as undefined.
    """
    return float(
        balanced_accuracy_from_confusion(confusion_matrix(y, pred, num_classes))
    )


def macro_f1(y, pred, num_classes: int) -> float:
    """Unweighted mean of per-class F1 = 2TP / (2TP + FP + FN).

    The mean runs over the classes that occur in ``y`` or in ``pred`` (for the
    others F1 is 0/0); this is sklearn's ``f1_score(average="macro")`` with
    its default labels. A class present in ``y`` but never predicted counts
    with F1 = 0.

    Args:
      y: [N] int true labels in ``[0, num_classes)``.
      pred: [N] int predictions in ``[0, num_classes)``.
      num_classes: Number of classes ``C``.

    Returns:
      The macro-averaged F1.
    """
    cm = confusion_matrix(y, pred, num_classes).astype(np.float64)
    tp = np.diag(cm)
    denom = cm.sum(axis=0) + cm.sum(axis=1)  # = 2TP + FP + FN
    seen = denom > 0
    return float(np.mean(2.0 * tp[seen] / denom[seen]))


def per_group_accuracy(y, pred, groups, *, num_groups: int | None = None) -> dict:
    """Accuracy within each group of a protected attribute.

    Args:
      y: [N] int true labels.
      pred: [N] int predictions.
      groups: [N] int group ids.
      num_groups: If given, report groups ``0..num_groups-1`` (an absent one
        gets ``NaN``) and reject ids outside that range; otherwise report the
        groups that occur.

    Returns:
      ``{group_id: accuracy}`` with int keys in increasing order.
    """
    y, pred = _check_pair(y, pred)
    groups = _check_groups(groups, y.shape[0])
    ids = _group_ids(groups, num_groups)
    correct = y == pred
    out = {}
    for g in ids:
        sel = groups == g
        out[int(g)] = float(correct[sel].mean()) if sel.any() else float("nan")
    return out


def _group_ids(groups: np.ndarray, num_groups: int | None) -> np.ndarray:
    if num_groups is None:
        return np.unique(groups)
    if groups.min() < 0 or groups.max() >= num_groups:
        raise ValueError(f"groups has ids outside [0, {num_groups}).")
    return np.arange(num_groups)


def tpr_gap(y, pred, groups, num_classes: int) -> np.ndarray:
    """Per-class TPR gap: spread over groups of the within-group recall.

    ``gap[c] = max_g TPR[g, c] - min_g TPR[g, c]`` where
    ``TPR[g, c] = P(pred = c | y = c, group = g)``, over the groups that have
    examples of class ``c``. For a binary attribute this is
    ``|TPR[0, c] - TPR[1, c]|``.

    Args:
      y: [N] int true labels in ``[0, num_classes)``.
      pred: [N] int predictions in ``[0, num_classes)``.
      groups: [N] int protected-attribute values.
      num_classes: Number of classes ``C``.

    Returns:
      [C] float64 gaps, ``NaN`` for a class present in fewer than two groups.
    """
    y, pred = _check_pair(y, pred, num_classes)
    groups = _check_groups(groups, y.shape[0])
    gaps = np.full(num_classes, np.nan)
    hit = y == pred
    for c in range(num_classes):
        tprs = [hit[(y == c) & (groups == g)].mean() for g in np.unique(groups[y == c])]
        if len(tprs) >= 2:
            gaps[c] = max(tprs) - min(tprs)
    return gaps


def rms_tpr_gap(y, pred, groups, num_classes: int) -> float:
    """Root-mean-square of :func:`tpr_gap` over classes (De-Arteaga et al.).

    Classes whose gap is undefined (present in fewer than two groups) are left
    out of the mean; if none is defined the result is ``NaN``.

    Args:
      y: [N] int true labels in ``[0, num_classes)``.
      pred: [N] int predictions in ``[0, num_classes)``.
      groups: [N] int protected-attribute values.
      num_classes: Number of classes ``C``.

    Returns:
      ``sqrt(mean_c gap[c]^2)``.
    """
    return _rms(tpr_gap(y, pred, groups, num_classes))


def _rms(gaps: np.ndarray) -> float:
    defined = gaps[~np.isnan(gaps)]
    if defined.size == 0:
        return float("nan")
    return float(np.sqrt(np.mean(defined**2)))


def bias_aligned_conflicting_accuracy(y, pred, aligned) -> dict[str, float]:
    """Accuracy on bias-aligned and bias-conflicting examples.

    An example is bias-aligned when its bias attribute "agrees" with its task
    label (e.g. colored MNIST: color id == digit); what agreement means is
    dataset-specific, so the caller passes it as a mask.

    Args:
      y: [N] int true labels.
      pred: [N] int predictions.
      aligned: [N] bool, True for bias-aligned examples.

    Returns:
      ``{"aligned": acc, "conflicting": acc, "unbiased": mean of the two}``;
      an empty subset gives ``NaN`` (and so does ``"unbiased"``).
    """
    y, pred = _check_pair(y, pred)
    aligned = np.asarray(aligned)
    if aligned.shape != y.shape or aligned.dtype != np.bool_:
        raise ValueError(f"aligned must be a bool array of shape {y.shape}.")
    correct = y == pred
    acc_a = float(correct[aligned].mean()) if aligned.any() else float("nan")
    acc_c = float(correct[~aligned].mean()) if (~aligned).any() else float("nan")
    return {"aligned": acc_a, "conflicting": acc_c, "unbiased": (acc_a + acc_c) / 2}


def task_report(
    y,
    pred,
    *,
    num_classes: int,
    attrs: Mapping[str, object] | None = None,
    attr_num_classes: Mapping[str, int] | None = None,
    aligned=None,
) -> dict[str, float]:
    """All task and fairness metrics as one flat dict.

    Keys (``{a}`` is an attribute name, ``{g}`` a group id, ``{c}`` a class):

    * ``num_examples``, ``accuracy``, ``balanced_accuracy``, ``macro_f1``
    * ``{a}/group_{g}/accuracy``, ``{a}/accuracy_gap`` (max - min over groups)
    * ``{a}/tpr_gap/class_{c}``, ``{a}/rms_tpr_gap``, ``{a}/max_tpr_gap``
    * with ``aligned``: ``bias_aligned/accuracy``, ``bias_conflicting/accuracy``,
      ``bias_unbiased/accuracy``

    ``NaN`` marks undefined values, as documented in the module docstring.

    Args:
      y: [N] int true task labels in ``[0, num_classes)``.
      pred: [N] int predictions in ``[0, num_classes)``.
      num_classes: Number of task classes.
      attrs: ``{name: [N] int groups}`` for each protected attribute.
      attr_num_classes: Optional ``{name: number of values}``; a listed
        attribute reports every group id (absent ones as ``NaN``) and rejects
        out-of-range ids.
      aligned: Optional [N] bool bias-aligned mask, see
        :func:`bias_aligned_conflicting_accuracy`.

    Returns:
      A flat ``{key: float}`` dict.
    """
    y, pred = _check_pair(y, pred, num_classes)
    attr_num_classes = dict(attr_num_classes or {})
    unknown = set(attr_num_classes) - set(attrs or {})
    if unknown:
        raise ValueError(
            f"attr_num_classes names unknown attributes {sorted(unknown)}."
        )
    report = {
        "num_examples": float(y.shape[0]),
        "accuracy": accuracy(y, pred),
        "balanced_accuracy": balanced_accuracy(y, pred, num_classes),
        "macro_f1": macro_f1(y, pred, num_classes),
    }
    for name, groups in (attrs or {}).items():
        group_acc = per_group_accuracy(
            y, pred, groups, num_groups=attr_num_classes.get(name)
        )
        for g, acc in group_acc.items():
            report[f"{name}/group_{g}/accuracy"] = acc
        accs = np.array([a for a in group_acc.values() if not np.isnan(a)])
        report[f"{name}/accuracy_gap"] = (
            float(accs.max() - accs.min()) if accs.size >= 2 else float("nan")
        )
        gaps = tpr_gap(y, pred, groups, num_classes)
        for c, gap in enumerate(gaps):
            report[f"{name}/tpr_gap/class_{c}"] = float(gap)
        report[f"{name}/rms_tpr_gap"] = _rms(gaps)
        report[f"{name}/max_tpr_gap"] = (
            float(np.nanmax(gaps)) if np.any(~np.isnan(gaps)) else float("nan")
        )
    if aligned is not None:
        for k, v in bias_aligned_conflicting_accuracy(y, pred, aligned).items():
            report[f"bias_{k}/accuracy"] = v
    return report
