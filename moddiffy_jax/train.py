"""The generic training loop: phases, jitted steps, evaluation, checkpoints.

``train_and_evaluate(config, workdir)`` runs any method of
``moddiffy_jax.methods`` from a config (see ``configs/``). The loop is the
same for every method: a method only decides what is trainable and which
sub-steps a step runs (``moddiffy_jax.methods.common``).

Data flow: config -> data source -> tokenized arrays -> grain iterator ->
sharded batches -> ``jit(train_step)`` per phase -> metrics / eval / Orbax
checkpoints -> host-side phase transition (magnitude pruning to an exact
budget) -> fixmask phase -> exported files and ``results.json``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from moddiffy_jax import checkpoints, parallel

# Re-exported: the run context, the run directory and the evaluator live in
# their own modules; ``train.build_context`` and friends keep working.
from moddiffy_jax.context import (  # noqa: F401
    Context,
    build_context,
    check_same_structure,
    diff_rules,
    is_vision,
)
from moddiffy_jax.eval.evaluator import Evaluator, composition_table  # noqa: F401
from moddiffy_jax.methods import common, removal, srnets
from moddiffy_jax.methods import registry as method_registry
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import masks as masks_lib
from moddiffy_jax.subnets import selection
from moddiffy_jax.workdir import (  # noqa: F401
    MetricWriter,
    Preempted,
    config_to_dict,
    prepare_workdir,
    progress_bar,
)

# --------------------------------------------------------------------------
# Run directory.


# --------------------------------------------------------------------------
# Context: data, model, pretrained params.


# --------------------------------------------------------------------------
# State construction and phase transitions (host side, pure).


def init_state(ctx: Context, rng: jax.Array) -> tuple[dict, dict]:
    """Trainable and frozen parts at the start of the first phase."""
    cfg, method, model = ctx.config, ctx.method, ctx.model
    include, exclude = diff_rules(cfg)
    r_head, r_adv = jax.random.split(rng)
    if method.encoder in common.SUBNETWORK_MODES:
        return _init_srnets_state(ctx, r_head)
    trainable: dict[str, Any] = {}
    frozen: dict[str, Any] = {}
    encoder = ctx.pretrained
    if method.encoder == "frozen":
        encoder, head, _ = checkpoints.load_core_run(cfg.method.core_run)
        check_same_structure(encoder, ctx.pretrained, cfg.method.core_run)
        frozen["task_head"] = head
    else:
        trainable["task_head"] = model.init_task_head(r_head)
    if method.encoder == "full":
        trainable["core"] = encoder
    elif method.encoder == "adapter":
        adapter_paths = selection.select_paths(encoder, model.adapter_rule)
        # Copies: the step donates the trainable buffers, which must not be
        # shared with the frozen base.
        trainable["adapters"] = jax.tree.map(
            jnp.copy, selection.subtree(encoder, adapter_paths)
        )
        frozen["base"] = encoder
    else:
        frozen["base"] = encoder
    if method.encoder == "diff":
        trainable["task_diff"] = diffs_lib.init_diff(
            encoder,
            include,
            exclude=exclude,
            hc=ctx.diff_settings.hc,
            structured=cfg.diff.structured,
        )
    if method.debias == "modular":
        trainable["diffs"] = {
            attr: diffs_lib.init_diff(
                encoder,
                include,
                exclude=exclude,
                hc=ctx.diff_settings.hc,
                structured=cfg.diff.structured,
            )
            for attr in ctx.attributes
        }
    if ctx.debias is not None and ctx.debias.objective == "mmd":
        if ctx.debias.mmd_whiten:
            trainable[removal.MMD_STATS] = removal.init_mmd_stats(
                model.feature_dim, ctx.attributes
            )
        if ctx.debias.fisher_weight > 0.0:
            trainable[removal.FISHER_STATS] = removal.init_fisher_stats(
                ctx.debias, model.feature_dim, ctx.attributes
            )
        if ctx.debias.target_weight > 0.0 and method.debias == "modular":
            trainable[removal.TARGET_STATS] = removal.init_target_stats(
                ctx.debias, model.feature_dim, ctx.attributes
            )
    if ctx.debias is not None and ctx.debias.task_guard and method.debias == "modular":
        trainable[removal.TASK_GUARD] = removal.init_task_guard(ctx.attributes)
    if ctx.debias is not None and ctx.debias.objective == "adversarial":
        trainable["adversaries"] = {
            attr: model.init_adversary(attr, jax.random.fold_in(r_adv, i))
            for i, attr in enumerate(ctx.attributes)
        }
    return trainable, frozen


def _init_srnets_state(ctx: Context, rng: jax.Array) -> tuple[dict, dict]:
    """Start weights of the SRNets methods (see ``methods.srnets``).

    With ``config.method.core_run`` (paradigm 1) the encoder and classifier
    are a fine-tuned run's; otherwise the pretrained encoder and a new random
    classifier (paradigm 3's frozen random classifier, or the classifier that
    IMP and retraining train).
    """
    cfg, method = ctx.config, ctx.method
    if cfg.method.core_run:
        if method.encoder == "retrain":
            raise ValueError(
                "srnets_retrain fine-tunes the pretrained encoder with a found mask; "
                "leave config.method.core_run empty and set config.srnets.mask_run."
            )
        encoder, head, _ = checkpoints.load_core_run(cfg.method.core_run)
        check_same_structure(encoder, ctx.pretrained, cfg.method.core_run)
    else:
        encoder, head = ctx.pretrained, ctx.model.init_task_head(rng)
    if method.encoder == "mask":
        return srnets.init_mask_state(cfg, encoder, head)
    if method.encoder == "imp":
        trainable, frozen = srnets.init_imp_state(cfg, encoder, head)
        # Copies: the step donates the trainable buffers, and rewinding reads
        # the start weights afterwards.
        return jax.tree.map(jnp.copy, trainable), frozen
    keep, _ = srnets.load_mask(cfg, encoder)
    trainable = {
        "core": masks_lib.apply_binary_masks(encoder, keep),
        "task_head": head,
    }
    return jax.tree.map(jnp.copy, trainable), {"masks": keep, "start": encoder}


def diff_keys(method: common.MethodDef, attributes: Sequence[str]) -> list[common.Key]:
    keys: list[common.Key] = []
    if method.encoder == "diff":
        keys.append(("task_diff",))
    if method.debias == "modular":
        keys += [("diffs", a) for a in attributes]
    return keys


def diff_name(key: common.Key) -> str:
    return "task" if key == ("task_diff",) else key[-1]


def base_for_diff(ctx: Context, trainable: Mapping, frozen: Mapping, key: common.Key):
    """The params a diff is relative to (its fingerprint goes in the file)."""
    params = trainable["core"] if ctx.method.encoder == "full" else frozen["base"]
    if ctx.method.encoder == "adapter":
        params = selection.merge(params, trainable["adapters"])
    if key != ("task_diff",) and ctx.method.encoder == "diff":
        raise NotImplementedError("attribute diffs on top of a task diff")
    return params


def to_fixmask(
    ctx: Context, trainable: dict, frozen: dict
) -> tuple[dict, dict, dict[str, diffs_lib.SparseDiff]]:
    """Phase transition: prune every diff to its exact budget.

    Each DiffState becomes the kept values (deterministic gate times delta at
    the kept entries); their indices move to ``frozen["indices"]``.
    """
    cfg = ctx.config
    include, exclude = diff_rules(cfg)
    sparse: dict[str, diffs_lib.SparseDiff] = {}
    new_trainable, new_frozen = dict(trainable), dict(frozen)
    indices: dict[str, Any] = {}
    for key in diff_keys(ctx.method, ctx.attributes):
        state = common.get_part(trainable, key)
        values = diffs_lib.dense_diff_values(state, hc=ctx.diff_settings.hc)
        base = base_for_diff(ctx, trainable, frozen, key)
        sd = diffs_lib.prune_to_sparsity(
            jax.device_get(values),
            keep=cfg.diff.keep,
            scope=cfg.diff.scope,
            name=diff_name(key),
            base_fingerprint="",
            rules=(include, exclude),
            info={"method": ctx.method.name},
        )
        sparse[diff_name(key)] = sd
        # Leaves with no kept entry are left out of the trained state (Orbax
        # cannot store empty arrays); exports restore them from the rules.
        kept = [p for p in sd.indices if np.size(sd.indices[p])]
        new_trainable = common.set_part(
            new_trainable, key, selection.unflatten({p: sd.values[p] for p in kept})
        )
        indices = common.set_part(
            indices, key, selection.unflatten({p: sd.indices[p] for p in kept})
        )
        del base
    new_frozen["indices"] = indices
    return new_trainable, new_frozen, sparse


def sparse_diffs_of(
    ctx: Context, trainable: Mapping, frozen: Mapping, phase: str
) -> dict[str, diffs_lib.SparseDiff]:
    """The current diffs as SparseDiffs, each with its base's fingerprint.

    In the ``l0`` phase: the nonzeros of the deterministic-gate diff; in
    ``fixmask``: the kept entries and their trained values.
    """
    if ctx.method.encoder == "mask":
        return {"mask": _mask_diff(ctx, trainable, frozen)}
    include, exclude = diff_rules(ctx.config)
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
        idx = selection.flatten(jax.device_get(common.get_part(frozen["indices"], key)))
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


def _mask_diff(ctx: Context, trainable: Mapping, frozen: Mapping):
    """The current SRNets mask on the encoder as a pruning SparseDiff."""
    keep = jax.device_get(srnets.current_masks(trainable))
    cfg = ctx.config
    return diffs_lib.pruning_diff(
        frozen["base"],
        keep["core"],
        name="mask",
        rules=srnets._rules(cfg),
        info={
            "method": ctx.method.name,
            "sparsity": cfg.srnets.sparsity,
            "task_loss": cfg.method.task_loss,
        },
    )


def _subnetwork_keep(ctx: Context, trainable: Mapping, frozen: Mapping) -> Any:
    """Bool keep-masks of the SRNets run's encoder (and classifier)."""
    if ctx.method.encoder == "mask":
        return srnets.current_masks(trainable)
    if ctx.method.encoder == "imp":
        return {"core": trainable["masks"]}
    return {"core": frozen["masks"]}


