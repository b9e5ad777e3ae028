"""Diff strength: the weight a trained diff is added with, chosen on held-out data.

A gradient-trained debiasing diff moves the representation part of the way
toward one that no longer tells the attribute apart, and a probe of
standardized features reads a difference shrunk part of the way as well as
the whole one (docs/efficacy.md, "Stop 28"). Adding the same diff with a
weight above 1 carries its change further along the same direction: on
README command 1's seed-0 run the gender diff at weight 1 closed 0.38 / 0.49
of its gap (scikit-learn linear / MLP) for 1.4 points of task accuracy, and
at weight 1.5 it took gender past its floor for 2.0 points ("Stop 31"). This
is the scaling coefficient of task arithmetic (Ilharco et al. 2023, "Editing
models with task arithmetic"), chosen here per diff on held-out data and
against a task budget.

:func:`choose_scale` reads the diff at weight 1 and then, while the task
cost stays within the budget, at larger weights, stopping at the first whose
dev leakage reaches the attribute's floor; when weight 1 already costs more
than the budget it reads smaller weights until one fits (0: none does).
:func:`calibrate` does this for one diff on a run's core; the composition
matrix (``evaluate_run(strength=...)``, config ``eval.strength``) adds each
diff with its calibrated weight, and the weight is the one number a user
passes to :func:`~moddiffy_jax.subnets.diffs.apply_diffs` to reproduce it.

Nothing here looks at the test split: the costs are read on the dev split
(paired, with their standard error counted against the budget as in
:mod:`~moddiffy_jax.methods.token_merge`), the leakage by a fresh linear
probe fit on training representations and read on dev.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from moddiffy_jax.methods.token_merge import paired_drop

# Weights read above 1 (ascending) and below it (descending).
UP = (1.25, 1.5, 2.0, 2.5, 3.0)
DOWN = (0.75, 0.5, 0.25)


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a diff added with one weight does on the held-out examples."""

    cost: float  # task accuracy points lost against the core
    se: float  # standard error of that paired difference, points
    leakage: float | None = None  # dev leakage (None: not probed)


