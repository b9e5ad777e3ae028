"""The diff family: DiffPrun (Guo et al. 2021) and MoDDiffy (Hauzenberger et al. 2023).

* ``diffprun``, ``diffprun_debias``: one sparse task diff on the frozen
  pretrained encoder (the latter trained with every removal term too).
* ``moddiffy_par``: per batch, a task step (core and task head, diffs off),
  then one debias step per attribute (core frozen; that attribute's diff,
  its adversaries and the shared task head trained with the task loss, the
  removal term and the diff's own L0 term).
* ``moddiffy_post``: the core and task head come from a finished finetune
  run (``config.method.core_run``) and stay frozen; one diff per attribute.

Two phases: ``l0`` (dense diffs behind hard-concrete gates; with
``diff.prune_schedule="gradual"`` pruned by magnitude to the budget inside
the phase, :func:`after_step`) and ``fixmask`` (the kept entries only, after
the exact cut of :func:`to_fixmask`). Each diff is exported as its own
SparseDiff file and can be added to the core alone or with others.

``diff.fixmask_state`` says how fixmask holds a cut diff: its kept values
(``frozen["indices"]`` beside them), or its dense form, a DiffState whose
gates are fixed open at the kept entries and shut elsewhere
(:func:`~moddiffy_jax.subnets.dense_diff.fix_gates`). The dense form trains
the same entries with the same gradients, and its step is the L0 phase's
program, which the loop then runs without compiling a second one
(:func:`dense_fixmask`; its "auto" default where nothing compiles ahead).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from moddiffy_jax import parallel
from moddiffy_jax.methods import common, role_partition, standard
from moddiffy_jax.methods.interface import Method, two_phases
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import masks as masks_lib
from moddiffy_jax.subnets import selection

#: ``frozen[JOINT]``: the corrections :func:`finish` fits for compositions
#: with an erased diff (``name -> SparseDiff``, methods/joint_erasure.py).
JOINT = "joint_corrections"


def diff_keys(method: common.MethodDef, attributes: Sequence[str]) -> list[common.Key]:
    keys: list[common.Key] = []
    if method.encoder == "diff":
        keys.append(("task_diff",))
    if method.debias == "modular":
        keys += [("diffs", a) for a in attributes]
    return keys


def diff_name(key: common.Key) -> str:
    return "task" if key == ("task_diff",) else key[-1]


def base_for_diff(ctx, trainable: Mapping, frozen: Mapping, key: common.Key):
    """The params a diff is relative to (its fingerprint goes in the file)."""
    if key != ("task_diff",) and "task_diff" in trainable:
        raise NotImplementedError("attribute diffs on top of a task diff")
    return standard.model(ctx, trainable, frozen)[0]


def to_fixmask(
    ctx, trainable: dict, frozen: dict, next_phase: str = "fixmask"
) -> tuple[dict, dict]:
    """Phase transition: prune every diff to its exact budget.

    Each DiffState becomes the kept values (deterministic gate times delta at
    the kept entries); their indices move to ``frozen["indices"]``. Closed
    gates are never kept, so a diff with fewer open entries than the budget
    keeps exactly its open entries.
    """
    cfg = ctx.config
    include, exclude = standard.diff_rules(cfg)
    new_trainable, new_frozen = dict(trainable), dict(frozen)
    indices: dict[str, Any] = {}
    dense = dense_fixmask(cfg)
    for key in diff_keys(ctx.method, ctx.attributes):
        state = common.get_part(trainable, key)
        values = diffs_lib.dense_diff_values(state, hc=ctx.diff_settings.hc)
        base = base_for_diff(ctx, trainable, frozen, key)
        # Entries closed for good (word_rows, gradual pruning) are never
        # kept: when the budget exceeds the open entries, the cut keeps
        # every open entry and nothing else, so fixmask cannot train them.
        sd = diffs_lib.prune_to_sparsity(
            jax.device_get(values),
            keep=cfg.diff.keep,
            scope=cfg.diff.scope,
            name=diff_name(key),
            base_fingerprint="",
            rules=(include, exclude),
            info={"method": ctx.method.name},
            eligible=jax.device_get(diffs_lib.open_entries(state)),
        )
        if dense:  # every leaf stays, its gates fixed (diff.fixmask_state)
            new_trainable = common.set_part(
                new_trainable, key, _fixed(state, sd.indices, sd.values)
            )
            continue
        new_trainable, indices = _set_sparse(
            new_trainable, indices, key, sd.indices, sd.values
        )
        del base
    if not dense:
        new_frozen["indices"] = indices
    return new_trainable, new_frozen


def _set_sparse(trainable, indices, key, idx: Mapping, vals: Mapping):
    """``(trainable, indices)`` with the diff at ``key`` in the sparse form:
    its kept values, their flat indices (per leaf path) in ``indices``.
    Leaves with no kept entry are left out of the trained state (Orbax
    cannot store empty arrays); exports restore them from the rules."""
    kept = [p for p in idx if np.size(idx[p])]
    trainable = common.set_part(
        trainable, key, selection.unflatten({p: vals[p] for p in kept})
    )
    indices = common.set_part(
        indices, key, selection.unflatten({p: idx[p] for p in kept})
    )
    return trainable, indices


def _fixed(state, indices: Mapping[str, Any], values: Mapping[str, Any]):
    """``state`` in the dense form of the cut: the kept entries (flat
    ``indices`` per leaf path) hold ``values``, every gate fixed."""
    state = jax.device_get(state)
    flat_delta = selection.flatten(state.delta)
    kept, vals = {}, {}
    for p, d in flat_delta.items():
        mask = np.zeros(np.size(d), bool)
        full = np.zeros(np.size(d), np.asarray(d).dtype)
        idx = np.asarray(indices.get(p, np.zeros(0, np.int64)))
        mask[idx] = True
        full[idx] = np.asarray(values.get(p, np.zeros(0)))
        kept[p], vals[p] = mask.reshape(np.shape(d)), full.reshape(np.shape(d))
    return diffs_lib.fix_gates(
        state, selection.unflatten(kept), selection.unflatten(vals)
    )


def dense_fixmask(config) -> bool:
    """``config.diff.fixmask_state``, checked: whether the fixmask phase keeps
    each diff dense with its gates fixed (the L0 phase's program, so the
    loop compiles one step for both phases) instead of its kept values.

    "auto" is dense where the next phase is not compiled ahead
    (``train.compile_ahead``: a CPU backend), and sparse where it is or where
    a setting reads the fixmask state's kept values (``train.select``
    ``best_dev``, ``train.average_from``, a structured diff, a frozen core in
    fixmask, word rows under their own optimizer settings)."""
    d = config.get("diff")
    mode = d.get("fixmask_state", "auto") if d is not None else "sparse"
    if mode not in FIXMASK_STATES:
        raise ValueError(
            f"config.diff.fixmask_state={mode!r}; use one of {list(FIXMASK_STATES)} "
            '("dense": the cut diffs keep their shapes with fixed gates, one '
            'compiled step for both phases; "sparse": the kept values only).'
        )
    if mode == "sparse":
        return False
    optim = config.get("optim", {})
    reads_values = {
        "train.select": config.train.get("select", "last") != "last",
        "train.average_from": float(config.train.get("average_from", -1)) >= 0,
        "diff.structured": bool(d.get("structured", False)),
        "diff.freeze_core_in_fixmask": bool(d.get("freeze_core_in_fixmask", False)),
        "optim.diff_words_lr_scale": float(optim.get("diff_words_lr_scale", 1.0))
        != 1.0,
        "optim.diff_words_normalizer": optim.get("diff_words_normalizer", "entry")
        != "entry",
    }
    blocking = [k for k, v in reads_values.items() if v]
    if mode == "dense":
        if blocking:
            raise ValueError(
                f"config.diff.fixmask_state='dense' cannot hold with {blocking} "
                "(they read the fixmask phase's kept values): set "
                "diff.fixmask_state to 'sparse' or 'auto'."
            )
        return True
    if blocking:
        return False
    ahead = config.train.get("compile_ahead", "auto")
    return ahead == "off" or (ahead == "auto" and jax.default_backend() == "cpu")


#: ``config.diff.fixmask_state`` values (:func:`dense_fixmask`).
FIXMASK_STATES = ("auto", "dense", "sparse")


def sparse_diffs_of(
    ctx, trainable: Mapping, frozen: Mapping, phase: str
) -> dict[str, diffs_lib.SparseDiff]:
    """The current diffs as SparseDiffs, each with its base's fingerprint.

    In the ``l0`` phase: the nonzeros of the deterministic-gate diff; in
    ``fixmask``: the kept entries and their trained values.
    """
    include, exclude = standard.diff_rules(ctx.config)
    info = {"method": ctx.method.name, "keep": ctx.config.diff.keep}
    out = {}
    for key in diff_keys(ctx.method, ctx.attributes):
        base = base_for_diff(ctx, trainable, frozen, key)
        fp = diffs_lib.fingerprint(base)
        part = common.get_part(trainable, key)
        if phase == "l0":
            dense = diffs_lib.dense_diff_values(part, hc=ctx.diff_settings.hc)
            out[diff_name(key)] = diffs_lib.SparseDiff.from_dense(
                jax.device_get(dense),
                name=diff_name(key),
                base_fingerprint=fp,
                rules=(include, exclude),
                info={**info, "phase": "l0"},
            )
            continue
        # fixmask: exactly the kept entries (some may be zero), in leaf order.
        if isinstance(part, diffs_lib.DiffState):  # its dense form
            idx, vals = _kept_values(part)
        else:
            idx = selection.flatten(
                jax.device_get(common.get_part(frozen["indices"], key))
            )
            vals = selection.flatten(jax.device_get(part))
        flat_base = selection.flatten(base)
        paths = selection.select_paths(base, include, exclude=exclude)
        dtype = np.asarray(next(iter(vals.values()))).dtype
        empty_i, empty_v = np.zeros(0, np.int32), np.zeros(0, dtype)
        out[diff_name(key)] = diffs_lib.SparseDiff(
            indices={p: np.asarray(idx.get(p, empty_i), np.int32) for p in paths},
            values={p: np.asarray(vals.get(p, empty_v)) for p in paths},
            shapes=tuple((p, tuple(np.shape(flat_base[p]))) for p in paths),
            dtype=str(dtype),
            name=diff_name(key),
            base_fingerprint=fp,
            rules=(include, exclude),
            info_json=json.dumps({**info, "phase": "fixmask"}, sort_keys=True),
        )
    return out


def _kept_values(state) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The flat kept indices and their values, per leaf path, of a diff in
    the dense form of the cut (:func:`to_fixmask`; ascending indices)."""
    state = jax.device_get(state)
    kept = selection.flatten(diffs_lib.fixed_kept(state))
    delta = selection.flatten(state.delta)
    idx = {p: np.flatnonzero(np.asarray(k)).astype(np.int32) for p, k in kept.items()}
    return idx, {p: np.asarray(delta[p]).reshape(-1)[i] for p, i in idx.items()}


