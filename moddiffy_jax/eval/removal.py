"""How much of an attribute a representation still gives away, and the floor.

* :func:`leakage_floor`: the best balanced accuracy that the gold task label
  alone gives for an attribute (fit on train, measured on the evaluation
  split). A representation that keeps the task perfectly still leaks this
  much when the attribute correlates with the task, so a debiasing result
  is read against it, next to chance.
* :func:`fresh_linear_leakage`: a fresh class-balanced logistic-regression
  probe fit to convergence on frozen representations; used during training
  to watch removal (the in-loop adversaries being fooled says nothing about
  what a new probe reads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from moddiffy_jax.eval import metrics
from moddiffy_jax.eval import probes as probes_lib


def leakage_floor(
    train_task: np.ndarray,
    train_attr: np.ndarray,
    eval_task: np.ndarray,
    eval_attr: np.ndarray,
    *,
    num_task_classes: int,
    num_attr_classes: int,
) -> float:
    """Balanced accuracy of the best attribute predictor that sees only the task label.

    For balanced accuracy the best rule predicts, for task class ``y``, the
    attribute value ``a`` with the largest ``P(y | a)`` (the class-weighted
    majority), estimated on train.

    Args:
      train_task, train_attr: [N] int labels the rule is fit on.
      eval_task, eval_attr: [M] int labels it is measured on.
      num_task_classes: number of task classes.
      num_attr_classes: number of attribute classes.

    Returns:
      The rule's balanced accuracy on the evaluation labels.
    """
    counts = np.zeros((num_task_classes, num_attr_classes))
    np.add.at(counts, (np.asarray(train_task), np.asarray(train_attr)), 1.0)
    p_y_given_a = counts / np.maximum(counts.sum(0, keepdims=True), 1.0)
    rule = np.argmax(p_y_given_a, axis=1)
    pred = rule[np.asarray(eval_task)]
    return float(
        metrics.balanced_accuracy(np.asarray(eval_attr), pred, num_attr_classes)
    )


def fresh_linear_leakage(
    reps: Mapping[str, np.ndarray],
    labels: Mapping[str, np.ndarray],
    *,
    num_classes: int,
    split: str = "dev",
    max_train: int = 0,
) -> float:
    """Balanced accuracy on ``split`` of a fresh class-balanced linear probe.

    Args:
      reps: ``{"train": [N, H], split: [M, H]}`` frozen representations.
      labels: the attribute labels of the same rows.
      num_classes: attribute classes.
      split: the held-out split to measure on.
      max_train: if > 0, fit on the first ``max_train`` train rows only.
    """
    n = len(labels["train"]) if max_train <= 0 else max_train
    result = probes_lib.linear_probe(
        reps["train"][:n],
        labels["train"][:n],
        reps[split],
        labels[split],
        reps[split],
        labels[split],
        num_classes=num_classes,
        tol=1e-4,
        class_weighted=True,
    )
    return float(result.dev_balanced_accuracy)


def leakage_floors(ctx: Any, split: str = "test") -> dict[str, dict[str, float]]:
    """Per attribute: the floor (what the gold task label alone gives) and chance."""
    train, held = ctx.data.splits["train"], ctx.data.splits[split]
    out = {}
    for a in ctx.attributes:
        n = len(ctx.data.attr_classes[a])
        floor = leakage_floor(
            train.task,
            train.attrs[a],
            held.task,
            held.attrs[a],
            num_task_classes=len(ctx.data.task_classes),
            num_attr_classes=n,
        )
        out[a] = {"floor": floor, "chance": 1.0 / n}
    return out
