"""Evaluation inside a run: dev accuracy of every composition and fresh probes
while training; the bias-aligned / conflicting and OOD rows at the end."""

from __future__ import annotations

from typing import Any

import jax

from moddiffy_jax import best as best_lib
from moddiffy_jax.data import vision as vision_data
from moddiffy_jax.eval import composition
from moddiffy_jax.eval import removal as leakage
from moddiffy_jax.eval.evaluator import composition_table


def evaluate_during(
    ctx, evaluator, writer, trainable, frozen, phase: str, step: int
) -> dict[str, Any]:
    """Dev accuracy of every composition (and fresh probes) into the metrics.

    Returns the composition rows (label -> {"dev_task_acc": ...}).
    """
    trainable, frozen = jax.device_get(trainable), jax.device_get(frozen)
    core, head = ctx.method.model(ctx, trainable, frozen)
    sparse = ctx.method.exports(ctx, trainable, frozen, phase)
    params_by_row: dict[str, Any] = {}
    rows = composition_table(
        ctx, evaluator, core, head, sparse, ("dev",), params_by_row
    )
    record = {"phase": phase}
    for label, row in rows.items():
        record[f"eval/{label}/dev_task_acc"] = row["dev_task_acc"]
    for name, sd in sparse.items():
        record[f"eval/diff/{name}/density"] = float(sd.density())
    if ctx.attributes and (
        ctx.config.eval.probe_during or best_lib.uses_leakage(ctx.config)
    ):
        for (label, a), value in fresh_probes(ctx, params_by_row).items():
            record[f"probe/{label}/{a}/linear_dev_bacc"] = value
            rows[label][best_lib.leakage_key(a)] = value
    writer.write(step, record)
    return rows


def fresh_probes(ctx, params_by_row) -> dict[tuple[str, str], float]:
    """Dev leakage of fresh linear probes for the core and each single diff:
    ``{(configuration label, attribute): balanced accuracy}``."""
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
            out[label, a] = leakage.fresh_linear_leakage(
                reps,
                labels[a],
                num_classes=len(ctx.data.attr_classes[a]),
                max_train=ctx.config.eval.probe_max_train,
            )
    return out


def ood_and_bias(ctx, evaluator, rows, params_by_row, splits) -> dict[str, Any]:
    """Adds bias-aligned/conflicting accuracy to ``rows``; returns OOD metrics.

    Text runs only (image benchmarks report their own bias metrics).
    """
    if vision_data.is_vision_config(ctx.config):
        return {}

    def predict(params, split):
        return evaluator.predict(params[0], params[1], split)

    extra = composition.ood_and_bias_rows(ctx, predict, params_by_row, splits=splits)
    ood = {}
    for label, fields in extra.items():
        if "ood" in fields:
            ood[label] = fields.pop("ood")
        rows[label].update(fields)
    return ood