def sparse_form(ctx, trainable: dict, frozen: dict) -> tuple[dict, dict]:
    """``(trainable, frozen)`` of the fixmask phase in its sparse form: each
    diff cut to its dense form (:func:`dense_fixmask`) becomes its kept values
    with their indices in ``frozen["indices"]``; the numbers are the same."""
    indices = dict(frozen.get("indices", {}))
    changed = False
    for key in diff_keys(ctx.method, ctx.attributes):
        part = common.get_part(trainable, key)
        if not isinstance(part, diffs_lib.DiffState):
            continue
        trainable, indices = _set_sparse(trainable, indices, key, *_kept_values(part))
        changed = True
    if not changed:
        return trainable, frozen
    return trainable, {**frozen, "indices": indices}


def gradual_keep(config, phase_step: int, n_steps: int) -> float | None:
    """The kept fraction to prune to after L0 step ``phase_step``, or None.

    Gradual pruning (Zhu & Gupta 2018) inside the L0 phase: every
    ``diff.prune_every`` steps between ``prune_start`` and ``prune_end``
    (fractions of the phase) the diffs are pruned by magnitude to a kept
    fraction that falls cubically from 1 to ``diff.keep``, so the diff adapts
    to each cut and the final exact cut removes nothing the removal relied on.
    """
    d = config.diff  # keep is a fraction here: context.check_prune_config
    if not _is_cut(config, phase_step, n_steps):
        return None
    begin, end = d.prune_start * n_steps, d.prune_end * n_steps
    schedule = masks_lib.cubic_sparsity_schedule(
        initial=0.0, final=1.0 - d.keep, begin_step=begin, end_step=end
    )
    return 1.0 - float(schedule(phase_step))


