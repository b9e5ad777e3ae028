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
otherwise) each get their own jitted step (one program where they lower alike,
``diff.fixmask_state``); the transition is a host-side pure function."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moddiffy_jax import objectives
from moddiffy_jax.methods import attribute_weights, removal, swap_reread, table_adam
from moddiffy_jax.methods.conditioning import conditioning_labels, teacher_passes

# Diff parts and their settings live in diff_parts.py; importable here too.
from moddiffy_jax.methods.diff_parts import (
    DiffSettings,
    add_sparse,  # noqa: F401
    apply_diff_part,
    is_dense,
    others_present,
    with_other_diffs,
)
from moddiffy_jax.methods.role_partition import role_partition

# The step machinery lives in steps.py; these names stay importable here.
from moddiffy_jax.methods.steps import (
    SHARED_ATTRIBUTE,  # noqa: F401
    Key,  # noqa: F401
    SubStep,
    TrainState,  # noqa: F401
    attribute_unview,  # noqa: F401
    attribute_view,  # noqa: F401
    compile_train_step,  # noqa: F401
    drop_parts,  # noqa: F401
    gather_parts,  # noqa: F401
    get_part,  # noqa: F401
    init_opt_states,  # noqa: F401
    jnp_zero_step,  # noqa: F401
    make_train_step,  # noqa: F401
    scatter_parts,  # noqa: F401
    set_part,  # noqa: F401
    stored_loss,  # noqa: F401
    stored_updates,  # noqa: F401
)
from moddiffy_jax.methods.terms import (
    STATE_KEY,
    STEP_KEY,
    merge_terms,
    total,
)
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import masks as masks_lib
from moddiffy_jax.subnets import selection

PyTree = Any

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


# Optimizers: per-role learning rates (role_partition.py). Roles by path
# inside the trained parts, first match wins; the optimizer config gives each
# role a learning rate and a weight decay.
ROLE_RULES: tuple[tuple[str, str], ...] = (
    (r"core/.*", "encoder"),
    (r"adapters/.*", "adapter"),
    (r"(task_diff|diffs/[^/]+)/(log_alpha|group_log_alpha)(/.*)?", "log_alpha"),
    (r"(task_diff|diffs/[^/]+)/(delta/)?embeddings/word_embeddings/.*", "diff_words"),
    (r"(task_diff|diffs/[^/]+)/.*", "diff"),
    (r"task_head/.*", "heads"),
    (r"adversaries/[^/]+/.*", "adversary"),
    (r"scores/.*", "scores"),
)
ROLES = ("encoder", "adapter", "log_alpha", "diff", "heads", "adversary", "scores")
# A diff's word-embedding rows: the ``diff`` role's AdamW at ``lr_diff`` times
# ``optim.diff_words_lr_scale`` (default 1: the same update as every entry).
DERIVED_ROLES = {"diff_words": ("diff", "diff_words_lr_scale")}
# ``optim.diff_words_normalizer``: "entry" (AdamW: each entry divided by its
# own root second moment) or "table" (one divisor for the whole table, so
# rows move in proportion to their gradient: methods/table_adam.py).
WORD_NORMALIZERS = ("entry", "table")


def role_labels(parts: PyTree, *, derived: bool = False) -> PyTree:
    """Role label of every leaf of ``parts`` from :data:`ROLE_RULES`
    (:data:`DERIVED_ROLES` only with ``derived``; else their parent's)."""
    paths = selection.tree_paths(parts)
    candidates = [
        (rule, role)
        for rule, role in ROLE_RULES
        if derived or role not in DERIVED_ROLES
    ]
    # Only the rules that are some path's first match: a diff confined to its
    # word table (diff.include) leaves the plain "diff" rule nothing to take.
    first = {
        next((i for i, (rule, _) in enumerate(candidates) if re.fullmatch(rule, p)), -1)
        for p in paths
    }
    rules = [r for i, r in enumerate(candidates) if i in first]
    return selection.assign_roles(parts, rules)