# --------------------------------------------------------------------------
# Evaluation.


# --------------------------------------------------------------------------
# The loop.


def _check_finite(
    records: Sequence[Mapping[str, float]], first_step: int, ckpt, workdir
):
    for offset, rec in enumerate(records):
        bad = [k for k, v in rec.items() if not math.isfinite(v)]
        if bad:
            last = ckpt.latest_step()
            kept = (
                f"the last good checkpoint is step {last} in {workdir / 'checkpoints'}"
                if last is not None
                else "no checkpoint had been written yet"
            )
            raise FloatingPointError(
                f"Non-finite {', '.join(sorted(bad)[:4])} at step "
                f"{first_step + offset}; "
                f"training stopped and {kept}. Lower the learning rates "
                "(config.optim.lr_*) or check the data."
            )


def _phase_steps(config: ml_collections.ConfigDict, phase: str) -> int:
    if phase.startswith("imp_"):
        return srnets.imp_phase_steps(config, srnets.imp_round_of(phase))
    return {
        "train": config.train.num_steps,
        "l0": config.train.l0_steps,
        "fixmask": config.train.fixmask_steps,
    }[phase]


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str | os.PathLike
) -> dict:
    """Trains ``config``'s method in ``workdir`` (resuming if it holds a checkpoint).

    Returns:
      The final results (also written to ``workdir/results.json``).
    """
    from moddiffy_jax.data import TrainIterator

    if config.method.name in method_registry.DRIVER_METHODS:
        from moddiffy_jax import surgery

        return surgery.run_ffw(config, workdir)
    workdir = Path(workdir)
    prepare_workdir(config, workdir)
    wall_start = time.time()
    ctx = build_context(config)
    method = ctx.method
    rng = jax.random.PRNGKey(config.seed)
    init_rng, step_rng = jax.random.split(rng)
    trainable, frozen = init_state(ctx, init_rng)
    iterator = TrainIterator(
        ctx.data.splits["train"],
        batch_size=config.train.batch_size,
        seed=config.seed,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
    )
    ckpt = checkpoints.RunCheckpointer(
        workdir / "checkpoints", max_to_keep=config.train.keep_checkpoints
    )
    writer = MetricWriter(workdir)
    evaluator = Evaluator(ctx)

    phases = method_registry.phases_of(method, config)
    phase_index, phase_step, global_step = 0, 0, 0
    restored_state = None
    latest = ckpt.latest_step()
    if latest is not None:
        meta, sparse_idx = ckpt.restore_meta(latest)
        phase_index = phases.index(meta["phase"])
        phase_step, global_step = meta["phase_step"], meta["step"]
        iterator.set_state(meta["iterator"])
        if meta["phase"] == "fixmask":
            # The kept indices come from the checkpoint; the values' shapes
            # follow them (restored below).
            frozen["indices"] = jax.tree.map(jnp.asarray, sparse_idx)
            trainable = _values_like(trainable, frozen["indices"], ctx)
        restored_state = latest
        logging.info("Resuming from step %d (phase %s).", latest, meta["phase"])

    total_steps = sum(_phase_steps(config, p) for p in phases)
    progress = progress_bar(config, total_steps, global_step)
    try:
        for pi in range(phase_index, len(phases)):
            phase = phases[pi]
            substeps = method_registry.build_substeps(ctx, phase, trainable)
            state = common.TrainState(
                step=jnp.asarray(global_step, jnp.int32),
                trainable=trainable,
                opt_states=common.init_opt_states(substeps, trainable),
            )
            if restored_state is not None:
                state = ckpt.restore_state(restored_state, state)
                restored_state = None
            state = parallel.replicate(state, ctx.mesh)
            frozen = parallel.replicate(frozen, ctx.mesh)
            step_fn = jax.jit(common.make_train_step(substeps), donate_argnums=(0,))
            reset_fn = jax.jit(_reset_thresholds, donate_argnums=(0,))
            n_steps = _phase_steps(config, phase)
            pending: list[Any] = []
            interval_start, interval_first = time.time(), global_step
            while phase_step < n_steps:
                batch = parallel.shard_batch(next(iterator), ctx.mesh)
                state, metrics = step_fn(state, frozen, batch, step_rng)
                pending.append(metrics)
                phase_step += 1
                global_step += 1
                if (
                    method.encoder == "mask"
                    and global_step % config.srnets.reset_every == 0
                ):
                    target = srnets.target_sparsity(config, global_step)
                    state = reset_fn(state, jnp.float32(target))
                    writer.write(
                        global_step,
                        {"phase": phase, "mask/target_sparsity": target},
                    )
                if phase == "l0" and config.diff.prune_schedule == "gradual":
                    keep = _gradual_keep(config, phase_step, n_steps)
                    if keep is not None:
                        state = state.replace(
                            trainable=_close_diff_gates(
                                ctx,
                                jax.device_get(state.trainable),
                                keep,
                                jax.device_get(state.opt_states),
                            )
                        )
                        state = parallel.replicate(state, ctx.mesh)
                        writer.write(global_step, {"phase": phase, "diff/keep": keep})
                progress.update(1)
                at_end = phase_step == n_steps
                # A simulated preemption (stop_at_step) saves like a periodic save.
                stop = bool(config.train.stop_at_step) and (
                    global_step >= config.train.stop_at_step
                )
                save = (
                    at_end or stop or global_step % config.train.checkpoint_every == 0
                )
                if save or global_step % config.train.log_every == 0:
                    records = [
                        {k: float(v) for k, v in m.items()}
                        for m in jax.device_get(pending)
                    ]
                    _check_finite(records, interval_first + 1, ckpt, workdir)
                    elapsed = max(time.time() - interval_start, 1e-9)
                    mean = {
                        k: float(np.mean([r[k] for r in records])) for k in records[0]
                    }
                    mean["examples_per_sec"] = (
                        len(records) * config.train.batch_size / elapsed
                    )
                    writer.write(global_step, {"phase": phase, **mean})
                    progress.set_postfix(
                        phase=phase,
                        loss=f"{mean.get('task/loss', next(iter(mean.values()))):.3f}",
                        ex_s=f"{mean['examples_per_sec']:.0f}",
                    )
                    pending, interval_start, interval_first = (
                        [],
                        time.time(),
                        global_step,
                    )
                if save:
                    meta = {
                        "phase": phase,
                        "phase_step": phase_step,
                        "step": global_step,
                        "iterator": iterator.get_state(),
                    }
                    ckpt.save(
                        global_step,
                        state,
                        meta,
                        jax.device_get(frozen.get("indices", {})),
                    )
                if config.train.eval_every and (
                    global_step % config.train.eval_every == 0 or at_end
                ):
                    _evaluate_during(
                        ctx,
                        evaluator,
                        writer,
                        state.trainable,
                        frozen,
                        phase,
                        global_step,
                    )
                    interval_start = time.time()  # throughput excludes eval
                if stop:
                    raise Preempted(global_step)
            trainable = jax.device_get(state.trainable)
            frozen = jax.device_get(frozen)
            if pi + 1 < len(phases):
                if method.encoder == "imp":
                    trainable = srnets.imp_prune_round(
                        config, trainable, frozen, pi + 1
                    )
                else:
                    trainable, frozen, _ = to_fixmask(ctx, trainable, frozen)
                    if config.train.eval_every:  # removal right after the cut
                        _evaluate_during(
                            ctx,
                            evaluator,
                            writer,
                            trainable,
                            frozen,
                            "fixmask",
                            global_step,
                        )
                phase_step = 0
        ckpt.wait()
    finally:
        # Waits for in-flight async saves, so an error (a NaN loss, a
        # preemption) still leaves the last good checkpoint complete.
        ckpt.close()
        progress.close()
        writer.close()
    results = _finish(ctx, evaluator, workdir, trainable, frozen, phases[-1])
    results["train_wall_time_s"] = time.time() - wall_start
    if config.eval.leakage and jax.process_index() == 0:
        from moddiffy_jax.eval import composition, probes

        probe_config = probes.ProbeConfig(
            seeds=tuple(config.eval.probe_seeds), max_epochs=config.eval.probe_epochs
        )
        evaluation = composition.evaluate_run(
            workdir, probe_config=probe_config, inlp=config.eval.inlp
        )
        for label, row in evaluation["composition"].items():
            if label not in results["composition"]:  # the INLP baselines
                results["composition"][label] = {
                    k: row[k] for k in ("dev_task_acc", "test_task_acc")
                }
        results["leakage"] = {
            label: {a: row["leakage"][a] for a in ctx.attributes}
            for label, row in evaluation["composition"].items()
        }
        results["floors"] = evaluation.get("floors", {})
        results["eval_report"] = str(workdir / "eval" / "report.md")
    results["wall_time_s"] = time.time() - wall_start
    if jax.process_index() == 0:
        checkpoints.write_json_atomic(workdir / "results.json", results)
    return results