def next_shapes_settled(config, phase: str, phase_step: int, n_steps: int) -> bool:
    """True from the L0 phase's last gradual cut on: the open entries are then
    the budget, so the exact cut at the phase's end keeps exactly them and
    fixmask's shapes are known (the loop compiles its step ahead)."""
    if phase != "l0" or config.diff.prune_schedule != "gradual":
        return False
    if dense_fixmask(config):  # fixmask runs the L0 phase's program
        return False
    cuts = [s for s in range(1, n_steps + 1) if _is_cut(config, s, n_steps)]
    return bool(cuts) and phase_step >= cuts[-1]


def _is_cut(config, phase_step: int, n_steps: int) -> bool:
    """Whether gradual pruning cuts after L0 step ``phase_step``: every
    ``prune_every`` steps from ``prune_start`` of the phase through the
    first cut at or past ``prune_end``."""
    d = config.diff
    begin, end = d.prune_start * n_steps, d.prune_end * n_steps
    return not phase_step % d.prune_every and begin < phase_step < end + d.prune_every


def adam_second_moment(opt_state: Any, key: common.Key) -> Any:
    """Adam's ``nu`` for the delta of the diff at ``key`` in a sub-step's state
    (a :class:`role_partition.RolePartitionState` inside it: the "diff" role's
    entries and those of roles derived from it, which have their own AdamW)."""
    prefix = selection.PATH_SEP.join((*key, "delta"))

    def moments(role_state):  # the element of a role's chain that has ``nu``
        parts = role_state if isinstance(role_state, tuple) else (role_state,)
        return next((p for p in (role_state, *parts) if hasattr(p, "nu")), None)

    stack = [opt_state]
    while stack:
        node = stack.pop()
        if isinstance(node, role_partition.RolePartitionState):
            inner = node.inner_states
            adam = moments(inner["diff"]) if "diff" in inner else None
            if adam is not None:  # not a schedule's partition, say
                flat = dict(adam.nu)
                for role in common.DERIVED_ROLES:
                    own = moments(inner[role]) if role in inner else None
                    flat.update(own.nu if own is not None else {})
                return role_partition.under(flat, prefix)
        elif isinstance(node, tuple):  # chains, optax.MultiSteps' state
            stack.extend(node)
    raise ValueError("No Adam state for the 'diff' role in the optimizer state.")


