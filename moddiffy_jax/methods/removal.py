"""How a diff (or a jointly trained encoder) removes an attribute.

* :class:`DebiasSettings`: the removal recipe, read from ``config.method`` by
  :func:`settings_from_config` (which names every bad value);
* :func:`debias_term`: the named removal terms for one attribute on a batch
  of representations (adversaries with gradient reversal or confusion, or a
  task-conditional, optionally whitened MMD);
* the task guard (:func:`guard_update`, :func:`guarded`): dual ascent on
  "the diff keeps the task", which backs the removal weight off while a
  diff's running accuracy trails the core's.

Pure functions of arrays and settings; the losses in ``methods.common`` call
them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from moddiffy_jax import objectives
from moddiffy_jax.methods.attribute_weights import (
    for_attribute,
    parse_attribute_weights,
)
from moddiffy_jax.methods.removal_config import (  # noqa: F401 (re-exported)
    LATER_FIELDS,
    config_fields,
)
from moddiffy_jax.methods.terms import INFO_KEY, STATE_KEY
from moddiffy_jax.objectives import mmd as objectives_mmd

#: "swap": the counterfactual token swaps alone (``swap_weight``; no
#: adversaries, no MMD statistics).
DEBIAS_OBJECTIVES = ("adversarial", "mmd", "swap")
ADV_LOSSES = ("grl", "confusion")
MMD_CONDITIONS = ("stratify", "reweight", "residual", "auto", "none")
#: What the removal terms condition on (DebiasSettings.condition_on).
CONDITION_ON = ("label", "prediction", "core_prediction")
#: Groups whose pooled scatter the whitened MMD reads (DebiasSettings).
WHITEN_WITHIN = ("attribute", "cell")
TASK_TARGETS = ("gold", "core_decision")  # what the debias steps' task term fits
#: Whose prediction a debias step keeps (DebiasSettings.keep_from).
KEEP_FROM = ("core", "added_to")
#: ``mmd_conditional="auto"`` stratifies an attribute when the smallest
#: (task class, attribute value) cell of the training data is expected to
#: hold at least this many members per batch, and reweights it otherwise.
AUTO_MIN_MEMBERS = 3.0


@dataclasses.dataclass(frozen=True)
class DebiasSettings:
    objective: str  # "adversarial" or "mmd"
    adv_lambda: float
    mmd_weight: float
    attr_classes: Mapping[str, int]
    # MMD: kernel ("gaussian", "linear", "both") and whether the attribute
    # groups are compared within each task class (then ``num_task_classes``).
    mmd_kernel: str = "gaussian"
    mmd_conditional: str = "stratify"  # or "reweight", "none"
    num_task_classes: int = 0
    # Adversarial: "grl" (gradient reversal, the paper) or "confusion" (the
    # encoder matches the adversaries' prediction to ``attr_prior[a][task]``,
    # the attribute distribution given the task label, [T][C] nested tuples).
    adv_loss: str = "grl"
    attr_prior: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Joint distribution of (task, attribute) on train, [T][C] nested tuples.
    attr_joint: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # MMD in the metric of a running within-group covariance (kept in
    # ``trainable["mmd_stats"][attribute]``; objectives/mmd.py).
    mmd_whiten: bool = False
    # Per-attribute conditioning that overrides ``mmd_conditional`` (what
    # "auto" resolved to, see :func:`auto_conditioning`).
    mmd_conditional_by_attr: Mapping[str, str] = dataclasses.field(default_factory=dict)
    mmd_whiten_decay: float = 0.98
    mmd_whiten_shrinkage: float = 0.1
    # The groups whose pooled scatter is whitened: "attribute" (the metric a
    # fresh probe of the attribute reads: the task's spread counts as
    # within-group variance) or "cell" ((task, attribute) pairs).
    mmd_whiten_within: str = "attribute"
    # Weight of a task-keeping term in the modular debias steps: the KL
    # divergence from the core's own (undebiased, stop-gradient) task
    # prediction to the prediction with the diff. 0 = off.
    task_distill: float = 0.0
    # The debias steps' task labels: "gold", or the core's own decision (its
    # argmax, no gradient): a target that is a function of the input.
    task_target: str = "gold"
    # Whose task prediction the core-reading terms of a debias step keep
    # (task_distill, task_target "core_decision", swap_distill, the pivotal
    # pairs, decision conditioning): "core" (the core alone), or "added_to"
    # (the model the diff is added to in the step: the core with the other
    # diffs a composing step added, diff.compose_prob; the core alone when
    # it added none).
    keep_from: str = "core"
    # Task guard (dual ascent on a task constraint): each diff's removal
    # weight is scaled by exp(-backoff); the backoff rises while the diff's
    # running task accuracy on the training batches trails the core's by
    # more than ``task_guard_slack`` and falls (to 0) while it does not.
    task_guard: bool = False
    task_guard_slack: float = 0.01
    task_guard_rate: float = 1.0
    task_guard_decay: float = 0.9
    task_guard_max: float = 4.6  # the removal weight never falls below 1 %.
    # The step size's factor while the gap is within the slack (the weight
    # coming back): 1 = the same dual step both ways.
    task_guard_release: float = 1.0
    # The backoff stays at 0 before this step (the running gap is tracked from
    # step 0): a dense diff early in the L0 phase trails the core whatever the
    # removal weight, until pruning brings it to its budget.
    task_guard_start: int = 0
    # Running linear erasure (objectives/erasure.py): weight (0 = off) and the
    # decay of the running group-mean differences. Needs the whitened MMD's
    # running covariance (objective "mmd", mmd_whiten).
    fisher_weight: float = 0.0
    fisher_decay: float = 0.95
    # The removal terms' weight ramps linearly from 0 at step 0 to full at
    # this step (0 = full from the start); the running statistics are
    # updated from the first step on.
    removal_warmup_steps: int = 0
    # Erased targets (objectives/erasure.py): weight (0 = off) of the
    # whitened distance from the diff's representation to the core's with
    # the attribute's (task class, value) cell offsets taken out, and the
    # decay of the running cell means. Needs the whitened MMD's running
    # covariance (objective "mmd", mmd_whiten) and the task labels.
    target_weight: float = 0.0
    target_decay: float = 0.9
    # "project" (each row's within-class deviation along the cells' offset
    # directions taken out) or "shift" (each row moved by its cell's offset).
    target_mode: str = "project"
    # The MMD compares the attribute's groups over the current batch and the
    # detached representations of this many previous batches (0 = the batch
    # alone): larger groups at the cost of one batch (:func:`remembered`).
    removal_memory: int = 0
    # Modular debias steps: the removal terms' gradient on each example's
    # representation loses its component against that example's task
    # gradient (``objectives.task_projected``), so to first order a removal step
    # does not raise the task loss through the representation.
    task_projection: bool = False
    # Per-attribute weights of the removal terms ({attribute: {field:
    # weight}}, the fields of ``attribute_weights.ATTRIBUTE_WEIGHTS``),
    # overriding the ones above for that attribute only (methods/
    # attribute_weights.py, ``for_attribute``).
    attribute_weights: Mapping[str, Mapping[str, float]] = dataclasses.field(
        default_factory=dict
    )
    # The task classes the removal terms condition on (config_fields).
    condition_on: str = "label"
    # Counterfactual token swaps (objectives/counterfactual.py): weight (0 =
    # off) of the distance between a diff's representation of each example
    # and of its twin with the attribute's counterpart tokens swapped; the
    # swap tables come from the training split (context.swap_tables).
    swap_weight: float = 0.0
    swap_candidates: int = 64
    swap_share: float = 0.1
    # False: the twin is a fixed target (no gradient through its pass, so
    # the swap costs one forward pass per debias step instead of a forward
    # and a backward).
    swap_twin_gradient: bool = True
    # > 0: swap only the fewest counterpart groups whose bag-of-tokens read
    # closes this share of the gap to the floor within swap_max_drop task
    # points (methods/swap_budget.py); 0: every group.
    swap_target: float = 0.0
    swap_max_drop: float = 2.5
    swap_order: str = "rank"  # or "efficiency" (swap_budget.efficient_order)
    swap_one_sided: bool = False  # methods/one_sided.py (with swap_target > 0)
    # True: the swap distance leaves out the directions that move the task
    # head's decision (objectives/counterfactual.swap_invariance_loss).
    swap_keep_task: bool = False
    # True: as swap_keep_task, but only on the pairs whose swap changes the
    # core's decision; every other pair keeps the whole distance.
    swap_keep_pivotal: bool = False
    # > 0: the KL from the core's prediction, weighted so, on the rows the
    # swap leaves unchanged (what the diff has no reason to move).
    swap_distill: float = 0.0
    # > 0 (with swap_keep_pivotal): the KL from the teacher on both twins,
    # weighted so, over the pairs whose swap moves the teacher's decision.
    swap_distill_pivotal: float = 0.0
    # swap_reread_mode "decision": the KL weight of an attribute switched to
    # keeping the core's decision (methods/swap_reread.py).
    swap_keep_distill: float = 3.0
    # True: a composing step's twin also swaps the added diffs' attributes.
    swap_compose: bool = False


def debias_term(
    model: Any,
    trainable: Mapping[str, Any],
    h: jax.Array,
    labels: jax.Array,
    attribute: str,
    *,
    settings: DebiasSettings,
    rng: jax.Array,
    train: bool,
    task: jax.Array | None = None,
    anchor: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The named removal terms for one attribute on representations ``h``.

    ``task`` [B] (the gold task labels) is used by the task-conditional MMD.
    ``anchor`` [B, H]: the same inputs' representations without the diff
    (under the same dropout), which the erased-target term needs.
    """
    settings = for_attribute(settings, attribute)
    if settings.objective == "swap":
        return {}  # the swap term is the debias step's (methods/common.py).
    if settings.objective == "adversarial":
        params = trainable["adversaries"][attribute]
        if settings.adv_loss == "grl":
            reversed_h = objectives.gradient_reversal(h, settings.adv_lambda)
            logits = model.adversary_logits(attribute, params, reversed_h, rng, train)
            return {f"adv/{attribute}": objectives.adversarial_loss(logits, labels)}
        # Confusion: the adversaries fit the attribute on detached
        # representations; the encoder (or diff) moves the frozen adversaries'
        # prediction towards what the task label alone implies.
        r_fit, r_enc = jax.random.split(rng)
        fit = model.adversary_logits(
            attribute, params, jax.lax.stop_gradient(h), r_fit, train
        )
        enc = model.adversary_logits(
            attribute, jax.lax.stop_gradient(params), h, r_enc, train
        )
        if task is None or attribute not in settings.attr_prior:
            n = settings.attr_classes[attribute]
            target = jnp.full((h.shape[0], n), 1.0 / n, jnp.float32)
        else:
            target = jnp.asarray(settings.attr_prior[attribute], jnp.float32)[task]
        return {
            f"adv/{attribute}": objectives.adversarial_loss(fit, labels),
            f"confusion/{attribute}": settings.adv_lambda
            * objectives.confusion_loss(enc, target),
        }
    mode = settings.mmd_conditional_by_attr.get(attribute, settings.mmd_conditional)
    mode = mode if task is not None else "none"
    joint = (
        settings.attr_joint.get(attribute) if mode in ("reweight", "residual") else None
    )
    out = {}
    seen = matrix = None
    raw = h
    if settings.mmd_whiten:
        by_cell = mode != "none" and settings.mmd_whiten_within == "cell"
        stats = objectives.update_covariance(
            trainable[MMD_STATS][attribute],
            h,
            labels,
            num_classes=settings.attr_classes[attribute],
            task=task if by_cell else None,
            num_task_classes=settings.num_task_classes,
            decay=settings.mmd_whiten_decay,
        )
        matrix, seen = objectives.whitening_map(
            stats, shrinkage=settings.mmd_whiten_shrinkage
        )
        h = h.astype(jnp.float32) @ matrix
        out[STATE_KEY] = {(MMD_STATS, attribute): stats}
    if settings.fisher_weight > 0.0:
        pairs = objectives.pair_weights(
            labels,
            _fisher_strata(settings, attribute, mode, labels, task),
            settings.attr_classes[attribute],
        )
        value, new = objectives.fisher_loss(
            raw,
            pairs,
            trainable[FISHER_STATS][attribute],
            white=matrix,
            decay=settings.fisher_decay,
        )
        out[f"fisher/{attribute}"] = settings.fisher_weight * value
        out[STATE_KEY][(FISHER_STATS, attribute)] = new
    if settings.target_weight > 0.0:
        if anchor is None or task is None:
            raise ValueError(
                "the erased-target term (config.method.target_weight > 0) needs "
                "the task labels and the representations without the diff; "
                "only the modular debias step of a diff method passes them."
            )
        cells = objectives.update_cell_means(
            trainable[TARGET_STATS][attribute],
            anchor,
            task,
            labels,
            decay=settings.target_decay,
        )
        value = objectives.erased_target_loss(
            raw, anchor, task, labels, cells, white=matrix, mode=settings.target_mode
        )
        out[f"target/{attribute}"] = settings.target_weight * value
        out[STATE_KEY][(TARGET_STATS, attribute)] = cells
    if settings.mmd_weight == 0.0:
        return out
    weights, factor = None, 1.0
    if settings.removal_memory > 0:
        rows, new_memory, factor = remembered(
            trainable[REMOVAL_MEMORY][attribute], raw, labels, task
        )
        h = rows["h"] if matrix is None else rows["h"] @ matrix
        labels, weights = rows["attr"], rows["valid"]
        task = None if task is None else rows["task"]
        out.setdefault(STATE_KEY, {})[(REMOVAL_MEMORY, attribute)] = new_memory
    value = objectives.mmd_loss(
        h,
        labels,
        num_classes=settings.attr_classes[attribute],
        task=None if mode == "none" else task,
        num_task_classes=settings.num_task_classes,
        joint=None if joint is None else jnp.asarray(joint, jnp.float32),
        weights=weights,
        kernel=settings.mmd_kernel,
        center_task=mode == "residual",
        whitened=settings.mmd_whiten,
        seen=seen,
    )
    out[f"mmd/{attribute}"] = settings.mmd_weight * factor * value
    return out


