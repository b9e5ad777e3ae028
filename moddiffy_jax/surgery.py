"""The FFW surgery driver: gate epochs over a frozen vanilla run, export, report.

FFW's numerics (losses, gate and bias-head steps, the temperature and
plateau rules) are pure functions in :mod:`moddiffy_jax.methods.ffw`; this
module runs them: it loads the vanilla run named by
``config.method.core_run``, trains the gates epoch by epoch with Orbax
checkpoints, and exports the prunings as sparse diffs on that core.
``train.train_and_evaluate`` calls :func:`run_ffw` for ``method.name ==
"ffw"``.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from moddiffy_jax import checkpoints
from moddiffy_jax.data.dataset import subset_split
from moddiffy_jax.methods.ffw import (
    GateTrainState,
    TemperatureState,
    check_schedule,
    crossed_decade,
    epoch_batches,
    geometric_temperature,
    init_bias_heads,
    split_part,
    step_temperature,
    to_float,
)
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import gates as gates_lib
from moddiffy_jax.subnets import selection
from moddiffy_jax.surgeon import Surgeon

PyTree = Any

# Seed-sequence tags of the shuffles (all derived from config.seed).
(
    _TAG_PH0,
    _TAG_GATE,
    _TAG_REFINE,
    _TAG_PRUNED,
    _TAG_RETUNE,
    _TAG_FINAL,
    _TAG_BEST,
    _TAG_SOFT,
) = range(8)

# -----------------------------------------------------------------------------
# The driver.
# -----------------------------------------------------------------------------


def _pruning_summary(surgeon: Surgeon, logits: PyTree) -> dict[str, Any]:
    overall, per_leaf = gates_lib.pruned_fraction(
        gates_lib.GateState(logits), params=surgeon.base
    )
    return {
        "pruned_fraction": to_float(overall),
        "pruned_fraction_per_layer": {k: to_float(v) for k, v in per_leaf.items()},
    }


def _export_pruning(
    surgeon: Surgeon,
    logits: PyTree,
    directory: Path,
    diff_path: Path,
    name: str,
    info: Mapping[str, Any],
    core_meta: Mapping[str, Any],
) -> dict[str, Any]:
    """Writes the pruning of ``logits`` as a SparseDiff on the core (+ head, gates)."""
    state = gates_lib.GateState(logits)
    masks = gates_lib.pruning_masks(
        surgeon.base, state, followers=surgeon.followers or None
    )
    masks = jax.device_get(masks)
    core, head = surgeon.base["encoder"], surgeon.base["task_head"]
    sd = diffs_lib.pruning_diff(
        core,
        split_part(masks, "encoder"),
        name=name,
        rules=(surgeon.include, surgeon.exclude),
        info=dict(info),
    )
    diff_path.parent.mkdir(parents=True, exist_ok=True)
    diffs_lib.save_sparse_diff(diff_path, sd, overwrite=True)
    out = {
        "path": str(diff_path),
        "nnz": int(sd.nnz()),
        "num_selected": int(sd.num_selected()),
        "density": float(sd.density()),
    }
    meta = {**core_meta, **{k: v for k, v in info.items() if isinstance(v, str)}}
    if "task_head" in masks:
        pruned_head = selection.map_subtree(
            lambda w, k: np.where(k, w, np.zeros_like(w)), head, masks["task_head"]
        )
        path = directory / "task_head_pruned.safetensors"
        checkpoints.save_params(path, pruned_head, metadata=meta, overwrite=True)
        out["task_head_pruned"] = str(path)
    gates_path = directory / f"{name}_gates.safetensors"
    checkpoints.save_params(
        gates_path, jax.device_get(logits), metadata=meta, overwrite=True
    )
    out["gates"] = str(gates_path)
    return out


def run_ffw(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    *,
    allow_changed_inputs: bool = False,
) -> dict:
    """Runs FFW surgery on ``config.method.core_run`` in ``workdir`` (resumable).

    Args:
      config: an experiment config with ``method.core_run`` (a finished run
        directory of this library), ``ffw`` (:func:`default_ffw_config`),
        ``seed``, ``eval.batch_size``, ``train.keep_checkpoints``,
        ``train.progress`` and ``train.stop_at_step`` (> 0: simulate a
        preemption after that many *gate epochs*).
      workdir: the run directory; a checkpoint there is resumed.
      allow_changed_inputs: resume although the data, base or core run
        differ from those the run started with (see ``workdir.check_inputs``).

    Returns:
      The results, also written to ``workdir/results.json``.

    Raises:
      workdir.Preempted: when ``config.train.stop_at_step`` stops the run.
    """
    from moddiffy_jax import context
    from moddiffy_jax import manifest as manifest_lib
    from moddiffy_jax import workdir as workdir_lib

    wall_start = time.time()
    workdir = Path(workdir)
    workdir_lib.check_workdir(config, workdir)
    ctx = context.build_context(config)
    core, head, fp = checkpoints.load_core_run(config.method.core_run)
    checkpoints.check_same_structure(core, ctx.pretrained, config.method.core_run)
    inputs = workdir_lib.check_inputs(
        workdir, ctx, allow_changed=allow_changed_inputs, record=False
    )
    workdir_lib.prepare_workdir(config, workdir)
    workdir_lib.record_inputs(workdir, inputs)
    _, core_meta = checkpoints.load_params(
        Path(config.method.core_run) / "export" / "core.safetensors"
    )
    core_meta = dict(core_meta)
    core_meta.setdefault("fingerprint", diffs_lib.fingerprint(core))
    ctx = _limit_gate_train(ctx, config)
    check_schedule(config.ffw)
    surgeon = Surgeon(config, ctx, core, head)
    cfg = surgeon.cfg

    ph0_init = init_bias_heads(
        jax.random.PRNGKey(config.seed), surgeon.feature_dim(), surgeon.attr_classes
    )
    logits0 = surgeon.init_logits
    state = GateTrainState(
        logits=logits0,
        gate_opt=surgeon.gate_opt.init(logits0),
        ph=ph0_init,
        ph_opt=surgeon.ph_opt.init(ph0_init),
    )
    saved = {
        "train": state,
        "ph0": ph0_init,
        "best_logits": jax.tree.map(jnp.copy, logits0),
    }
    meta: dict[str, Any] = {
        "epoch": 0,
        "temperature": float(cfg.tau0),
        "tau_best": None,
        "tau_num_bad": 0,
        "done": False,
        "stop_reason": None,
        "best_epoch": None,
        "best_score": None,
        "temperature_history": [],
        "decays": [],
        "ph0_epochs": 0,
    }
    ckpt = checkpoints.RunCheckpointer(
        workdir / "checkpoints", max_to_keep=config.train.keep_checkpoints
    )
    latest = ckpt.latest_step()
    writer = workdir_lib.MetricWriter(workdir, resume_step=latest or 0)
    try:
        if latest is not None:
            meta, _ = ckpt.restore_meta(latest)
            saved = ckpt.restore_state(latest, saved)
            logging.info("FFW: resuming after gate epoch %d.", meta["epoch"])
        else:
            feats, _ = surgeon.features(surgeon.base, surgeon.splits["gate_train"])
            ph0, _, meta["ph0_epochs"] = surgeon.train_ph(
                ph0_init, surgeon.ph_opt.init(ph0_init), feats, (_TAG_PH0,)
            )
            saved["ph0"] = ph0
            saved["train"] = state.replace(
                ph=jax.tree.map(jnp.copy, ph0), ph_opt=surgeon.ph_opt.init(ph0)
            )
        _gate_loop(surgeon, saved, meta, ckpt, writer, config)
        ckpt.wait()
    finally:
        ckpt.close()
        writer.close()

    def finish(export: Path) -> dict:
        results = _finish(surgeon, saved, meta, export, fp, core_meta, config)
        if cfg.with_core_diffs:
            results["core_diffs"] = _copy_core_diffs(config.method.core_run, export, fp)
        return results

    if jax.process_index() == 0:
        with manifest_lib.staged_export(workdir, fingerprint=fp) as stage:
            results = finish(stage.dir)
        results = stage.final_paths(results)
    else:  # every process computes the same surgery; process 0 writes it
        with tempfile.TemporaryDirectory() as scratch:
            results = finish(Path(scratch))
    results["wall_time_s"] = time.time() - wall_start
    if jax.process_index() == 0:
        checkpoints.write_json_atomic(workdir / "results.json", results)
    return results


def _limit_gate_train(ctx: Any, config: ml_collections.ConfigDict) -> Any:
    """``ctx`` with the gate-train split cut to ``ffw.max_gate_train_examples``."""
    limit = int(config.ffw.max_gate_train_examples)
    name = config.ffw.splits.gate_train
    split = ctx.data.splits[name] if name in ctx.data.splits else None
    if limit <= 0 or split is None or len(split) <= limit:
        return ctx
    order = np.random.default_rng(config.seed).permutation(len(split))[:limit]
    splits = {**ctx.data.splits, name: subset_split(split, np.sort(order))}
    return dataclasses.replace(ctx, data=dataclasses.replace(ctx.data, splits=splits))


def _copy_core_diffs(core_run: str, export: Path, fp: str) -> list[str]:
    """Copies the core run's exported diffs made on the same core (same
    fingerprint) into the export directory ``export``."""
    copied = []
    for path in sorted((Path(core_run) / "export" / "diffs").glob("*.safetensors")):
        sd = diffs_lib.load_sparse_diff(str(path))
        if sd.base_fingerprint != fp or sd.name == "ffw":
            continue
        diffs_lib.save_sparse_diff(export / "diffs" / path.name, sd, overwrite=True)
        copied.append(sd.name)
    return copied


def _gate_loop(surgeon: Surgeon, saved: dict, meta: dict, ckpt, writer, config) -> None:
    """Gate epochs from ``meta["epoch"]`` on; updates ``saved``/``meta`` in place."""
    from moddiffy_jax.workdir import Preempted, stop_requested

    cfg = surgeon.cfg
    split = surgeon.ctx.data.splits[surgeon.splits["gate_train"]]
    n = len(split)
    controller = TemperatureState(
        meta["temperature"], meta["tau_best"], meta["tau_num_bad"]
    )
    progress = _progress(config, cfg.max_gate_epochs, meta["epoch"])
    tolerance = float(cfg.get("best_task_tolerance", -1.0))
    if tolerance >= 0 and "vanilla_val_task_acc" not in meta:
        _, vanilla_logits = surgeon.features(surgeon.base, surgeon.splits["gate_val"])
        meta["vanilla_val_task_acc"] = surgeon.task_report(
            vanilla_logits, surgeon.splits["gate_val"]
        )["accuracy"]
    try:
        while not meta["done"] and meta["epoch"] < cfg.max_gate_epochs:
            epoch = meta["epoch"] + 1
            start = time.time()
            tau = controller.temperature
            state = saved["train"]
            # a. One gate epoch.
            idx, w = epoch_batches(
                n, cfg.batch_size, surgeon.seed_words(_TAG_GATE, epoch)
            )
            auxes = []
            for rows, wb in zip(idx, w, strict=True):
                arrays = surgeon.batch_arrays(split.take(rows), wb)
                state, aux = surgeon.gate_step(
                    state, surgeon.base, *arrays, jnp.float32(tau)
                )
                auxes.append(aux)
            # Epoch means over real examples (each batch value is a batch mean).
            auxes, sizes = jax.device_get(auxes), w.sum(axis=1)
            record = {
                f"train/{k}": sum(
                    float(a[k]) * float(s) for a, s in zip(auxes, sizes, strict=True)
                )
                / n
                for k in auxes[0]
            }
            # b. Refine the PH on the gated net.
            gated = surgeon.apply(surgeon.base, state.logits, jnp.float32(tau))
            feats, _ = surgeon.features(gated, surgeon.splits["gate_train"])
            ph, ph_opt, record["ph_refine_epochs"] = surgeon.train_ph(
                state.ph, state.ph_opt, feats, (_TAG_REFINE, epoch)
            )
            # c. Validation MI with bias labels -> temperature controller.
            val_name = surgeon.splits["gate_val"]
            val_feats, val_logits = surgeon.features(gated, val_name)
            leak = surgeon.leakage(ph, val_feats, val_name)
            record.update(
                {
                    "val/mi": leak["mean_mi"],
                    "val/bias_acc": leak["mean_bias_acc"],
                    "val/task_acc": surgeon.task_report(val_logits, val_name)[
                        "accuracy"
                    ],
                    "temperature": tau,
                }
            )
            record.update({f"val/mi/{a}": v for a, v in leak["mi"].items()})
            record.update({f"val/bias_acc/{a}": v for a, v in leak["bias_acc"].items()})
            annealed = False
            if cfg.tau_schedule == "geometric":
                # A fixed anneal: T after this epoch, whatever the MI did.
                # The hard pruning is scored at every power of ten and at
                # the end, as often as the plateau controller's decays.
                new_tau = geometric_temperature(
                    epoch,
                    tau0=cfg.tau0,
                    tau_end=cfg.tau_end,
                    anneal_epochs=int(cfg.anneal_epochs),
                )
                annealed = epoch >= int(cfg.anneal_epochs) + int(cfg.hold_epochs)
                changed = annealed or crossed_decade(tau, new_tau)
                best = leak["mean_mi"] if controller.best is None else controller.best
                controller = TemperatureState(new_tau, min(best, leak["mean_mi"]), 0)
            else:
                controller, changed = step_temperature(
                    controller,
                    leak["mean_mi"],
                    factor=cfg.tau_factor,
                    patience=cfg.tau_patience,
                    threshold=cfg.tau_threshold,
                )
            meta["temperature_history"].append([epoch, tau])
            # d. On a temperature change: evaluate the hard pruning.
            if changed:
                pruned = surgeon.prune(surgeon.base, state.logits)
                train_p, _ = surgeon.features(pruned, surgeon.splits["gate_train"])
                fresh, _ = surgeon.fresh_ph(saved["ph0"], train_p, (_TAG_PRUNED, epoch))
                val_p, val_p_logits = surgeon.features(pruned, val_name)
                pl = surgeon.leakage(fresh, val_p, val_name)
                score = pl["mean_bias_acc"]
                task_acc = surgeon.task_report(val_p_logits, val_name)["accuracy"]
                # A pruning that lost the task is no candidate, however little
                # bias it shows (a one-class net shows none).
                eligible = (
                    tolerance < 0
                    or task_acc >= meta["vanilla_val_task_acc"] - tolerance
                )
                record.update(
                    {
                        "pruned/val_mi": pl["mean_mi"],
                        "pruned/val_bias_acc": score,
                        "pruned/val_task_acc": task_acc,
                    }
                )
                meta["decays"].append(
                    {
                        "epoch": epoch,
                        "from": tau,
                        "to": controller.temperature,
                        "val_mi": leak["mean_mi"],
                        "pruned_val_bias_acc": score,
                        "pruned_val_mi": pl["mean_mi"],
                        "pruned_val_task_acc": task_acc,
                        "eligible": bool(eligible),
                    }
                )
                if eligible and (
                    meta["best_score"] is None or score < meta["best_score"]
                ):
                    meta["best_score"], meta["best_epoch"] = score, epoch
                    saved["best_logits"] = jax.tree.map(jnp.copy, state.logits)
                if annealed:
                    meta["done"], meta["stop_reason"] = True, "annealed"
                elif (
                    cfg.tau_schedule == "plateau"
                    and controller.temperature < cfg.tau_min
                ):
                    meta["done"], meta["stop_reason"] = True, "tau_min"
                else:
                    gated = surgeon.apply(
                        surgeon.base, state.logits, jnp.float32(controller.temperature)
                    )
                    feats, _ = surgeon.features(gated, surgeon.splits["gate_train"])
                    ph, ph_opt, record["ph_retune_epochs"] = surgeon.train_ph(
                        ph, ph_opt, feats, (_TAG_RETUNE, epoch)
                    )
            saved["train"] = state.replace(ph=ph, ph_opt=ph_opt)
            if not meta["done"] and epoch >= cfg.max_gate_epochs:
                meta["done"], meta["stop_reason"] = True, "max_gate_epochs"
            summary = _pruning_summary(surgeon, state.logits)
            record["pruned_fraction"] = summary["pruned_fraction"]
            record["tau_changed"] = int(changed)
            meta.update(
                epoch=epoch,
                temperature=controller.temperature,
                tau_best=controller.best,
                tau_num_bad=controller.num_bad,
            )
            # e. Checkpoint (async) and log.
            ckpt.save(epoch, saved, meta, {})
            record["epoch_time_s"] = time.time() - start
            writer.write(epoch, record)
            progress.update(1)
            progress.set_postfix(tau=f"{tau:.0e}", mi=f"{leak['mean_mi']:.3f}")
            logging.info(
                "FFW epoch %d: T=%g val MI %.4f bias acc %.4f pruned %.4f",
                epoch,
                tau,
                leak["mean_mi"],
                leak["mean_bias_acc"],
                summary["pruned_fraction"],
            )
            stop_at = int(config.train.stop_at_step)
            if stop_at and epoch >= stop_at and not meta["done"]:
                raise Preempted(epoch)
            if stop_requested() and not meta["done"]:
                raise Preempted(epoch, f"{stop_requested()} received")
    finally:
        progress.close()


def _progress(config, total: int, initial: int):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc="ffw",
        disable=not config.train.progress,
        dynamic_ncols=True,
    )


def _finish(
    surgeon: Surgeon,
    saved: dict,
    meta: dict,
    export: Path,
    fp: str,
    core_meta: Mapping[str, Any],
    config: ml_collections.ConfigDict,
) -> dict:
    """Evaluates vanilla / final / best-intermediate gates and writes the
    exports into the directory ``export``."""
    cfg = surgeon.cfg
    checkpoints.save_params(
        export / "core.safetensors",
        surgeon.base["encoder"],
        metadata=core_meta,
        overwrite=True,
    )
    checkpoints.save_params(
        export / "task_head.safetensors",
        surgeon.base["task_head"],
        metadata=core_meta,
        overwrite=True,
    )
    ph0 = saved["ph0"]
    results: dict[str, Any] = {
        "method": "ffw",
        "dataset": surgeon.ctx.data.name,
        "attributes": list(surgeon.attributes),
        "core_run": str(config.method.core_run),
        "core_fingerprint": fp,
        "structured": bool(cfg.structured),
        "gated_leaves": list(surgeon.paths),
        "num_gate_epochs": meta["epoch"],
        "stop_reason": meta["stop_reason"],
        "ph0_epochs": meta["ph0_epochs"],
        "temperature_history": [
            {"epoch": e, "temperature": t} for e, t in meta["temperature_history"]
        ],
        "temperature_decays": meta["decays"],
        "final_temperature": meta["temperature"],
        "best_task_tolerance": float(cfg.get("best_task_tolerance", -1.0)),
        "vanilla_val_task_acc": meta.get("vanilla_val_task_acc"),
        "gate_val_split": surgeon.splits["gate_val"],
    }
    results["vanilla"] = surgeon.evaluate(surgeon.base, ph0, None)
    results["vanilla"]["leakage"]["note"] = "PH0 (trained on the vanilla features)"
    if meta["temperature_history"]:
        # The soft-gated network the final gates were trained as (the
        # temperature of the last gate epoch), to set beside its hard cut.
        last_tau = float(meta["temperature_history"][-1][1])
        soft = surgeon.apply(surgeon.base, saved["train"].logits, jnp.float32(last_tau))
        results["final_soft"] = {
            "temperature": last_tau,
            **surgeon.evaluate(soft, ph0, (_TAG_SOFT,)),
        }
    candidates = [("final", saved["train"].logits, meta["epoch"], _TAG_FINAL)]
    if meta["best_epoch"] is not None:
        candidates.append(
            (
                "best_intermediate",
                saved["best_logits"],
                meta["best_epoch"],
                _TAG_BEST,
            )
        )
    else:
        results["best_intermediate"] = None
    for label, logits, epoch, tag in candidates:
        pruned = surgeon.prune(surgeon.base, logits)
        entry = {"epoch": epoch, **_pruning_summary(surgeon, logits)}
        entry.update(surgeon.evaluate(pruned, ph0, (tag,)))
        info = {
            "method": "ffw",
            "gates": label,
            "epoch": epoch,
            "structured": bool(cfg.structured),
        }
        if label == "final":
            entry["export"] = _export_pruning(
                surgeon,
                logits,
                export,
                export / "diffs" / "ffw.safetensors",
                "ffw",
                info,
                core_meta,
            )
        else:
            entry["score_val_bias_acc"] = meta["best_score"]
            directory = export / "ffw_best_intermediate"
            entry["export"] = _export_pruning(
                surgeon,
                logits,
                directory,
                directory / "ffw_best_intermediate.safetensors",
                "ffw_best_intermediate",
                info,
                core_meta,
            )
        results[label] = entry
    results["diffs"] = {
        "ffw": {k: v for k, v in results["final"]["export"].items() if k != "gates"}
    }
    if "final_soft" in results:
        # What the hard cut changes: test accuracy, and the share of test
        # examples on which the pruned net predicts what the soft net did.
        test = surgeon.splits["test"]
        last_tau = results["final_soft"]["temperature"]
        logits = saved["train"].logits
        soft = surgeon.apply(surgeon.base, logits, jnp.float32(last_tau))
        _, soft_logits = surgeon.features(soft, test)
        _, hard_logits = surgeon.features(surgeon.prune(surgeon.base, logits), test)
        results["cut"] = {
            "temperature": last_tau,
            "test_accuracy_change": results["final"]["eval"][test]["accuracy"]
            - results["final_soft"]["eval"][test]["accuracy"],
            "test_prediction_agreement": float(
                np.mean(soft_logits.argmax(-1) == hard_logits.argmax(-1))
            ),
        }
    return results
