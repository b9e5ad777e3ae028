"""The one train-step factory every method family shares.

A method is described by *data*, not by a training loop of its own:

* ``MethodDef``: how the task is learned (``encoder``: full fine-tuning,
  adapters, a task diff on the frozen pretrained encoder, or a frozen core
  taken from an earlier run) and how attributes are removed (``debias``:
  none, jointly with the task, or modularly with one sparse diff per
  attribute).
* The trainable state is a dict of named parts, e.g.
  ``{"core": params, "task_head": ..., "diffs": {"gender": DiffState},
  "adversaries": {"gender": ...}}``; the frozen state holds what is never
  differentiated (the pretrained or core params, sparse indices in the
  fixmask phase).
* A train step is a fixed sequence of ``SubStep`` s, each with its own loss,
  its own part of the trainable state and its own optimizer (so its own Adam
  moments). MoDDiffy-par is ``[task, debias/gender, debias/age]``: the task
  step trains core and task head with the diffs off, then each debias step
  trains one attribute's diff (core frozen) with the task loss through the
  same task head, its debias loss and its L0 term.

Phases (``l0`` -> ``fixmask`` for diff methods, a single ``train`` phase
otherwise) each get their own jitted step; the transition between them is a
host-side pure function (see ``moddiffy_jax.train``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from moddiffy_jax import objectives
from moddiffy_jax.methods import removal
from moddiffy_jax.methods.terms import (
    INFO_KEY,
    STATE_KEY,
    STEP_KEY,
    merge_terms,
    total,
)
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import hard_concrete, selection
from moddiffy_jax.subnets import masks as masks_lib

PyTree = Any
Key = tuple[str, ...]

#: The encoder labels the shared hooks (methods/standard.py, the losses below)
#: understand; a family with its own hooks may use its own label.
ENCODER_MODES = ("full", "adapter", "diff", "frozen", "mask", "imp", "retrain")
TASK_LOSSES = ("ce", "poe", "reweighting", "conf_reg")
#: Encoder modes whose model is a binary-masked subnetwork (SRNets).
SUBNETWORK_MODES = ("mask", "imp", "retrain")
DEBIAS_MODES = ("none", "joint", "modular")


@dataclasses.dataclass(frozen=True)
class MethodDef:
    """What a named method trains; see the module docstring."""

    name: str
    encoder: str
    debias: str
    description: str

    def __post_init__(self):
        if not isinstance(self.encoder, str) or not self.encoder:
            raise ValueError(
                f"encoder must be a non-empty label (the shared hooks know "
                f"{ENCODER_MODES}), got {self.encoder!r}."
            )
        if self.debias not in DEBIAS_MODES:
            raise ValueError(f"debias must be one of {DEBIAS_MODES}")


@flax.struct.dataclass
class TrainState:
    """Everything a step changes. ``opt_states`` has one entry per sub-step."""

    step: jax.Array
    trainable: dict[str, Any]
    opt_states: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class SubStep:
    """One optimisation step inside a train step.

    Attributes:
      name: e.g. "task" or "debias/gender"; prefixes its metric names.
      updates: the keys (paths into ``trainable``) this sub-step trains.
      loss: ``loss(trainable, frozen, batch, rng) -> (total, {name: term})``.
      optimizer: its own optax transformation (own moments, own clipping).
    """

    name: str
    updates: tuple[Key, ...]
    loss: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]
    optimizer: optax.GradientTransformation
    # A sub-step of one attribute, written for every attribute: ``loss`` and
    # ``updates`` name the attribute :data:`SHARED_ATTRIBUTE`, and the step
    # runs it on :func:`attribute_view` of the state for ``attribute``
    # (``attributes``: all of the run's). Sub-steps with the same ``loss``,
    # ``optimizer`` and ``updates`` then trace and compile once for all the
    # attributes whose parameters have the same shapes.
    attribute: str | None = None
    attributes: tuple[str, ...] = ()


#: The attribute name a shared sub-step is written for (see SubStep).
SHARED_ATTRIBUTE = "@attribute"


def attribute_view(tree: Any, attributes: Sequence[str], attribute: str) -> Any:
    """``tree`` as a shared sub-step sees ``attribute``: every dict keyed by
    exactly the run's ``attributes`` becomes ``{SHARED_ATTRIBUTE: its entry
    for attribute}``; other attributes' entries are left out."""
    if not isinstance(tree, Mapping):
        return tree
    if set(tree) == set(attributes):
        return {SHARED_ATTRIBUTE: tree[attribute]}
    return {k: attribute_view(v, attributes, attribute) for k, v in tree.items()}