#: Where the MMD keeps each attribute's memory of previous batches (their
#: detached representations and labels; updated through :data:`STATE_KEY`).
REMOVAL_MEMORY = "removal_memory"


def init_memory(
    settings: DebiasSettings,
    feature_dim: int,
    attributes: Sequence[str],
    batch_size: int,
) -> dict[str, Any]:
    """An empty memory of ``settings.removal_memory`` batches per attribute.
    Labels are kept as floats (every leaf of the trainable tree is a float
    array); ``valid`` marks the rows that hold an example."""
    rows = settings.removal_memory * batch_size
    return {
        a: {
            "h": jnp.zeros((rows, feature_dim), jnp.float32),
            "attr": jnp.zeros((rows,), jnp.float32),
            "task": jnp.zeros((rows,), jnp.float32),
            "valid": jnp.zeros((rows,), jnp.float32),
        }
        for a in attributes
    }


def remembered(
    memory: Mapping[str, jax.Array],
    h: jax.Array,
    labels: jax.Array,
    task: jax.Array | None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array], jax.Array]:
    """The rows the MMD compares with a memory, the memory after the step and
    the factor on the term.

    Returns ``(rows, new_memory, factor)``: ``rows`` holds the batch's
    representations ``h`` (differentiated) followed by the memory's
    (detached), with the attribute labels ``attr``, the task labels ``task``
    (int) and ``valid`` weights (1 for the batch; the memory's own flags, 0
    for rows not yet filled); ``new_memory`` is the memory with the batch
    pushed in front and the oldest rows dropped. The memory's rows carry no
    gradient, so with them the batch's own rows would pull a larger group's
    share (``1 / n``) each: ``factor`` = (batch + filled memory rows) / batch
    restores the pull of a batch as large as both.
    """
    b = h.shape[0]
    task = jnp.zeros((b,), jnp.int32) if task is None else task
    mem = jax.lax.stop_gradient(dict(memory))

    def ints(new, old):
        return jnp.concatenate([new.astype(jnp.int32), old.astype(jnp.int32)])

    rows = {
        "h": jnp.concatenate([h.astype(jnp.float32), mem["h"]]),
        "attr": ints(labels, mem["attr"]),
        "task": ints(task, mem["task"]),
        "valid": jnp.concatenate([jnp.ones((b,), jnp.float32), mem["valid"]]),
    }
    size = mem["h"].shape[0]
    new_memory = {
        k: jax.lax.stop_gradient(v[:size]).astype(jnp.float32) for k, v in rows.items()
    }
    factor = (b + jnp.sum(mem["valid"])) / b
    return rows, new_memory, factor