def close_diff_gates(
    ctx, trainable: dict, keep: float, opt_states: Mapping[str, Any]
) -> dict:
    """Closes each diff's gates outside its top ``keep`` fraction.

    ``diff.prune_score``: ``magnitude`` ranks ``|z * delta|``; ``taylor`` ranks
    ``|z * delta| * sqrt(nu)`` with ``nu`` Adam's running mean of the squared
    gradient, a first-order estimate of how much the objective would change
    if the entry were removed (Adam moves every entry with a consistent
    gradient sign at about the learning rate, so magnitude alone says little
    about importance).

    The scores are computed where the diffs live; only they and the open
    entries come to the host, for the exact top-k, and only the diffs' own
    leaves change (the core and the optimizer states are not copied).
    """
    for key in diff_keys(ctx.method, ctx.attributes):
        state = common.get_part(trainable, key)
        values = diffs_lib.dense_diff_values(state, hc=ctx.diff_settings.hc)
        if ctx.config.diff.prune_score == "taylor":
            sub = "task" if key == ("task_diff",) else f"debias/{key[-1]}"
            nu = adam_second_moment(opt_states[sub], key)
            values = jax.tree.map(lambda v, n: v * jnp.sqrt(n), values, nu)
        mask = diffs_lib.magnitude_keep_mask(
            jax.device_get(values),
            keep=keep,
            scope=ctx.config.diff.scope,
            eligible=jax.device_get(diffs_lib.open_entries(state)),
        )
        trainable = common.set_part(trainable, key, diffs_lib.close_gates(state, mask))
    return trainable