def attribute_unview(full: Any, view: Any, attribute: str) -> Any:
    """The inverse of :func:`attribute_view`: ``full`` with what ``view`` holds
    (``SHARED_ATTRIBUTE`` entries written back under ``attribute``; entries
    new in ``view`` are added, other attributes' are kept)."""
    if not isinstance(view, Mapping):
        return view
    out = dict(full) if isinstance(full, Mapping) else {}
    for k, v in view.items():
        if k == SHARED_ATTRIBUTE:
            out[attribute] = v
        else:
            out[k] = attribute_unview(out.get(k), v, attribute)
    return out


def get_part(tree: Mapping[str, Any], key: Key) -> Any:
    node = tree
    for k in key:
        node = node[k]
    return node


def set_part(tree: Mapping[str, Any], key: Key, value: Any) -> dict[str, Any]:
    """A copy of ``tree`` with ``value`` at ``key`` (copies only the spine)."""
    head, *rest = key
    out = dict(tree)
    out[head] = value if not rest else set_part(tree.get(head, {}), tuple(rest), value)
    return out


def _nested_set(out: dict[str, Any], key: Key, value: Any) -> None:
    node = out
    for k in key[:-1]:
        node = node.setdefault(k, {})
    node[key[-1]] = value


def gather_parts(trainable: Mapping[str, Any], keys: Sequence[Key]) -> dict[str, Any]:
    """The nested dict holding only the parts of ``trainable`` at ``keys``."""
    out: dict[str, Any] = {}
    for key in keys:
        _nested_set(out, key, get_part(trainable, key))
    return out


def drop_parts(tree: Mapping[str, Any], keys: Sequence[Key]) -> dict[str, Any]:
    """A copy of ``tree`` without the parts at ``keys`` (copies only the spine)."""
    out = dict(tree)
    for key in keys:
        head, *rest = key
        if head not in out:
            continue
        if rest:
            out[head] = drop_parts(out[head], (tuple(rest),))
        else:
            del out[head]
    return out


def scatter_parts(
    trainable: Mapping[str, Any], parts: Mapping[str, Any], keys: Sequence[Key]
) -> dict[str, Any]:
    """``trainable`` with the parts at ``keys`` taken from ``parts``."""
    out = dict(trainable)
    for key in keys:
        out = set_part(out, key, get_part(parts, key))
    return out


# --------------------------------------------------------------------------
# Optimizers: per-role learning rates through optax.partition.

# Roles by path inside the trained parts; first match wins. The optimizer
# config gives each role a learning rate and a weight decay.
ROLE_RULES: tuple[tuple[str, str], ...] = (
    (r"core/.*", "encoder"),
    (r"adapters/.*", "adapter"),
    (r"(task_diff|diffs/[^/]+)/(log_alpha|group_log_alpha)(/.*)?", "log_alpha"),
    (r"(task_diff|diffs/[^/]+)/.*", "diff"),
    (r"task_head/.*", "heads"),
    (r"adversaries/[^/]+/.*", "adversary"),
    (r"scores/.*", "scores"),
)
ROLES = ("encoder", "adapter", "log_alpha", "diff", "heads", "adversary", "scores")


def role_labels(parts: PyTree) -> PyTree:
    """Role label of every leaf of ``parts`` from :data:`ROLE_RULES`."""
    paths = selection.tree_paths(parts)
    rules = [
        (rule, role)
        for rule, role in ROLE_RULES
        if any(re.fullmatch(rule, p) for p in paths)
    ]
    return selection.assign_roles(parts, rules)