def attribute_settings(
    settings: DebiasSettings, attribute: str, name: str
) -> DebiasSettings | None:
    """``settings`` as the removal terms of ``attribute`` read them, with the
    attribute called ``name``: the per-attribute entries of that attribute
    only, and only those its terms read. Two attributes whose results are
    equal run the same arithmetic, so one loss (and one compiled program)
    serves both (methods/steps.py, ``SubStep.attribute``). None where the
    terms need more than the settings (the adversaries are modules of the
    model, one per attribute)."""
    if settings.objective != "mmd":
        return None
    mode = settings.mmd_conditional_by_attr.get(attribute, settings.mmd_conditional)
    reads_joint = mode in ("reweight", "residual")
    return dataclasses.replace(
        for_attribute(settings, attribute),
        attr_classes={name: settings.attr_classes[attribute]},
        attr_prior={},
        attr_joint={name: settings.attr_joint[attribute]} if reads_joint else {},
        mmd_conditional_by_attr={name: mode},
    )


def _fisher_strata(settings, attribute, mode, labels, task):
    """The [B] member weights of each stratum the running erasure compares
    the attribute's groups in (see :func:`fisher_pairs`)."""
    if mode == "stratify":
        return [
            (task == t).astype(jnp.float32) for t in range(settings.num_task_classes)
        ]
    if mode in ("reweight", "residual"):
        return [
            objectives_mmd.importance_weights(
                settings.attr_joint[attribute], task, labels
            )
        ]
    return [jnp.ones(labels.shape[0], jnp.float32)]


