"""Tests for moddiffy_jax.eval.metrics against hand-computed examples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moddiffy_jax.eval import metrics

# Three classes. Class 0: TP 2, FN 1, FP 2; class 1: TP 1, FN 1, FP 1;
# class 2: TP 0, FN 1, FP 0.
Y = np.array([0, 0, 0, 1, 1, 2])
PRED = np.array([0, 0, 1, 1, 0, 0])


def test_accuracy_and_weights():
    assert metrics.accuracy(Y, PRED) == pytest.approx(3 / 6)
    w = np.array([1, 1, 0, 0, 0, 2])
    assert metrics.accuracy(Y, PRED, w) == pytest.approx(2 / 4)
    with pytest.raises(ValueError):
        metrics.accuracy(Y, PRED, np.zeros(6))


def test_confusion_matrix():
    cm = metrics.confusion_matrix(Y, PRED, 3)
    np.testing.assert_array_equal(cm, [[2, 1, 0], [1, 1, 0], [1, 0, 0]])


def test_balanced_accuracy_hand_example():
    # Recalls 2/3, 1/2, 0.
    assert metrics.balanced_accuracy(Y, PRED, 3) == pytest.approx(7 / 18)


def test_balanced_accuracy_ignores_absent_classes():
    y = np.array([0, 0, 2, 2])
    pred = np.array([0, 1, 2, 2])
    # Class 1 is absent from y: mean of recalls 1/2 and 1.
    assert metrics.balanced_accuracy(y, pred, 3) == pytest.approx(0.75)


def test_balanced_accuracy_single_class_is_nan():
    assert math.isnan(metrics.balanced_accuracy([1, 1, 1], [1, 0, 1], 2))


def test_balanced_accuracy_from_confusion_is_vectorised():
    rng = np.random.default_rng(0)
    cms, expected = [], []
    for _ in range(6):
        y, p = rng.integers(0, 4, 50), rng.integers(0, 4, 50)
        cms.append(metrics.confusion_matrix(y, p, 4))
        expected.append(metrics.balanced_accuracy(y, p, 4))
    got = metrics.balanced_accuracy_from_confusion(np.stack(cms).reshape(2, 3, 4, 4))
    np.testing.assert_allclose(got.reshape(-1), expected)


def test_macro_f1_hand_example():
    # F1: 4/7, 1/2, 0 -> mean 5/14.
    assert metrics.macro_f1(Y, PRED, 3) == pytest.approx(5 / 14)
    # A class in neither y nor pred is left out of the mean.
    assert metrics.macro_f1(Y, PRED, 5) == pytest.approx(5 / 14)
    assert metrics.macro_f1([0, 1], [0, 1], 2) == pytest.approx(1.0)


def test_per_group_accuracy():
    groups = np.array([0, 0, 1, 1, 1, 3])
    got = metrics.per_group_accuracy(Y, PRED, groups)
    assert got == {0: 1.0, 1: pytest.approx(1 / 3), 3: 0.0}
    got = metrics.per_group_accuracy(Y, PRED, groups, num_groups=4)
    assert list(got) == [0, 1, 2, 3] and math.isnan(got[2])
    with pytest.raises(ValueError):
        metrics.per_group_accuracy(Y, PRED, groups, num_groups=3)


# Binary task, binary attribute. Group 0: class-0 recall 1, class-1 recall 1/2.
# Group 1: class-0 recall 0, class-1 recall 1.
TY = np.array([0, 0, 1, 1, 0, 0, 1, 1])
TG = np.array([0, 0, 0, 0, 1, 1, 1, 1])
TP = np.array([0, 0, 1, 0, 1, 1, 1, 1])


def test_tpr_gap_hand_example():
    np.testing.assert_allclose(metrics.tpr_gap(TY, TP, TG, 2), [1.0, 0.5])
    assert metrics.rms_tpr_gap(TY, TP, TG, 2) == pytest.approx(math.sqrt(0.625))


def test_tpr_gap_multi_group_is_spread():
    y = np.array([0, 0, 0, 0, 0, 0])
    g = np.array([0, 0, 1, 1, 2, 2])
    p = np.array([0, 0, 0, 1, 1, 1])  # recalls 1, 1/2, 0
    np.testing.assert_allclose(metrics.tpr_gap(y, p, g, 2), [1.0, np.nan])


def test_tpr_gap_undefined_classes():
    # Class 1 only occurs in group 0: its gap is NaN and RMS skips it.
    y = np.array([0, 0, 1, 0])
    g = np.array([0, 1, 0, 1])
    p = np.array([0, 1, 1, 0])
    gaps = metrics.tpr_gap(y, p, g, 2)
    assert gaps[0] == pytest.approx(0.5) and math.isnan(gaps[1])
    assert metrics.rms_tpr_gap(y, p, g, 2) == pytest.approx(0.5)
    assert math.isnan(metrics.rms_tpr_gap(y, p, np.zeros(4, int), 2))


def test_bias_aligned_conflicting():
    aligned = np.array([True, True, True, False, False, False])
    got = metrics.bias_aligned_conflicting_accuracy(Y, PRED, aligned)
    assert got["aligned"] == pytest.approx(2 / 3)
    assert got["conflicting"] == pytest.approx(1 / 3)
    assert got["unbiased"] == pytest.approx(0.5)
    got = metrics.bias_aligned_conflicting_accuracy(Y, PRED, np.ones(6, bool))
    assert math.isnan(got["conflicting"]) and math.isnan(got["unbiased"])
    with pytest.raises(ValueError):
        metrics.bias_aligned_conflicting_accuracy(Y, PRED, np.ones(6, int))


def test_task_report():
    aligned = TY == TG
    report = metrics.task_report(
        TY,
        TP,
        num_classes=2,
        attrs={"gender": TG},
        attr_num_classes={"gender": 3},
        aligned=aligned,
    )
    assert report["num_examples"] == 8.0
    assert report["accuracy"] == pytest.approx(5 / 8)
    assert report["balanced_accuracy"] == pytest.approx((2 / 4 + 3 / 4) / 2)
    assert report["macro_f1"] == pytest.approx(metrics.macro_f1(TY, TP, 2))
    assert report["gender/group_0/accuracy"] == pytest.approx(3 / 4)
    assert report["gender/group_1/accuracy"] == pytest.approx(2 / 4)
    assert math.isnan(report["gender/group_2/accuracy"])
    assert report["gender/accuracy_gap"] == pytest.approx(1 / 4)
    assert report["gender/tpr_gap/class_0"] == pytest.approx(1.0)
    assert report["gender/rms_tpr_gap"] == pytest.approx(math.sqrt(0.625))
    assert report["gender/max_tpr_gap"] == pytest.approx(1.0)
    assert report["bias_aligned/accuracy"] == pytest.approx(1.0)
    assert report["bias_conflicting/accuracy"] == pytest.approx(1 / 4)
    assert all(isinstance(v, float) for v in report.values())
    with pytest.raises(ValueError):
        metrics.task_report(TY, TP, num_classes=2, attr_num_classes={"age": 2})


@pytest.mark.parametrize(
    "fn",
    [
        lambda y, p: metrics.accuracy(y, p),
        lambda y, p: metrics.balanced_accuracy(y, p, 2),
        lambda y, p: metrics.macro_f1(y, p, 2),
        lambda y, p: metrics.tpr_gap(y, p, y, 2),
        lambda y, p: metrics.task_report(y, p, num_classes=2),
    ],
)
def test_invalid_inputs_raise(fn):
    with pytest.raises(ValueError):
        fn(np.array([], int), np.array([], int))
    with pytest.raises(ValueError):
        fn(np.array([0, 1]), np.array([0, 1, 1]))


def test_out_of_range_labels_raise():
    with pytest.raises(ValueError, match="outside"):
        metrics.balanced_accuracy([0, 2], [0, 1], 2)
    with pytest.raises(ValueError, match="outside"):
        metrics.macro_f1([0, 1], [0, -1], 2)
    with pytest.raises(ValueError, match="integer"):
        metrics.accuracy([0.5, 1.0], [0, 1])