def values_like(trainable: dict, indices: Mapping, ctx) -> dict:
    """Zero values shaped like the restored indices (targets for restoring)."""
    for key in diff_keys(ctx.method, ctx.attributes):
        idx = common.get_part(indices, key)
        part = common.get_part(trainable, key)
        dtype = jax.tree.leaves(part.delta)[0].dtype  # a DiffState before restore
        trainable = common.set_part(
            trainable, key, jax.tree.map(lambda i, d=dtype: jnp.zeros(i.shape, d), idx)
        )
    return trainable


def after_step(
    ctx, state: common.TrainState, phase: str, phase_step: int, n_steps: int
):
    """Gradual pruning inside the L0 phase (``diff.prune_schedule="gradual"``)."""
    if phase != "l0" or ctx.config.diff.prune_schedule != "gradual":
        return state, None
    keep = gradual_keep(ctx.config, phase_step, n_steps)
    if keep is None:
        return state, None
    trainable = close_diff_gates(ctx, state.trainable, keep, state.opt_states)
    for key in diff_keys(ctx.method, ctx.attributes):  # the leaves that changed
        part = parallel.replicate(common.get_part(trainable, key), ctx.mesh)
        trainable = common.set_part(trainable, key, part)
    return state.replace(trainable=trainable), {"diff/keep": keep}


def checkpoint_extra(frozen: Mapping[str, Any]) -> Any:
    """The kept indices (fixmask), saved beside the Orbax state."""
    return frozen.get("indices", {})


def restore(ctx, trainable: dict, frozen: dict, phase: str, extra: Any):
    """In fixmask the kept indices come from the checkpoint, and the values'
    shapes follow them; a checkpoint of the dense form has none (its diffs
    have the shapes of the L0 phase's)."""
    if phase != "fixmask" or not jax.tree.leaves(extra):
        return trainable, frozen
    frozen = {**frozen, "indices": jax.tree.map(jnp.asarray, extra)}
    return values_like(trainable, frozen["indices"], ctx), frozen