def _gradual_keep(config, phase_step: int, n_steps: int) -> float | None:
    """The kept fraction to prune to after L0 step ``phase_step``, or None.

    Gradual pruning (Zhu & Gupta 2018) inside the L0 phase: every
    ``diff.prune_every`` steps between ``prune_start`` and ``prune_end``
    (fractions of the phase) the diffs are pruned by magnitude to a kept
    fraction that falls cubically from 1 to ``diff.keep``, so the diff adapts
    to each cut and the final exact cut removes nothing the removal relied on.
    """
    d = config.diff
    if not isinstance(d.keep, float) or not 0.0 < d.keep <= 1.0:
        raise ValueError(
            "diff.prune_schedule='gradual' needs diff.keep as a fraction in (0, 1], "
            f"got {d.keep!r}; use prune_schedule='final' for a count."
        )
    begin, end = d.prune_start * n_steps, d.prune_end * n_steps
    if phase_step % d.prune_every or not begin < phase_step < end + d.prune_every:
        return None
    schedule = masks_lib.cubic_sparsity_schedule(
        initial=0.0, final=1.0 - d.keep, begin_step=begin, end_step=end
    )
    return 1.0 - float(schedule(phase_step))


def _adam_second_moment(opt_state: Any, key: common.Key) -> Any:
    """Adam's ``nu`` for the delta of the diff at ``key`` in a sub-step's state."""
    stack = [opt_state]
    while stack:
        node = stack.pop()
        inner = getattr(node, "inner_states", None)
        if isinstance(inner, Mapping) and "diff" in inner:
            adam = inner["diff"].inner_state[0]
            return common.get_part(adam.nu, key).delta
        if isinstance(node, tuple):
            stack.extend(node)
    raise ValueError("No Adam state for the 'diff' role in the optimizer state.")