def make_optimizer(optim: Mapping[str, Any]) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with a learning rate per role.

    Args:
      optim: the ``config.optim`` mapping with ``lr_<role>``, ``wd_<role>``
        for every role in :data:`ROLES`, ``clip_norm`` (<= 0 disables), and
        ``b1``, ``b2``, ``eps``.

    The clip is over all gradients of one sub-step. The reference clips over
    every parameter of the model, including stale gradients of other
    sub-steps (moddiffy_spec §3.4); with separate sub-steps that leak is a
    bug, so each sub-step clips its own gradients.
    """
    transforms = {
        role: optax.adamw(
            optim[f"lr_{role}"],
            b1=optim["b1"],
            b2=optim["b2"],
            eps=optim["eps"],
            weight_decay=optim[f"wd_{role}"],
        )
        for role in ROLES
    }
    chain = [optax.partition(transforms, role_labels)]
    if optim["clip_norm"] > 0:
        chain.insert(0, optax.clip_by_global_norm(optim["clip_norm"]))
    return optax.chain(*chain)


# Learning-rate schedules and gradient accumulation (``config.optim``):
# ``schedule`` ("constant" | "linear" | "cosine"), ``warmup_steps`` and
# ``accumulate``, applied per phase (every phase starts fresh optimizers).

SCHEDULES = ("constant", "linear", "cosine")
# Roles whose learning rate stays constant under a schedule: the diff
# pruning reference decays the diff's learning rate, never the gates'.
UNSCHEDULED_ROLES = ("log_alpha",)


def lr_factor(schedule: str, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """The learning-rate multiplier at update ``count`` (0 for the first).

    Linear warm-up from 0 over ``warmup_steps`` updates, then constant,
    linear to 0, or half a cosine to 0 at ``total_steps``: the factors of
    transformers' ``get_{constant,linear,cosine}_schedule_with_warmup``
    (the first update of a warm-up has factor 0, as there).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"config.optim.schedule={schedule!r}; use one of {SCHEDULES}.")
    warmup, total = int(warmup_steps), int(total_steps)

    def factor(count):
        c = jnp.asarray(count, jnp.float32)
        warm = c / max(warmup, 1)
        rest = jnp.clip((c - warmup) / max(total - warmup, 1), 0.0, 1.0)
        if schedule == "linear":
            after = 1.0 - rest
        elif schedule == "cosine":
            after = 0.5 * (1.0 + jnp.cos(jnp.pi * rest))
        else:
            after = jnp.ones_like(rest)
        return jnp.where(c < warmup, warm, after)

    return factor


def check_optim(optim: Mapping[str, Any], phase_steps: Mapping[str, int]) -> None:
    """Raises ValueError naming the field and the fix for a bad schedule or
    accumulation setting; ``phase_steps``: each phase's steps (micro-batches)."""
    schedule = optim.get("schedule", "constant")
    if schedule not in SCHEDULES:
        raise ValueError(
            f"config.optim.schedule={schedule!r}; use one of {list(SCHEDULES)}."
        )
    k, warmup = int(optim.get("accumulate", 1)), int(optim.get("warmup_steps", 0))
    if k < 1:
        raise ValueError(f"config.optim.accumulate must be >= 1, got {k}.")
    if warmup < 0:
        raise ValueError(f"config.optim.warmup_steps must be >= 0, got {warmup}.")
    for phase, n in phase_steps.items():
        if n % k:
            raise ValueError(
                f"phase {phase!r} has {n} steps, not a multiple of "
                f"config.optim.accumulate={k}: the last {n % k} micro-batches "
                "would never update. Make the step counts multiples of it."
            )
        if warmup and warmup >= n // k:
            raise ValueError(
                f"config.optim.warmup_steps={warmup} leaves no update after the "
                f"warm-up in phase {phase!r} ({n // k} updates: {n} steps / "
                f"accumulate {k}); warm-up counts updates, not micro-batches."
            )