def fisher_pairs(settings: DebiasSettings, attribute: str) -> int:
    """How many group pairs the running erasure tracks for ``attribute``: a
    stratum per task class under ``stratify`` (one otherwise), times one
    split for a binary attribute or one per value (one-vs-rest)."""
    mode = settings.mmd_conditional_by_attr.get(attribute, settings.mmd_conditional)
    strata = settings.num_task_classes if mode == "stratify" else 1
    classes = settings.attr_classes[attribute]
    return strata * (1 if classes == 2 else classes)


#: Where the running erasure keeps each attribute's running group-mean
#: differences in the trainable tree (updated through :data:`STATE_KEY`).
FISHER_STATS = "fisher_stats"


def init_fisher_stats(
    settings: DebiasSettings, feature_dim: int, attributes: Sequence[str]
) -> dict[str, Any]:
    """Zero running mean differences for :func:`debias_term`'s erasure term."""
    return {
        a: objectives.init_mean_differences(fisher_pairs(settings, a), feature_dim)
        for a in attributes
    }


#: Where the erased-target term keeps each attribute's running cell means of
#: the undebiased representations (updated through :data:`STATE_KEY`).
TARGET_STATS = "target_stats"


def init_target_stats(
    settings: DebiasSettings, feature_dim: int, attributes: Sequence[str]
) -> dict[str, Any]:
    """Empty running cell means for :func:`debias_term`'s erased targets."""
    return {
        a: objectives.init_cell_means(
            settings.num_task_classes, settings.attr_classes[a], feature_dim
        )
        for a in attributes
    }