def _close_diff_gates(
    ctx: Context, trainable: dict, keep: float, opt_states: Mapping[str, Any]
) -> dict:
    """Closes each diff's gates outside its top ``keep`` fraction (host side).

    ``diff.prune_score``: ``magnitude`` ranks ``|z * delta|``; ``taylor`` ranks
    ``|z * delta| * sqrt(nu)`` with ``nu`` Adam's running mean of the squared
    gradient, a first-order estimate of how much the objective would change
    if the entry were removed (Adam moves every entry with a consistent
    gradient sign at about the learning rate, so magnitude alone says little
    about importance).
    """
    for key in diff_keys(ctx.method, ctx.attributes):
        state = common.get_part(trainable, key)
        values = diffs_lib.dense_diff_values(state, hc=ctx.diff_settings.hc)
        if ctx.config.diff.prune_score == "taylor":
            sub = "task" if key == ("task_diff",) else f"debias/{key[-1]}"
            nu = _adam_second_moment(opt_states[sub], key)
            values = jax.tree.map(lambda v, n: v * np.sqrt(n), values, nu)
        mask = diffs_lib.magnitude_keep_mask(
            jax.device_get(values), keep=keep, scope=ctx.config.diff.scope
        )
        trainable = common.set_part(trainable, key, diffs_lib.close_gates(state, mask))
    return trainable