@dataclasses.dataclass(frozen=True)
class StrengthChoice:
    """What :func:`calibrate` chose for one diff.

    Attributes:
      attribute: the diff's attribute.
      scale: the chosen weight (0: no weight read fits the budget).
      floor: the attribute's leakage floor on the dev split.
      tolerance: the stop's margin above the floor (``floor_z`` standard
        errors of the dev probe there).
      read: one record per weight read, in reading order:
        ``{"scale", "cost", "se", "bound", "leakage"}`` (``bound``: the cost
        plus ``cost_z`` standard errors).
    """

    attribute: str
    scale: float
    floor: float
    tolerance: float
    read: list[dict]

    def summary(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def choose_scale(
    read: Callable[[float], Reading],
    max_drop: float,
    *,
    floor: float | None = None,
    tolerance: float = 0.0,
    cost_z: float = 0.0,
    up: Sequence[float] = UP,
    down: Sequence[float] = DOWN,
) -> tuple[float, list[dict]]:
    """The weight to add a diff with, within a task budget.

    ``read(scale)`` gives the task cost (points, with its standard error)
    and, when ``floor`` is given, the attribute's dev leakage of
    ``core + scale * diff``. A weight is within budget when its cost plus
    ``cost_z`` standard errors is at most ``max_drop``.

    Weight 1 is read first. If it is within budget, larger weights (``up``,
    ascending) are read until one is over budget or a leakage at or below
    ``floor + tolerance`` is reached, and the largest within budget is
    chosen; weight 1 itself stops the scan if its leakage is already there.
    If weight 1 is over budget, smaller weights (``down``, descending) are
    read and the first within budget is chosen (0 when none is). The scan
    stops at the first weight over budget, so a larger weight whose cost
    happens to be read low is never reached (the reason
    :func:`~moddiffy_jax.methods.token_merge.choose_count`, which reads every
    size first, fits its costs non-decreasing).

    Returns the chosen weight and one record per weight read.
    """
    if not max_drop >= 0:
        raise ValueError(f"max_drop must be >= 0 task points; got {max_drop}.")
    if not cost_z >= 0:
        raise ValueError(f"cost_z must be >= 0 standard errors; got {cost_z}.")
    up, down = [float(s) for s in up], [float(s) for s in down]
    if any(b <= a for a, b in zip([1.0, *up], up, strict=False)):
        raise ValueError(f"up must be ascending and above 1; got {up}.")
    if any(b >= a for a, b in zip([1.0, *down], down, strict=False)) or (
        down and down[-1] <= 0
    ):
        raise ValueError(f"down must be descending within (0, 1); got {down}.")
    records: list[dict] = []

    def take(scale: float) -> dict:
        r = read(scale)
        rec = {"scale": scale, "cost": float(r.cost), "se": float(r.se)}
        rec["bound"] = rec["cost"] + cost_z * rec["se"]
        if r.leakage is not None:
            rec["leakage"] = float(r.leakage)
        records.append(rec)
        return rec

    def at_floor(rec: dict) -> bool:
        return floor is not None and rec.get("leakage", np.inf) <= floor + tolerance

    first = take(1.0)
    if first["bound"] <= max_drop + 1e-9:
        chosen = 1.0
        if not at_floor(first):
            for scale in up:
                rec = take(scale)
                if rec["bound"] > max_drop + 1e-9:
                    break
                chosen = scale
                if at_floor(rec):
                    break
        return chosen, records
    for scale in down:
        rec = take(scale)
        if rec["bound"] <= max_drop + 1e-9:
            return scale, records
    return 0.0, records


def calibrate(
    core: Any,
    diff: Any,
    attribute: str,
    num_classes: int,
    train_split: Any,
    dev_split: Any,
    compose: Callable[[Any, Any, float], Any],
    represent: Callable[[Any, Any], np.ndarray],
    predict: Callable[[np.ndarray], np.ndarray],
    *,
    max_drop: float = 1.5,
    select_train: int = 2000,
    cost_z: float = 1.0,
    floor_z: float = 1.0,
    floor_stop: bool = True,
    cost_on_train: bool = False,
    up: Sequence[float] = UP,
    down: Sequence[float] = DOWN,
    leakage_probe: Callable[..., float] | None = None,
) -> StrengthChoice:
    """The weight one trained diff is added to ``core`` with (:func:`choose_scale`).

    Args:
      core: the encoder params.
      diff: the attribute's diff (anything ``compose`` takes).
      attribute, num_classes: the attribute the diff removes.
      train_split, dev_split: tokenized splits (``task``, ``attrs``).
      compose: ``compose(core, diff, scale)`` -> encoder params.
      represent: ``represent(params, split)`` -> [N, H] representations.
      predict: the task head's predicted class for [N, H] representations.
      max_drop: the task budget, accuracy points lost on the dev split.
      select_train: the training examples the leakage probe is fit on.
      cost_on_train: read the cost on those training examples and dev,
        pooled (as :mod:`~moddiffy_jax.methods.token_merge` does). Off by
        default: a diff trained on that split, beside a core fit to it,
        costs there what it does not cost on held-out data (README command
        1, seed 0: the gender diff read 3.6 points on train + dev, 0.9 on
        dev and 1.4 on test).
      cost_z: standard errors of that read counted against the budget.
      floor_z: the stop's tolerance above the dev floor, in standard errors
        of a balanced accuracy there.
      floor_stop: stop going up once the dev leakage reaches the floor.
      up, down: the weights read (see :func:`choose_scale`).
      leakage_probe: ``probe(h_train, y_train, h_dev, y_dev, num_classes)``
        (default: a fresh class-balanced logistic regression on the
        standardized representations).
    """
    from moddiffy_jax.data import subset_split
    from moddiffy_jax.methods.token_merge import _default_leakage, dev_floor

    if select_train < 1:
        raise ValueError(f"select_train must be >= 1; got {select_train}.")
    if not floor_z >= 0:
        raise ValueError(f"floor_z must be >= 0 standard errors; got {floor_z}.")
    probe = leakage_probe or _default_leakage
    n = min(select_train, len(train_split.task))
    select = subset_split(train_split, np.arange(n))
    task = np.asarray(dev_split.task)
    if cost_on_train:
        task = np.concatenate([np.asarray(select.task), task])
    y_tr = np.asarray(select.attrs[attribute])
    y_dev = np.asarray(dev_split.attrs[attribute])
    floor, tolerance = dev_floor(select, dev_split, attribute, num_classes, floor_z)

    def right(params, probed: bool) -> tuple[np.ndarray, Any, np.ndarray]:
        """Which cost examples the head gets right, and the representations
        (training ones only where the cost or the leakage probe reads them)."""
        h_dev = represent(params, dev_split)
        h_tr = represent(params, select) if cost_on_train or probed else None
        pred = predict(h_dev)
        if cost_on_train:
            pred = np.concatenate([predict(h_tr), pred])
        return pred == task, h_tr, h_dev

    core_right = right(core, probed=False)[0]

    def read(scale: float) -> Reading:
        ok, h_tr, h_dev = right(compose(core, diff, scale), probed=floor_stop)
        cost, se = paired_drop(core_right, ok)
        leak = probe(h_tr, y_tr, h_dev, y_dev, int(num_classes)) if floor_stop else None
        return Reading(cost, se, leak)

    scale, records = choose_scale(
        read,
        max_drop,
        floor=floor if floor_stop else None,
        tolerance=tolerance,
        cost_z=cost_z,
        up=up,
        down=down,
    )
    return StrengthChoice(attribute, scale, floor, tolerance, records)