def diff_config() -> ml_collections.ConfigDict:
    """``config.diff``: which parameters get a diff, its hard-concrete gates,
    L0 weight, budget and pruning schedule (only the diff family reads it)."""
    d = ml_collections.ConfigDict()
    d.include = (r".*",)
    # The pooler is unused (the representation is the CLS token); the
    # reference gave it a diff anyway, which only inflated the top-k budget.
    d.exclude = (r"pooler/.*",)
    d.structured = False
    d.straight_through = True
    d.left = -1.5
    d.right = 1.5
    d.temperature = 1.0
    d.init_log_alpha = 5.0
    d.l0_weight = 1.25e-7
    d.keep = 0.01  # fraction (float) or count (int) of kept entries.
    d.scope = "global"
    # "final": one magnitude cut to the budget at the end of the L0 phase
    # (the paper); "gradual": cubic magnitude pruning from 1 to diff.keep
    # every prune_every L0 steps between prune_start and prune_end (fractions
    # of the L0 phase), so the diff adapts to each cut.
    d.prune_schedule = "gradual"  # "final": the paper's one cut
    d.prune_score = "magnitude"  # or "taylor": |z * delta| * sqrt(Adam nu).
    d.prune_every = 10
    # Early cuts: a dense diff under the removal terms breaks the task until
    # it is thinned (docs/efficacy.md, "Stop 13"); cutting from 5% to 40%
    # of the L0 phase leaves the rest of it, and fixmask, at the budget.
    d.prune_start = 0.05
    d.prune_end = 0.4
    # MoDDiffy-par: the core (and the task head's task step) stops training
    # at the end of the L0 phase, so the diffs spend fixmask on the core
    # they are exported with instead of one that keeps moving under them.
    # False: the paper's loop, the core trains in both phases.
    d.freeze_core_in_fixmask = False
    # The fixmask phase's state: "sparse" (each diff's kept values; the
    # smaller, faster step), "dense" (each diff keeps its shapes with every
    # gate fixed, kept open and the rest shut: the L0 phase's program, so a
    # run compiles one train step, not two; the same numbers to rounding) or
    # "auto" (dense where the next phase is not compiled ahead, i.e. on a CPU
    # backend, unless a setting reads the kept values; moddiffy.dense_fixmask).
    d.fixmask_state = "auto"
    # > 0: each attribute's diff may change only the word-embedding rows of
    # at most this many tokens, those whose presence tells most about the
    # attribute beyond the task label on the training split (each scoring at
    # least word_rows_share times the best; methods/word_rows.py); the rest
    # of the word table stays closed. 0: every row, as the paper.
    d.word_rows = 0
    d.word_rows_share = 0.1
    # > 0: in each debias step every other attribute's diff is added to the
    # core with this probability (no gradient into it), so each diff learns
    # a removal that holds when the diffs are composed. 0: each diff sees
    # only the core, as the paper.
    d.compose_prob = 0.0
    # Closed-form erasure (methods/erasure_refit.py): when training ends,
    # ``erasure_share`` of an attribute diff's budget is given to a
    # LEACE-style eraser of its attribute written into the last layer's FFN
    # output (the rest of the diff trimmed by magnitude, so the budget stays
    # exact). ``erasure``: "auto" (the diffs trained without counterfactual
    # swaps: on dwmw17 it adds 5-9 points of removal to the MMD recipe's;
    # on swap diffs it overshoots the floor and costs task, measured at
    # stop 55), "on" (every attribute diff) or "off". ``erasure_ridge``:
    # the within-class covariance's ridge (share of its mean variance);
    # ``erasure_examples``: training rows the fit reads at most (a seeded
    # sample beyond).
    d.erasure = "auto"
    d.erasure_share = 0.5
    d.erasure_ridge = 1e-3
    d.erasure_examples = 20000
    # Fits of each eraser in its rows, each on the model the previous ones
    # erased (LayerNorm's renormalisation leaves part of the attribute).
    d.erasure_rounds = 1
    # Two or more diffs, one of them or more erased: their erasers fitted
    # again on each composition and stored as a correction beside them
    # (methods/joint_erasure.py; export/joint/<a>+<b>.safetensors).
    d.erasure_joint = True
    return d


def finish(ctx, trainable: dict, frozen: dict, phase: str):
    """At the end of training: each attribute diff with its closed-form
    eraser folded in (``diff.erasure_share > 0``;
    :mod:`moddiffy_jax.methods.erasure_refit`), and a record per attribute.
    A host-side function of the final state and the training split, so a
    resumed run refits to the same diff."""
    if phase == "fixmask":  # what follows reads the kept values
        trainable, frozen = sparse_form(ctx, trainable, frozen)
    share = ctx.config.diff.get("erasure_share", 0.0)
    mode = ctx.config.diff.get("erasure", "off")
    keys = [k for k in diff_keys(ctx.method, ctx.attributes) if k[0] == "diffs"]
    if not share or mode == "off" or not keys or phase != "fixmask":
        return trainable, frozen, None
    from moddiffy_jax.eval.evaluator import Evaluator
    from moddiffy_jax.methods import erasure_refit

    d = ctx.config.diff
    settings = erasure_refit.Settings(
        share=float(share),
        ridge=float(d.get("erasure_ridge", 1e-3)),
        examples=int(d.get("erasure_examples", 20000)),
        seed=int(ctx.config.seed),
        rounds=int(d.get("erasure_rounds", 1)),
    )
    evaluator = Evaluator(ctx)
    sparse = sparse_diffs_of(ctx, trainable, frozen, phase)
    record, refits = {}, {}
    indices = frozen["indices"]
    for key in keys:
        paths = {p for p, _ in sparse[diff_name(key)].shapes}
        why = erasure_refit.problem(ctx.model, paths, d.get("word_rows", 0))
        if d.get("scope", "global") != "global" or d.structured:
            why = "a per-leaf or structured budget cannot hold whole rows"
        if mode == "auto" and _uses_swaps(ctx, key[-1]):
            why = "trained with counterfactual swaps"
        if why:  # only 'auto' gets here: 'on' was checked at start-up
            record[key[-1]] = {"skipped": f"{why} (diff.erasure='auto')"}
            continue
        core = base_for_diff(ctx, trainable, frozen, key)
        done = erasure_refit.refit(
            ctx,
            core,
            sparse[diff_name(key)],
            key[-1],
            settings,
            compose=lambda c, s: evaluator.compose(c, [s]),
            forward=evaluator.forward,
        )
        record[key[-1]], refits[key[-1]] = done.record, done
        sd = done.diff
        trainable, indices = _set_sparse(trainable, indices, key, sd.indices, sd.values)
    frozen = {**frozen, "indices": indices}
    if d.get("erasure_joint", False) and refits:
        from moddiffy_jax.methods import joint_erasure

        # Every erased diff shares the core (MoDDiffy-par, -post). A set
        # with one erased diff and others left as trained (swap diffs in a
        # mixed auto run) needs its eraser fitted on the composition too.
        core = base_for_diff(ctx, trainable, frozen, keys[0])
        plain = {k[-1]: sparse[diff_name(k)] for k in keys if k[-1] not in refits}
        corrections = {}
        for subset in joint_erasure.subsets([k[-1] for k in keys]):
            if not refits.keys() & set(subset):
                continue
            name = joint_erasure.joint_name(subset)
            corrections[name], record[name] = joint_erasure.correction(
                ctx,
                core,
                refits,
                subset,
                settings,
                compose=evaluator.compose,
                forward=evaluator.forward,
                plain=plain,
            )
        frozen[JOINT] = corrections
    return trainable, frozen, record