def _reset_thresholds(state: common.TrainState, sparsity: jax.Array):
    """SRNets logging-step reset: exact per-matrix sparsity from the scores."""
    return state.replace(trainable=srnets.reset_thresholds(state.trainable, sparsity))


def _values_like(trainable: dict, indices: Mapping, ctx: Context) -> dict:
    """Zero values shaped like the restored indices (targets for restoring)."""
    for key in diff_keys(ctx.method, ctx.attributes):
        idx = common.get_part(indices, key)
        part = common.get_part(trainable, key)
        dtype = jax.tree.leaves(part.delta)[0].dtype  # a DiffState before restore
        trainable = common.set_part(
            trainable, key, jax.tree.map(lambda i, d=dtype: jnp.zeros(i.shape, d), idx)
        )
    return trainable


def _core_and_head(
    ctx: Context, trainable: Mapping, frozen: Mapping
) -> tuple[Any, Any]:
    """The exported core and head (for mask training: the dense frozen core and
    the classifier as masked; the encoder's mask is the ``mask`` diff)."""
    if ctx.method.encoder == "mask":
        keep = srnets.current_masks(trainable)
        head = frozen["task_head"]
        if "task_head" in keep:
            head = masks_lib.apply_binary_masks(head, keep["task_head"])
        return frozen["base"], head
    if ctx.method.encoder in ("imp", "retrain"):
        return common.subnetwork_params(ctx.method, trainable, frozen)
    core = trainable["core"] if ctx.method.encoder == "full" else frozen["base"]
    if ctx.method.encoder == "adapter":
        core = selection.merge(core, trainable["adapters"])
    head = trainable["task_head"] if "task_head" in trainable else frozen["task_head"]
    return core, head