def auto_conditioning(joint: Any, batch_size: int) -> str:
    """``"stratify"`` or ``"reweight"`` for one attribute's [T][C] joint table.

    Stratifying compares the attribute's groups within each task class and
    skips a class where a group has fewer than 2 members in the batch; when
    the attribute follows the task closely, the minority cells are that
    small in most batches, and reweighting (which uses every member) is the
    estimator with data.
    """
    smallest = min(min(row) for row in joint)
    return "stratify" if batch_size * smallest >= AUTO_MIN_MEMBERS else "reweight"


#: Where the whitened MMD keeps each attribute's running covariance in the
#: trainable tree (not differentiated; updated through :data:`STATE_KEY`).
MMD_STATS = "mmd_stats"


def init_mmd_stats(feature_dim: int, attributes: Sequence[str]) -> dict[str, Any]:
    """Zero running statistics for :func:`debias_term`'s whitened MMD."""
    return {a: objectives.init_covariance(feature_dim) for a in attributes}


#: Where the task guard keeps its state in the trainable tree: the core's
#: accuracy on the current batch (written by the task step) and, per
#: attribute, the running accuracy gap and the removal weight's log backoff.
TASK_GUARD = "task_guard"


def init_task_guard(attributes: Sequence[str]) -> dict[str, Any]:
    """Zero state for the task guard (every leaf its own buffer: donation)."""
    return {
        "core_acc": jnp.zeros((), jnp.float32),
        "attrs": {
            a: {
                "gap": jnp.zeros((), jnp.float32),
                "backoff": jnp.zeros((), jnp.float32),
            }
            for a in attributes
        },
    }