def exports(
    ctx, trainable: Mapping, frozen: Mapping, phase: str
) -> dict[str, diffs_lib.SparseDiff]:
    """The diffs (:func:`sparse_diffs_of`) and, once :func:`finish` has fit
    them, the corrections of their compositions (``gender+age``)."""
    return {**sparse_diffs_of(ctx, trainable, frozen, phase), **frozen.get(JOINT, {})}


def _uses_swaps(ctx, attribute: str) -> bool:
    """Whether ``attribute``'s diff was trained with counterfactual swaps."""
    from moddiffy_jax.methods import attribute_weights

    if ctx.debias is None:
        return False
    return attribute_weights.for_attribute(ctx.debias, attribute).swap_weight > 0.0


def substeps(ctx, phase: str, trainable: dict) -> list[common.SubStep]:
    """The standard sub-steps; in fixmask without the task sub-step when
    ``diff.freeze_core_in_fixmask`` (MoDDiffy-par; context.check_frozen_core)."""
    subs = standard.substeps(ctx, phase, trainable)
    if phase == "fixmask" and ctx.config.diff.get("freeze_core_in_fixmask", False):
        subs = [s for s in subs if s.name != "task"]
    return subs


def _family(name: str, encoder: str, debias: str, description: str) -> Method:
    return standard.method(
        name,
        encoder,
        debias,
        description,
        phases_of=two_phases,
        substeps=substeps,
        after_step=after_step,
        transition=to_fixmask,
        finish=finish,
        next_shapes_settled=next_shapes_settled,
        checkpoint_extra=checkpoint_extra,
        restore=restore,
        exports=exports,
        config_sections=lambda: {"diff": diff_config()},
    )


DIFFPRUN = _family(
    "diffprun",
    "diff",
    "none",
    "A sparse task diff on the frozen pretrained encoder.",
)
DIFFPRUN_DEBIAS = _family(
    "diffprun_debias",
    "diff",
    "joint",
    "A sparse task diff trained with the task and every removal term.",
)
MODDIFFY_PAR = _family(
    "moddiffy_par",
    "full",
    "modular",
    "Core fine-tuned and attribute diffs trained in the same loop.",
)
MODDIFFY_POST = _family(
    "moddiffy_post",
    "frozen",
    "modular",
    "Attribute diffs on a frozen core from a finetune run.",
)
METHODS = (DIFFPRUN, DIFFPRUN_DEBIAS, MODDIFFY_PAR, MODDIFFY_POST)