def _evaluate_during(ctx, evaluator, writer, trainable, frozen, phase, step) -> None:
    trainable, frozen = jax.device_get(trainable), jax.device_get(frozen)
    core, head = _core_and_head(ctx, trainable, frozen)
    sparse = sparse_diffs_of(ctx, trainable, frozen, phase)
    params_by_row: dict[str, Any] = {}
    rows = composition_table(
        ctx, evaluator, core, head, sparse, ("dev",), params_by_row
    )
    record = {"phase": phase}
    for label, row in rows.items():
        record[f"eval/{label}/dev_task_acc"] = row["dev_task_acc"]
    for name, sd in sparse.items():
        record[f"eval/diff/{name}/density"] = float(sd.density())
    if ctx.config.eval.probe_during and ctx.attributes:
        record.update(_fresh_probes(ctx, params_by_row))
    writer.write(step, record)


def _fresh_probes(ctx, params_by_row) -> dict[str, float]:
    """Dev leakage of fresh linear probes for the core and each single diff."""
    from moddiffy_jax.eval import composition
    from moddiffy_jax.eval import removal as leakage

    rep = composition.Representer(ctx, ctx.config.eval.batch_size)
    out = {}
    labels = {
        a: {s: ctx.data.splits[s].attrs[a] for s in ("train", "dev")}
        for a in ctx.attributes
    }
    for label, (params, _) in params_by_row.items():
        if label != "core" and label.count("+") != 1:
            continue
        reps = {s: rep.represent(params, s) for s in ("train", "dev")}
        for a in ctx.attributes:
            out[f"probe/{label}/{a}/linear_dev_bacc"] = leakage.fresh_linear_leakage(
                reps,
                labels[a],
                num_classes=len(ctx.data.attr_classes[a]),
                max_train=ctx.config.eval.probe_max_train,
            )
    return out