def schedule_substeps(
    substeps: Sequence[SubStep], optim: Mapping[str, Any], phase_steps: int
) -> list[SubStep]:
    """``substeps`` with ``config.optim``'s schedule and accumulation.

    The schedule multiplies the whole AdamW update of every role but
    :data:`UNSCHEDULED_ROLES`, which is exactly AdamW with a scheduled
    learning rate (optax scales the decoupled weight decay by it too). With
    ``accumulate = k`` (optax.MultiSteps) the optimizer sees the mean gradient
    of k micro-batches, clipped as one, and updates once every k steps;
    between updates the parameters stay put. Warm-up and decay count updates:
    ``phase_steps / k`` of them. With the defaults (constant, no warm-up,
    k = 1) the sub-steps are returned unchanged.
    """
    schedule = optim.get("schedule", "constant")
    k, warmup = int(optim.get("accumulate", 1)), int(optim.get("warmup_steps", 0))
    if schedule == "constant" and not warmup and k == 1:
        return list(substeps)
    factor = lr_factor(schedule, warmup, phase_steps // k)
    scaled = {role: optax.scale_by_schedule(factor) for role in ROLES}
    scaled.update({role: optax.identity() for role in UNSCHEDULED_ROLES})
    out, made = [], {}
    for sub in substeps:
        # One transformation per original one: shared sub-steps stay shared.
        opt = made.get(id(sub.optimizer))
        if opt is None:
            opt = optax.chain(sub.optimizer, optax.partition(scaled, role_labels))
            if k > 1:
                opt = optax.MultiSteps(opt, every_k_schedule=k)
            made[id(sub.optimizer)] = opt
        out.append(dataclasses.replace(sub, optimizer=opt))
    return out


# --------------------------------------------------------------------------
# Encoder parameters of a configuration.


@dataclasses.dataclass(frozen=True)
class DiffSettings:
    """Static hyperparameters of the diffs of one run."""

    hc: hard_concrete.HardConcrete
    straight_through: bool
    l0_weight: float
    # Parameter paths the model reads only by rows (its word embeddings): in
    # training a diff builds just the rows a batch reads (dense_diff.GatedRows).
    gathered: tuple[str, ...] = ()


def add_sparse(
    base: PyTree, indices: Mapping[str, Any], values: Mapping[str, Any]
) -> PyTree:
    """``base`` plus a scatter of ``values`` at flat ``indices`` (nested dicts)."""

    def add(leaf, idx, val):
        flat = leaf.reshape(-1).at[idx].add(val.astype(leaf.dtype))
        return flat.reshape(leaf.shape)

    return selection.map_subtree(add, base, indices, values)


def apply_diff_part(
    base: PyTree,
    part: Any,
    indices: Any,
    *,
    phase: str,
    settings: DiffSettings,
    rng: jax.Array | None,
    train: bool,
) -> PyTree:
    """Adds one diff (a DiffState in ``l0``, sparse values in ``fixmask``)."""
    if phase == "l0":
        return diffs_lib.apply_dense_diff(
            base,
            part,
            rng=rng,
            hc=settings.hc,
            train=train,
            straight_through=settings.straight_through,
            gathered=settings.gathered,
        )
    return add_sparse(base, indices, part)


def encoder_params(
    method: MethodDef,
    trainable: Mapping[str, Any],
    frozen: Mapping[str, Any],
    *,
    phase: str,
    settings: DiffSettings | None,
    attribute: str | None,
    rng: jax.Array | None,
    train: bool,
) -> PyTree:
    """Effective encoder params: base/core, adapters, task diff, attribute diff."""
    params = trainable["core"] if method.encoder == "full" else frozen["base"]
    if method.encoder == "adapter":
        params = selection.merge(params, trainable["adapters"])
    rngs = jax.random.split(rng, 2) if rng is not None else (None, None)
    if method.encoder == "diff":
        params = apply_diff_part(
            params,
            trainable["task_diff"],
            frozen.get("indices", {}).get("task_diff"),
            phase=phase,
            settings=settings,
            rng=rngs[0],
            train=train,
        )
    if attribute is not None:
        params = apply_diff_part(
            params,
            trainable["diffs"][attribute],
            frozen.get("indices", {}).get("diffs", {}).get(attribute),
            phase=phase,
            settings=settings,
            rng=rngs[1],
            train=train,
        )
    return params


def subnetwork_params(
    method: MethodDef, trainable: Mapping[str, Any], frozen: Mapping[str, Any]
) -> tuple[PyTree, PyTree]:
    """Effective ``(encoder, head)`` of the SRNets encoder modes.

    * ``mask``: frozen encoder and head times straight-through masks of the
      trained scores (``trainable["scores"]`` over ``{"core", "task_head"}``)
      at the fixed ``trainable["thresholds"]``;
    * ``imp``: trained weights times the round's masks (``trainable["masks"]``);
    * ``retrain``: trained weights times a fixed mask (``frozen["masks"]``).
    """
    if method.encoder == "mask":
        tree = masks_lib.apply_masks(
            {"core": frozen["base"], "task_head": frozen["task_head"]},
            trainable["scores"],
            thresholds=trainable["thresholds"],
        )
        return tree["core"], tree["task_head"]
    keep = trainable["masks"] if method.encoder == "imp" else frozen["masks"]
    return masks_lib.apply_binary_masks(trainable["core"], keep), trainable["task_head"]


def task_loss_value(name: str, logits: jax.Array, batch: Mapping[str, Any]):
    """The task term: cross-entropy or a known-bias loss (``config.method.task_loss``).

    Known-bias losses read the bias model's log-probabilities
    ``batch["extras"]["bias_logprobs"]`` [B, C] and, for ``conf_reg``, the
    teacher's ``batch["extras"]["teacher_probs"]`` [B, C].
    """
    labels = batch["task"]
    if name == "ce":
        return objectives.cross_entropy(logits, labels)
    extras = batch.get("extras", {})
    if "bias_logprobs" not in extras:
        raise ValueError(
            f"config.method.task_loss={name!r} needs the bias model's predictions: "
            "set config.data.bias.source (attribute, features or file)."
        )
    fn = objectives.get_known_bias_loss(name)
    bias_probs = jnp.exp(extras["bias_logprobs"].astype(jnp.float32))
    if name == "conf_reg":
        if "teacher_probs" not in extras:
            raise ValueError(
                "config.method.task_loss='conf_reg' needs a teacher: set "
                "config.method.teacher_run to a finished finetune run."
            )
        return fn(logits, labels, bias_probs, extras["teacher_probs"])
    return fn(logits, labels, bias_probs)


def _encoder_and_head(
    method, trainable, frozen, phase, settings, attribute, rng, *, train
):
    """The method's ``encoder_and_head`` hook, or :func:`standard_encoder_and_head`."""
    hook = getattr(method, "encoder_and_head", standard_encoder_and_head)
    return hook(method, trainable, frozen, phase, settings, attribute, rng, train=train)


def standard_encoder_and_head(
    method, trainable, frozen, phase, settings, attribute, rng, *, train
):
    """The effective encoder (with ``attribute``'s diff, if any) and task head
    of the encoder modes in :data:`ENCODER_MODES`."""
    if method.encoder in SUBNETWORK_MODES:
        return subnetwork_params(method, trainable, frozen)
    params = encoder_params(
        method,
        trainable,
        frozen,
        phase=phase,
        settings=settings,
        attribute=attribute,
        rng=rng,
        train=train,
    )
    return params, trainable.get("task_head", frozen.get("task_head"))


def _task_forward(
    model,
    method,
    trainable,
    frozen,
    batch,
    rng,
    *,
    phase,
    settings,
    attribute,
    task_loss="ce",
):
    """Encoder forward (with ``attribute``'s diff, if any) and the task term.

    Returns ``(h, logits, terms, rng_for_removal)`` with
    ``terms = {"task": loss}``.
    """
    r_diff, r_enc, r_head, r_adv = jax.random.split(rng, 4)
    params, head = _encoder_and_head(
        method, trainable, frozen, phase, settings, attribute, r_diff, train=True
    )
    terms = {}
    if getattr(model, "stateful", False) and method.encoder == "full":
        # BatchNorm: train-mode batch statistics, and the updated running
        # statistics go back into the core after the optimizer update.
        h, stats = model.represent_with_state(params, batch, r_enc)
        terms[STATE_KEY] = {("core", "batch_stats"): stats}
    else:
        h = model.represent(params, batch, r_enc, True)
    logits = model.task_logits(head, h, r_head, True)
    terms["task"] = task_loss_value(task_loss, logits, batch)
    return h, logits, terms, r_adv


def _undebiased_representation(
    model, method, trainable, frozen, batch, rng, *, phase, settings
):
    """The representations without any attribute diff (no gradient), under
    the dropout and diff samples that :func:`_task_forward` draws from
    ``rng``: the erased-target term's anchor."""
    r_diff, r_enc, _, _ = jax.random.split(rng, 4)
    params, _ = _encoder_and_head(
        method, trainable, frozen, phase, settings, None, r_diff, train=True
    )
    return jax.lax.stop_gradient(model.represent(params, batch, r_enc, True))


def _core_prediction(model, method, trainable, frozen, batch, *, phase, settings):
    """The task log-probabilities without any attribute diff (no dropout, no
    gradient): what a debias step should keep."""
    params, head = _encoder_and_head(
        method, trainable, frozen, phase, settings, None, None, train=False
    )
    h = model.represent(params, batch, None, False)
    logits = model.task_logits(head, h, None, False)
    return jax.lax.stop_gradient(jax.nn.log_softmax(logits.astype(jnp.float32), -1))


def make_task_loss(
    model: Any,
    method: MethodDef,
    *,
    phase: str,
    diff_settings: DiffSettings | None,
    debias: removal.DebiasSettings | None,
    attributes: Sequence[str],
    task_loss: str = "ce",
) -> Callable:
    """Loss of the task step (plus joint debias terms and the task-diff L0)."""

    def loss(trainable, frozen, batch, rng):
        h, logits, terms, r_adv = _task_forward(
            model,
            method,
            trainable,
            frozen,
            batch,
            rng,
            phase=phase,
            settings=diff_settings,
            attribute=None,
            task_loss=task_loss,
        )
        if method.debias == "joint":
            for i, attr in enumerate(attributes):
                removed = removal.debias_term(
                    model,
                    trainable,
                    h,
                    batch["attrs"][attr],
                    attr,
                    settings=debias,
                    rng=jax.random.fold_in(r_adv, i),
                    train=True,
                    task=batch["task"],
                )
                removed = removal.warmed_up(removed, batch.get(STEP_KEY), debias)
                merge_terms(terms, removed)
        if method.encoder == "diff" and phase == "l0":
            penalty = diffs_lib.l0_penalty(trainable["task_diff"], hc=diff_settings.hc)
            terms["l0/task"] = diff_settings.l0_weight * penalty
        if debias is not None and debias.task_guard and method.debias == "modular":
            acc = _accuracy(logits, batch["task"])
            merge_terms(terms, {STATE_KEY: {(removal.TASK_GUARD, "core_acc"): acc}})
        return total(terms), terms

    return loss


def _accuracy(logits: jax.Array, task: jax.Array) -> jax.Array:
    hit = jnp.argmax(logits, -1) == task
    return jax.lax.stop_gradient(jnp.mean(hit.astype(jnp.float32)))


def _core_accuracy(model, method, trainable, frozen, batch, phase, settings):
    """The core's task accuracy on ``batch`` (no diff, eval mode)."""
    logp = _core_prediction(
        model, method, trainable, frozen, batch, phase=phase, settings=settings
    )
    return _accuracy(logp, batch["task"])


def _guarded(removed, trainable, batch, logits, attribute, debias, core_acc):
    """``removed`` scaled by the attribute's task guard (see removal.guarded).

    The core's accuracy on the batch is the task step's (the same batch,
    earlier in the same train step) where the core trains; with a frozen core
    (MoDDiffy-post) ``core_acc()`` computes it.
    """
    guard = trainable[removal.TASK_GUARD]
    reference = guard["core_acc"] if "core" in trainable else core_acc()
    return removal.guarded(
        removed,
        guard["attrs"][attribute],
        attribute,
        core_acc=reference,
        diff_acc=_accuracy(logits, batch["task"]),
        settings=debias,
    )


def make_debias_loss(
    model: Any,
    method: MethodDef,
    attribute: str,
    *,
    phase: str,
    diff_settings: DiffSettings,
    debias: removal.DebiasSettings,
    task_loss: str = "ce",
) -> Callable:
    """Loss of attribute ``attribute``'s modular debias step.

    task CE through the (shared) task head + the removal term + L0 of this
    attribute's diff only (the reference always penalised diff 0; spec §4.2).
    """

    def loss(trainable, frozen, batch, rng):
        h, logits, terms, r_adv = _task_forward(
            model,
            method,
            trainable,
            frozen,
            batch,
            rng,
            phase=phase,
            settings=diff_settings,
            attribute=attribute,
            task_loss=task_loss,
        )
        if debias.task_distill > 0.0:
            teacher = _core_prediction(
                model,
                method,
                trainable,
                frozen,
                batch,
                phase=phase,
                settings=diff_settings,
            )
            student = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
            kl = jnp.sum(jnp.exp(teacher) * (teacher - student), -1)
            terms["distill"] = debias.task_distill * jnp.mean(kl)
        anchor = None
        if debias.target_weight > 0.0:
            anchor = _undebiased_representation(
                model,
                method,
                trainable,
                frozen,
                batch,
                rng,
                phase=phase,
                settings=diff_settings,
            )
        removed = removal.debias_term(
            model,
            trainable,
            h,
            batch["attrs"][attribute],
            attribute,
            settings=debias,
            rng=r_adv,
            train=True,
            task=batch["task"],
            anchor=anchor,
        )
        removed = removal.warmed_up(removed, batch.get(STEP_KEY), debias)
        if debias.task_guard:
            removed = _guarded(
                removed,
                trainable,
                batch,
                logits,
                attribute,
                debias,
                core_acc=lambda: _core_accuracy(
                    model, method, trainable, frozen, batch, phase, diff_settings
                ),
            )
        merge_terms(terms, removed)
        if phase == "l0":
            penalty = diffs_lib.l0_penalty(
                trainable["diffs"][attribute], hc=diff_settings.hc
            )
            terms[f"l0/{attribute}"] = diff_settings.l0_weight * penalty
        return total(terms), terms

    return loss


# --------------------------------------------------------------------------
# The step factory.


def make_train_step(substeps: Sequence[SubStep]) -> Callable:
    """``step(state, frozen, batch, rng) -> (state, metrics)``, not yet jitted.

    Sub-steps run in order; each sees the parameters the previous ones
    produced. The step's randomness is ``fold_in(rng, state.step)`` and then
    ``fold_in(., i)`` for sub-step ``i``, so a resumed run draws the same
    noise as an uninterrupted one. Jitted whole, it is one program; see
    :func:`compile_train_step` for one program per distinct sub-step.
    """
    updates = [_substep_update(sub) for sub in substeps]

    opt_trees: dict[int, Any] = {}

    def step(state: TrainState, frozen, batch, rng):
        return _run_substeps(substeps, updates, opt_trees, state, frozen, batch, rng)

    return step


def compile_train_step(substeps: Sequence[SubStep], *, donate: bool = True) -> Callable:
    """The step of :func:`make_train_step`, the same arithmetic, with each
    sub-step jitted on its own (its parameters and optimizer state donated)
    and shared sub-steps (:class:`SubStep` ``attribute``) jitted once: the
    attributes' debias sub-steps of a run then trace and compile once, not
    once per attribute (docs/speed.md)."""
    jitted: dict[tuple[int, int, tuple[Key, ...]], Callable] = {}
    updates = []
    for sub in substeps:
        key = (id(sub.loss), id(sub.optimizer), sub.updates)
        if sub.attribute is None or key not in jitted:
            fn = jax.jit(_substep_update(sub), donate_argnums=(0, 1) if donate else ())
            if sub.attribute is not None:
                jitted[key] = fn
        else:
            fn = jitted[key]
        updates.append(fn)

    opt_trees: dict[int, Any] = {}

    def step(state: TrainState, frozen, batch, rng):
        return _run_substeps(substeps, updates, opt_trees, state, frozen, batch, rng)

    return step


def _substep_update(sub: SubStep) -> Callable:
    """One sub-step's update of its parts ``own`` (the rest of the trainable
    tree in ``rest``): ``(own, opt_state, state_updates, metrics)``."""

    def update(own, opt_state, rest, frozen, batch, rng, step, index):
        sub_rng = jax.random.fold_in(jax.random.fold_in(rng, step), index)

        def objective(own_):
            full = scatter_parts(rest, own_, sub.updates)
            return sub.loss(full, frozen, {**batch, STEP_KEY: step}, sub_rng)

        (total_, terms), grads = jax.value_and_grad(objective, has_aux=True)(own)
        changes, opt_state = sub.optimizer.update(grads, opt_state, own)
        own = optax.apply_updates(own, changes)
        state_updates = terms.pop(STATE_KEY, {})
        terms.update(terms.pop(INFO_KEY, {}))
        metrics = {"loss": total_, "grad_norm": optax.global_norm(grads), **terms}
        return own, opt_state, state_updates, metrics

    return update


def _run_substeps(substeps, updates, opt_trees, state: TrainState, frozen, batch, rng):
    trainable = state.trainable
    opt_states = dict(state.opt_states)
    metrics = {}
    for i, (sub, update) in enumerate(zip(substeps, updates, strict=True)):
        attr = sub.attribute
        view, frozen_view, batch_view = trainable, frozen, batch
        opt_state = opt_states[sub.name]
        if attr is not None:
            view = attribute_view(trainable, sub.attributes, attr)
            frozen_view = attribute_view(frozen, sub.attributes, attr)
            batch_view = {**batch, "attrs": {SHARED_ATTRIBUTE: batch["attrs"][attr]}}
            if i not in opt_trees:  # traced once, not every step
                opt_trees[i] = _shared_opt_tree(sub, view)
            opt_state = _retree(opt_state, opt_trees[i])
        own = gather_parts(view, sub.updates)
        rest = drop_parts(view, sub.updates)
        own, opt_state, state_updates, terms = update(
            own,
            opt_state,
            rest,
            frozen_view,
            batch_view,
            rng,
            state.step,
            np.int32(i),
        )
        view = scatter_parts(rest, own, sub.updates)
        for key, value in state_updates.items():
            view = set_part(view, key, value)
        if attr is None:
            trainable = view
        else:
            trainable = attribute_unview(trainable, view, attr)
            opt_state = _retree(opt_state, jax.tree.structure(opt_states[sub.name]))
            terms = {k.replace(SHARED_ATTRIBUTE, attr): v for k, v in terms.items()}
        opt_states[sub.name] = opt_state
        for name, value in terms.items():
            metrics[f"{sub.name}/{name}"] = value
    new_state = state.replace(
        step=state.step + 1, trainable=trainable, opt_states=opt_states
    )
    return new_state, metrics


def _shared_opt_tree(sub: SubStep, view) -> Any:
    """The tree structure of a shared sub-step's optimizer state (its
    attribute's dict keys renamed, leaves in the same order: each
    attribute-keyed dict of the trained parts holds one attribute)."""
    own = gather_parts(view, sub.updates)
    return jax.tree.structure(jax.eval_shape(sub.optimizer.init, own))


def _retree(tree, treedef):
    """The leaves of ``tree`` in the structure ``treedef``."""
    leaves = jax.tree.leaves(tree)
    if treedef.num_leaves != len(leaves):
        raise ValueError(
            f"optimizer state with {len(leaves)} leaves cannot take the shared "
            f"sub-step's structure of {treedef.num_leaves}"
        )
    return jax.tree.unflatten(treedef, leaves)


def init_opt_states(
    substeps: Sequence[SubStep], trainable: Mapping[str, Any]
) -> dict[str, Any]:
    """Each sub-step's optimizer state, over its parts as the state stores
    them (a shared sub-step's under its own attribute's name)."""
    return {
        sub.name: sub.optimizer.init(gather_parts(trainable, stored_updates(sub)))
        for sub in substeps
    }


def stored_loss(sub: SubStep) -> Callable:
    """``sub.loss`` over the trees as the state stores them (for a shared
    sub-step: on its attribute's view, term names under the attribute's)."""
    if sub.attribute is None:
        return sub.loss

    def loss(trainable, frozen, batch, rng):
        view = functools.partial(
            attribute_view, attributes=sub.attributes, attribute=sub.attribute
        )
        batch_view = {
            **batch,
            "attrs": {SHARED_ATTRIBUTE: batch["attrs"][sub.attribute]},
        }
        value, terms = sub.loss(view(trainable), view(frozen), batch_view, rng)
        return value, _rename_terms(terms, sub.attribute)

    return loss


def _rename_terms(terms: Mapping[str, Any], attribute: str) -> dict[str, Any]:
    out = {}
    for k, v in terms.items():
        if isinstance(k, str):
            k = k.replace(SHARED_ATTRIBUTE, attribute)
        out[k] = _rename_terms(v, attribute) if isinstance(v, Mapping) else v
    return out


def stored_updates(sub: SubStep) -> tuple[Key, ...]:
    """``sub.updates`` as paths into the stored trainable tree."""
    if sub.attribute is None:
        return sub.updates
    return tuple(
        tuple(sub.attribute if k == SHARED_ATTRIBUTE else k for k in key)
        for key in sub.updates
    )


def jnp_zero_step() -> jax.Array:
    return jnp.zeros((), jnp.int32)