def derived_lr_scale(optim: Mapping[str, Any], role: str) -> float:
    """The learning-rate factor of a :data:`DERIVED_ROLES` role over its
    parent's; a ValueError naming the field unless it is > 0."""
    parent, key = DERIVED_ROLES[role]
    scale = float(optim.get(key, 1.0))
    if not scale > 0.0:
        raise ValueError(
            f"config.optim.{key}={scale}: it must be > 0 (1 gives these entries "
            f"the lr_{parent} of every other entry)."
        )
    return scale


def word_normalizer(optim: Mapping[str, Any]) -> str:
    """``optim.diff_words_normalizer`` (default "entry"); a ValueError
    naming the choices otherwise."""
    name = optim.get("diff_words_normalizer", "entry")
    if name not in WORD_NORMALIZERS:
        raise ValueError(
            f"config.optim.diff_words_normalizer={name!r}; use one of "
            f"{list(WORD_NORMALIZERS)} (entry: AdamW on every entry; table: "
            "one step divisor per word table, rows move with their gradient)."
        )
    return name


def make_optimizer(optim: Mapping[str, Any]) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with a learning rate per role.

    Args:
      optim: the ``config.optim`` mapping with ``lr_<role>``, ``wd_<role>``
        for every role in :data:`ROLES`, ``clip_norm`` (<= 0 disables), and
        ``b1``, ``b2``, ``eps``; optionally ``diff_words_lr_scale`` (a
        diff's word-embedding rows, :data:`DERIVED_ROLES`) and
        ``diff_words_normalizer`` (:data:`WORD_NORMALIZERS`).

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
    derived = False
    table = word_normalizer(optim) == "table"
    for role, (parent, _) in DERIVED_ROLES.items():
        scale = derived_lr_scale(optim, role)
        if scale == 1.0 and not table:  # the parent's update: the old layout
            continue
        derived = True
        transforms[role] = (table_adam.table_adamw if table else optax.adamw)(
            optim[f"lr_{parent}"] * scale,
            b1=optim["b1"],
            b2=optim["b2"],
            eps=optim["eps"],
            weight_decay=optim[f"wd_{parent}"],
        )
    labels = functools.partial(role_labels, derived=derived)
    chain = [role_partition(transforms, labels)]
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
    for role in DERIVED_ROLES:
        derived_lr_scale(optim, role)
    word_normalizer(optim)
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
    # Derived roles (:data:`DERIVED_ROLES`) are scheduled as their parents.
    scaled = {role: optax.scale_by_schedule(factor) for role in ROLES}
    scaled.update({role: optax.identity() for role in UNSCHEDULED_ROLES})
    out, made = [], {}
    for sub in substeps:
        # One transformation per original one: shared sub-steps stay shared.
        opt = made.get(id(sub.optimizer))
        if opt is None:
            opt = optax.chain(sub.optimizer, role_partition(scaled, role_labels))
            if k > 1:
                opt = optax.MultiSteps(opt, every_k_schedule=k)
            made[id(sub.optimizer)] = opt
        out.append(dataclasses.replace(sub, optimizer=opt))
    return out


# Encoder parameters of a configuration.


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

    Returns ``(h, logits, terms, rng_for_removal, task_of, represent,
    decision)``: ``terms = {"task": loss}``, ``task_of(h)`` the task term as a
    function of the representations (the same head, dropout and labels),
    ``represent(other_batch, read)`` another batch's representations (and
    with ``read`` the head's logits) under the same params and dropout, and
    ``decision(h)`` each row's directions that move the head's decision
    ([B, C - 1, H]: the logit differences' gradients, eval mode, no gradient)."""
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

    def task_of(reps):
        return task_loss_value(
            task_loss, model.task_logits(head, reps, r_head, True), batch
        )

    def represent(other, read=False):  # read: with the head's logits on them
        reps = model.represent(params, other, r_enc, True)
        return (reps, model.task_logits(head, reps, r_head, True)) if read else reps

    def decision(reps):
        def margins(row):  # logit differences against the first class
            out = model.task_logits(head, row[None], None, False)[0]
            return (out[1:] - out[0]).astype(jnp.float32)

        reps = jax.lax.stop_gradient(reps)
        return jax.lax.stop_gradient(jax.vmap(jax.jacrev(margins))(reps))

    return h, logits, terms, r_adv, task_of, represent, decision


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
        h, logits, terms, r_adv, task_of, _, _ = _task_forward(
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
            cond = conditioning_labels(debias, batch, logits, core=None)
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
                    task=cond,
                )
                removed = removal.warmed_up(removed, batch.get(STEP_KEY), debias)
                merge_terms(terms, removed)
        if method.encoder == "diff" and is_dense(phase, trainable["task_diff"]):
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
        step=batch.get(STEP_KEY),
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
    others: Sequence[str] = (),
    others_prob: float = 0.0,
    swap_table: np.ndarray | None = None,
    other_swap_tables: Mapping[str, np.ndarray] | None = None,
) -> Callable:
    """Loss of attribute ``attribute``'s modular debias step.

    task CE through the (shared) task head + the removal term + L0 of this
    attribute's diff only (the reference always penalised diff 0; spec §4.2).
    With ``others`` and ``others_prob > 0`` the forward adds each other
    attribute's diff with that probability (:func:`with_other_diffs`).
    With ``swap_table`` ([vocab] token permutation) and
    ``debias.swap_weight > 0`` the batch is encoded again with its tokens
    swapped and the term ``swap/<attribute>`` pulls each changed example's
    two representations together (objectives/counterfactual.py); with
    ``other_swap_tables`` (``swap_compose``) the twin also swaps the words of
    each other attribute whose diff the step added, so this diff learns not
    to give back what theirs removed.
    """
    swap = None
    own = attribute_weights.for_attribute(debias, attribute)
    swap_weight = own.swap_weight
    if swap_table is not None and swap_weight > 0.0:
        swap = jnp.asarray(np.asarray(swap_table, np.int32))
    other_swaps = {
        o: jnp.asarray(np.asarray(t, np.int32))
        for o, t in (other_swap_tables or {}).items()
        if o in others and others_prob > 0.0
    }

    def loss(trainable, frozen, batch, rng):
        seen, seen_frozen, present = trainable, frozen, {}
        if others and others_prob > 0.0:
            rng, r_others = jax.random.split(rng)
            present = others_present(others, others_prob, r_others)
            seen, seen_frozen = with_other_diffs(
                method,
                trainable,
                frozen,
                others,
                others_prob,
                r_others,
                phase=phase,
                settings=diff_settings,
                present=present,
            )
        h, logits, terms, r_adv, task_of, represent, decision = _task_forward(
            model,
            method,
            seen,
            seen_frozen,
            batch,
            rng,
            phase=phase,
            settings=diff_settings,
            attribute=attribute,
            task_loss=task_loss,
        )
        # The core's task log-probabilities (no gradient) for the distill and
        # decision conditioning; "added_to": with the diffs this step added.
        added_to = debias.keep_from == "added_to"
        teacher = (seen, seen_frozen) if added_to else (trainable, frozen)
        core_prediction = functools.partial(
            _core_prediction,
            model,
            method,
            *teacher,
            batch=batch,
            phase=phase,
            settings=diff_settings,
        )
        swapped = None  # the twin: the attribute's counterpart tokens swapped
        if swap is not None:  # (the step's own tables where it has them)
            ids, inputs = batch["input_ids"], frozen.get("swap_tables", {})
            swapped = inputs.get(attribute, swap)[ids]
            for other, table in other_swaps.items():
                table = inputs.get(other, table)
                swapped = jnp.where(present[other], table[swapped], swapped)
        pivotal = swapped is not None and own.swap_keep_pivotal
        core_on_batch, core_on_twin = teacher_passes(  # one pass per trace
            core_prediction, batch, swapped if pivotal else None
        )

        def distill(weight, teacher=core_on_batch, rows=None):  # the mean KL
            rows = jnp.ones(logits.shape[:1], bool) if rows is None else rows
            return weight * objectives.kl_where(teacher(), logits, rows)

        if own.task_distill > 0.0:
            terms["distill"] = distill(own.task_distill)
        if own.task_target == "core_decision":  # not the gold labels
            labels = jnp.argmax(core_on_batch(), -1).astype(batch["task"].dtype)
            terms["task"] = task_loss_value(task_loss, logits, dict(batch, task=labels))
        # 1 once methods/swap_reread.py switched the attribute to keeping the
        # core's decision (swap_reread_mode "decision"; the core runs then,
        # uncached: a value cached in the branch's trace would leak).
        switched = frozen.get(swap_reread.KEEP_KEY, {}).get(attribute)
        if switched is not None and own.swap_keep_distill > 0.0:
            terms["distill_kept"] = jax.lax.cond(
                switched > 0.0,
                lambda: distill(own.swap_keep_distill, core_prediction),
                lambda: jnp.zeros((), jnp.float32),
            )
        anchor = None
        if own.target_weight > 0.0:
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
        h_removal = h
        if debias.task_projection:
            # Each row's task gradient (no second-order path into the head).
            toward = jax.grad(task_of)(jax.lax.stop_gradient(h))
            h_removal = objectives.task_projected(h, jax.lax.stop_gradient(toward))
        removed = removal.debias_term(
            model,
            trainable,
            h_removal,
            batch["attrs"][attribute],
            attribute,
            settings=debias,
            rng=r_adv,
            train=True,
            task=conditioning_labels(debias, batch, logits, core=core_on_batch),
            anchor=anchor,
        )
        if swapped is not None:  # the twin under the same params and dropout
            h_swapped, twin_logits = represent({**batch, "input_ids": swapped}, True)
            if not debias.swap_twin_gradient:
                h_swapped = jax.lax.stop_gradient(h_swapped)
            changed = jnp.any(swapped != ids, axis=-1)
            if own.swap_distill > 0.0:  # the core's decision where no word swaps
                terms["distill_unswapped"] = distill(own.swap_distill, rows=~changed)
            keep = decision(h) if own.swap_keep_task else None
            if pivotal:  # where the swap moves it, or switched
                moved = objectives.decision_moved(core_on_batch(), core_on_twin())
                if own.swap_distill_pivotal > 0.0:  # kept there, on both twins
                    kl = objectives.kl_where(core_on_twin(), twin_logits, moved > 0.0)
                    kl = kl + objectives.kl_where(core_on_batch(), logits, moved > 0.0)
                    terms["distill_pivotal"] = own.swap_distill_pivotal * kl
                moved = jnp.maximum(moved, 0.0 if switched is None else switched)
                keep = decision(h) * moved[:, None, None]
            if keep is None and switched is not None:  # 0: no direction kept
                keep = decision(h) * switched
            value = objectives.swap_invariance_loss(h, h_swapped, changed, keep)
            # swap_reread_mode "weight": the read's scale (1 before it).
            scale = frozen.get(swap_reread.SCALE_KEY, {}).get(attribute, 1.0)
            removed[f"swap/{attribute}"] = swap_weight * scale * value
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
        if is_dense(phase, trainable["diffs"][attribute]):
            penalty = diffs_lib.l0_penalty(
                trainable["diffs"][attribute], hc=diff_settings.hc
            )
            terms[f"l0/{attribute}"] = diff_settings.l0_weight * penalty
        return total(terms), terms

    return loss