def _ood_and_bias(ctx, evaluator, rows, params_by_row, splits) -> dict[str, Any]:
    """Adds bias-aligned/conflicting accuracy to ``rows``; returns OOD metrics.

    Text runs only (image benchmarks report their own bias metrics).
    """
    if is_vision(ctx.config):
        return {}
    from moddiffy_jax.eval import composition

    def predict(params, split):
        return evaluator.predict(params[0], params[1], split)

    extra = composition.ood_and_bias_rows(ctx, predict, params_by_row, splits=splits)
    ood = {}
    for label, fields in extra.items():
        if "ood" in fields:
            ood[label] = fields.pop("ood")
        rows[label].update(fields)
    return ood


def _finish(ctx, evaluator, workdir: Path, trainable, frozen, phase) -> dict:
    """Exports core, head and diffs (process 0 writes) and evaluates them.

    A finished run re-exports the same values when re-run (resume is exact),
    so replacing its own export files loses nothing.
    """
    core, head = _core_and_head(ctx, trainable, frozen)
    export = workdir / "export"
    chief = jax.process_index() == 0
    fp = diffs_lib.fingerprint(core)
    meta = {"fingerprint": fp, "method": ctx.method.name}
    sparse = sparse_diffs_of(ctx, trainable, frozen, phase)
    diff_info = {}
    if chief:
        checkpoints.save_params(
            export / "core.safetensors", core, metadata=meta, overwrite=True
        )
        checkpoints.save_params(
            export / "task_head.safetensors", head, metadata=meta, overwrite=True
        )
    for name, sd in sparse.items():
        path = export / "diffs" / f"{name}.safetensors"
        if chief:
            path.parent.mkdir(parents=True, exist_ok=True)
            diffs_lib.save_sparse_diff(path, sd, overwrite=True)
        diff_info[name] = {
            "nnz": int(sd.nnz()),
            "num_selected": int(sd.num_selected()),
            "density": float(sd.density()),
            "file_bytes": path.stat().st_size if chief else None,
            "path": str(path),
        }
    splits = tuple(s for s in ("dev", "test") if s in ctx.data.splits)
    params_by_row: dict[str, Any] = {}
    rows = composition_table(ctx, evaluator, core, head, sparse, splits, params_by_row)
    ood = _ood_and_bias(ctx, evaluator, rows, params_by_row, splits)
    extra = {}
    if ctx.method.encoder in common.SUBNETWORK_MODES:
        keep = jax.device_get(_subnetwork_keep(ctx, trainable, frozen))
        extra["sparsity"] = srnets.sparsity_report(keep["core"])
        if ctx.method.encoder == "mask":
            extra["mask_changed_vs_init"] = srnets.mask_change(
                ctx.config, frozen["base"], frozen["task_head"], keep
            )
        if "task_head" in keep:
            extra["classifier_sparsity"] = srnets.sparsity_report(keep["task_head"])
        if ctx.method.encoder != "mask" and chief:
            # The subnetwork's weights are the exported core; its mask goes
            # beside it, relative to the start weights (start + mask is the
            # pruned initialisation a retrain run starts from).
            sd = diffs_lib.pruning_diff(
                frozen["start"],
                keep["core"],
                name="mask",
                rules=srnets._rules(ctx.config),
                info={"method": ctx.method.name, "of": "start weights"},
            )
            diffs_lib.save_sparse_diff(export / "mask.safetensors", sd, overwrite=True)
    if ood:
        extra["ood"] = ood
    if getattr(ctx.data, "bias_summary", None):
        extra["bias_model"] = ctx.data.bias_summary
    return {
        **extra,
        "method": ctx.method.name,
        "dataset": ctx.data.name,
        "synthetic": bool(ctx.data.synthetic),
        "attributes": list(ctx.attributes),
        "core_params": int(sum(np.size(x) for x in jax.tree.leaves(core))),
        "core_fingerprint": fp,
        "composition": rows,
        "diffs": diff_info,
    }