def guard_update(
    state: Mapping[str, jax.Array],
    core_acc: jax.Array,
    diff_acc: jax.Array,
    settings: DebiasSettings,
    step: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """One dual-ascent step of an attribute's task guard.

    ``gap`` is an EMA of (core accuracy - diff accuracy) on the training
    batches; ``backoff`` (the log of the factor the removal weight is divided
    by) moves by ``rate * (gap - slack)`` (times ``release`` while the gap is
    under the slack) and stays in ``[0, max]``; before
    train step ``task_guard_start`` it stays where it is (``step`` None: a
    loss called outside the train step, the guard moves).
    """
    d = settings.task_guard_decay
    gap = d * state["gap"] + (1.0 - d) * (core_acc - diff_acc)
    excess = gap - settings.task_guard_slack
    back = jnp.where(excess < 0.0, settings.task_guard_release, 1.0)
    move = settings.task_guard_rate * back * excess
    if settings.task_guard_start > 0 and step is not None:
        move = jnp.where(jnp.asarray(step) >= settings.task_guard_start, move, 0.0)
    backoff = jnp.clip(state["backoff"] + move, 0.0, settings.task_guard_max)
    return {"gap": gap, "backoff": backoff}


def guarded(
    removed: Mapping[str, Any],
    state: Mapping[str, jax.Array],
    attribute: str,
    *,
    core_acc: jax.Array,
    diff_acc: jax.Array,
    settings: DebiasSettings,
    step: jax.Array | None = None,
) -> dict[str, Any]:
    """``removed`` (an attribute's removal terms) scaled by ``exp(-backoff)``
    of the guard's ``state`` before this step, with the guard's update (under
    :data:`STATE_KEY`) and its running gap and weight (under :data:`INFO_KEY`).
    The adversaries' own fit under ``adv_loss="confusion"`` is not removal and
    is not scaled."""
    new = guard_update(state, core_acc, diff_acc, settings, step)
    scale = jnp.exp(-jax.lax.stop_gradient(state["backoff"]))
    out = scaled(removed, scale, settings)
    out.setdefault(STATE_KEY, {}).update(
        {(TASK_GUARD, "attrs", attribute, k): v for k, v in new.items()}
    )
    out[INFO_KEY] = {"guard/gap": new["gap"], "guard/weight": jnp.exp(-new["backoff"])}
    return out


def scaled(
    removed: Mapping[str, Any], scale: jax.Array, settings: DebiasSettings
) -> dict[str, Any]:
    """An attribute's removal terms times ``scale``; the reserved entries and
    the adversaries' own fit under ``adv_loss="confusion"`` (not removal)
    are left as they are."""
    out = {}
    for key, value in removed.items():
        if key in (STATE_KEY, INFO_KEY):
            out[key] = dict(value)
        elif key.startswith("adv/") and settings.adv_loss == "confusion":
            out[key] = value
        else:
            out[key] = scale * value
    return out


def warmed_up(
    removed: Mapping[str, Any], step: jax.Array | None, settings: DebiasSettings
) -> dict[str, Any]:
    """``removed`` times the warm-up ramp ``min(step / removal_warmup_steps,
    1)``.

    In MoDDiffy-par the core learns the task in the same steps: at full
    weight from step 0 the diffs remove whatever the barely trained
    representation holds, the task included (measured on MiniLM: the diffs'
    task loss stayed at ln 2 through step 80 while the core's fell to 0.2),
    and the budget's first cuts are taken in that state. ``step`` None (a
    loss called outside the train step) means full weight.
    """
    if settings.removal_warmup_steps <= 0 or step is None:
        return dict(removed)
    ramp = jnp.minimum(
        jnp.asarray(step, jnp.float32) / settings.removal_warmup_steps, 1.0
    )
    return scaled(removed, ramp, settings)


def settings_from_config(
    method: Any,
    *,
    attr_classes: Mapping[str, int],
    attr_prior: Mapping[str, Any],
    attr_joint: Mapping[str, Any],
    num_task_classes: int,
    batch_size: int,
) -> DebiasSettings:
    """The :class:`DebiasSettings` of ``config.method``; a bad value raises a
    ``ValueError`` that names the field, the value and what is allowed.

    ``attr_prior`` and ``attr_joint`` are the train split's P(a | y) and
    P(y, a) tables ([T][C] nested tuples per attribute).
    """
    if method.objective not in DEBIAS_OBJECTIVES:
        raise ValueError(
            f"config.method.objective={method.objective!r} is not one of "
            f"{DEBIAS_OBJECTIVES}."
        )
    fields = {key: method.get(key, old) for key, old in LATER_FIELDS}
    fields["attribute_weights"] = parse_attribute_weights(
        fields["attribute_weights"], list(attr_classes)
    )
    for key, valid in (
        ("adv_loss", ADV_LOSSES),
        ("mmd_kernel", objectives_mmd.KERNELS),
        ("mmd_conditional", MMD_CONDITIONS),
        ("mmd_whiten_within", WHITEN_WITHIN),
        ("target_mode", objectives.TARGET_MODES),
        ("condition_on", CONDITION_ON),
        ("task_target", TASK_TARGETS),
        ("keep_from", KEEP_FROM),
    ):
        if fields[key] not in valid:
            raise ValueError(
                f"config.method.{key}={fields[key]!r} is not one of {valid}."
            )
    for key, low, high, meaning in (
        ("task_distill", 0.0, float("inf"), "0 turns the task-keeping term off"),
        ("swap_distill", 0.0, float("inf"), "0 turns the unswapped rows' KL off"),
        ("swap_distill_pivotal", 0.0, float("inf"), "0 turns the pivotal KL off"),
        ("mmd_whiten_decay", 0.0, 1.0, "the running covariance's EMA decay"),
        ("task_guard_slack", -1.0, 1.0, "an accuracy difference"),
        ("task_guard_rate", 0.0, float("inf"), "the dual step size"),
        ("task_guard_decay", 0.0, 1.0, "the running gap's EMA decay"),
        ("task_guard_release", 0.0, float("inf"), "the step factor coming back"),
        ("fisher_decay", 0.0, 1.0, "the running mean differences' EMA decay"),
        ("target_decay", 0.0, 1.0, "the running cell means' EMA decay"),
    ):
        if not low <= fields[key] < high:
            raise ValueError(
                f"config.method.{key} must be in [{low}, {high}) ({meaning}), "
                f"got {fields[key]}."
            )
    for key, term in (
        ("fisher_weight", "the running linear erasure"),
        ("target_weight", "the erased targets"),
    ):
        per_attribute = [
            w[key] for w in fields["attribute_weights"].values() if key in w
        ]
        if fields[key] < 0.0:
            raise ValueError(
                f"config.method.{key} must be >= 0 (0 turns {term} off), "
                f"got {fields[key]}."
            )
        if max([fields[key], *per_attribute]) > 0.0 and not (
            method.objective == "mmd" and fields["mmd_whiten"]
        ):
            raise ValueError(
                f"config.method.{key} > 0 reads the whitened MMD's running "
                "covariance: set config.method.objective='mmd' and "
                f"config.method.mmd_whiten=True, or {key}=0."
            )
    if (
        fields["removal_memory"] < 0
        or int(fields["removal_memory"]) != fields["removal_memory"]
    ):
        raise ValueError(
            "config.method.removal_memory must be a whole number >= 0 (how many "
            f"previous batches the MMD also compares; 0: the batch alone), got "
            f"{fields['removal_memory']!r}."
        )
    if fields["removal_memory"] > 0 and method.objective != "mmd":
        raise ValueError(
            "config.method.removal_memory > 0 extends the MMD's groups: set "
            "config.method.objective='mmd', or removal_memory=0."
        )
    if fields["task_guard_start"] < 0:
        raise ValueError(
            "config.method.task_guard_start must be >= 0 (the step the task "
            f"guard starts at; 0: from the start), got {fields['task_guard_start']}."
        )
    if fields["removal_warmup_steps"] < 0:
        raise ValueError(
            "config.method.removal_warmup_steps must be >= 0 (0: full removal "
            f"weight from the first step), got {fields['removal_warmup_steps']}."
        )
    if fields["mmd_whiten_shrinkage"] <= 0.0:
        raise ValueError(
            "config.method.mmd_whiten_shrinkage must be > 0 (the ridge that "
            "keeps the running covariance invertible), got "
            f"{fields['mmd_whiten_shrinkage']}."
        )
    if fields["condition_on"] != "label" and fields["mmd_conditional"] not in (
        "stratify",
        "none",
    ):
        raise ValueError(
            f"config.method.condition_on={fields['condition_on']!r} compares the "
            "groups within predicted task classes; config.method.mmd_conditional="
            f"{fields['mmd_conditional']!r} reweights by the gold labels' joint "
            "table: set mmd_conditional='stratify', or condition_on='label'."
        )
    if not fields["swap_weight"] >= 0.0:
        raise ValueError(
            "config.method.swap_weight must be >= 0 (0 turns the counterfactual "
            f"swaps off), got {fields['swap_weight']}."
        )
    candidates = fields["swap_candidates"]
    if (
        isinstance(candidates, bool)
        or not isinstance(candidates, int)
        or candidates < 1
    ):
        raise ValueError(
            "config.method.swap_candidates must be a whole number >= 1 (how many "
            f"telling tokens are paired into counterpart groups), got {candidates!r}."
        )
    if not 0.0 <= fields["swap_share"] <= 1.0:
        raise ValueError(
            "config.method.swap_share must be in [0, 1] (a share of the best "
            f"token's score), got {fields['swap_share']}."
        )
    for name in (
        "swap_twin_gradient",
        "swap_keep_task",
        "swap_keep_pivotal",
        "swap_compose",
        "swap_one_sided",
    ):
        if not isinstance(fields[name], bool):
            raise ValueError(
                f"config.method.{name} must be True or False, got {fields[name]!r}."
            )
    for attribute, own in [("", {}), *fields["attribute_weights"].items()]:
        pivotal_kl = own.get("swap_distill_pivotal", fields["swap_distill_pivotal"])
        if pivotal_kl > 0.0 and not own.get(
            "swap_keep_pivotal", fields["swap_keep_pivotal"]
        ):
            where = f" for {attribute!r}" if attribute else ""
            raise ValueError(
                f"config.method.swap_distill_pivotal{where} is {pivotal_kl} but "
                "swap_keep_pivotal is off, so no pair is marked pivotal and the KL "
                "would do nothing: set config.method.swap_keep_pivotal=True (or "
                f"'{attribute or 'ATTRIBUTE'}: swap_keep_pivotal=true' in "
                "attribute_weights), or swap_distill_pivotal=0."
            )
    if not 0.0 <= fields["swap_target"] <= 1.0:
        raise ValueError(
            "config.method.swap_target must be a share of the gap in [0, 1] (0 "
            f"swaps every counterpart group), got {fields['swap_target']}."
        )
    if not fields["swap_max_drop"] >= 0.0:
        raise ValueError(
            "config.method.swap_max_drop must be >= 0 task points, got "
            f"{fields['swap_max_drop']}."
        )
    if method.objective == "swap" and not any(
        w.get("swap_weight", fields["swap_weight"]) > 0.0
        for w in [{}, *fields["attribute_weights"].values()]
    ):
        raise ValueError(
            "config.method.objective='swap' removes by the counterfactual swaps "
            "alone: set config.method.swap_weight > 0 (10 measured; docs/"
            "efficacy.md, 'Stop 39')."
        )
    by_attr = {}
    if fields["mmd_conditional"] == "auto":
        by_attr = {a: auto_conditioning(attr_joint[a], batch_size) for a in attr_joint}
        logging.info("mmd_conditional=auto resolved to %s", by_attr)
    return DebiasSettings(
        objective=method.objective,
        adv_lambda=method.adv_lambda,
        mmd_weight=method.mmd_weight,
        attr_classes=attr_classes,
        attr_prior=attr_prior,
        attr_joint=attr_joint,
        mmd_conditional_by_attr=by_attr,
        num_task_classes=num_task_classes,
        **fields,
    )
