"""Baselines beside an FFW run: what the unbiased gate-train split gives without gates.

FFW trains its gates on a labelled, *unbiased* split (gate_train). Part of what
it gains over the vanilla model may come from those labels alone, not from
the mutual-information term or from pruning. This script puts two answers
beside an FFW run, on the same vanilla model and the same splits:

- ``last layer``: a multinomial logistic regression on the vanilla model's
  frozen representation, fit on gate_train (standardized with gate_train's
  statistics), evaluated on test (the "last-layer retraining" of Kirichenko
  et al. 2023, DFR);
- the FFW run's own rows (vanilla, soft gates, hard pruning) read from its
  results.json, so one table holds all of them.

A gate run with ``--config.ffw.gamma=0`` (task loss only) is the third
baseline; pass its run directory with ``--also`` to add its rows.

Usage::

    python benchmarks/ffw_baselines.py RUN_DIR [--also RUN_DIR ...]

Prints one markdown table (test accuracy, group-mean "unbiased" accuracy,
bias-conflicting accuracy, bias accuracy of a fresh head on gate-val).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def _group_mean_accuracy(y, pred, b) -> float:
    cells = [
        float(np.mean(pred[m] == y[m]))
        for m in ((y == c) & (b == g) for c in np.unique(y) for g in np.unique(b))
        if m.any()
    ]
    return float(np.mean(cells))


def last_layer(run_dir: Path) -> dict:
    """Logistic regression on the vanilla representation, fit on gate_train."""
    from sklearn.linear_model import LogisticRegression

    from moddiffy_jax import checkpoints, context
    from moddiffy_jax.eval.composition import load_run_config
    from moddiffy_jax.eval.forward import Representer

    config = load_run_config(run_dir)
    ctx = context.build_context(config)
    core, _, _ = checkpoints.load_core_run(config.method.core_run)
    rep = Representer(ctx, config.eval.batch_size)
    names = config.ffw.splits
    attrs = list(config.ffw.attributes) or list(ctx.data.attributes)
    feats, task, bias = {}, {}, {}
    for key in ("gate_train", "gate_val", "test"):
        split = ctx.data.splits[names[key]]
        feats[key] = rep.represent(core, names[key])
        task[key] = np.asarray(split.task)
        bias[key] = {a: np.asarray(split.attrs[a]) for a in attrs}
    mean, std = feats["gate_train"].mean(0), feats["gate_train"].std(0) + 1e-6
    z = {k: (v - mean) / std for k, v in feats.items()}
    clf = LogisticRegression(max_iter=5000).fit(z["gate_train"], task["gate_train"])
    y, pred = task["test"], clf.predict(z["test"])
    # Means over the bias attributes, as FFW's own table reports them.
    unbiased, conflicting, bias_acc = [], [], []
    for a in attrs:
        b = bias["test"][a]
        unbiased.append(_group_mean_accuracy(y, pred, b))
        conflicting.append(float(np.mean(pred[b != y] == y[b != y])))
        head = LogisticRegression(max_iter=5000).fit(
            z["gate_train"], bias["gate_train"][a]
        )
        hit = head.predict(z["gate_val"]) == bias["gate_val"][a]
        bias_acc.append(float(np.mean(hit)))
    return {
        "test acc": float(np.mean(pred == y)),
        "unbiased": float(np.mean(unbiased)),
        "conflicting": float(np.mean(conflicting)),
        "bias acc": float(np.mean(bias_acc)),
    }


def _mean(test: dict, attrs: list[str], suffix: str) -> float | None:
    vals = [test[f"{a}/{suffix}"] for a in attrs if f"{a}/{suffix}" in test]
    return float(np.mean(vals)) if vals else None


def ffw_rows(run_dir: Path, tag: str) -> list[tuple[str, dict]]:
    results = json.loads((run_dir / "results.json").read_text())
    attrs = results["attributes"]
    rows = []
    for key, label in (
        ("vanilla", "vanilla"),
        ("final_soft", "soft gates"),
        ("final", "hard pruning"),
    ):
        entry = results.get(key)
        if not entry:
            continue
        test = entry["eval"]["test"]
        rows.append(
            (
                f"{tag}{label}",
                {
                    "test acc": test["accuracy"],
                    "unbiased": _mean(test, attrs, "unbiased_accuracy"),
                    "conflicting": _mean(test, attrs, "conflicting_accuracy"),
                    "bias acc": entry["leakage"]["mean_bias_acc"],
                    "pruned": entry.get("pruned_fraction"),
                },
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a finished FFW run directory")
    parser.add_argument("--also", type=Path, nargs="*", default=[])
    args = parser.parse_args()
    rows = ffw_rows(args.run_dir, "FFW: ")
    rows.insert(1, ("last layer refit on gate_train", last_layer(args.run_dir)))
    for other in args.also:
        rows += [r for r in ffw_rows(other, f"{other.name}: ") if "vanilla" not in r[0]]
    cols = ["test acc", "unbiased", "conflicting", "bias acc", "pruned"]
    print("| model | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for label, row in rows:
        cells = [row.get(c) for c in cols]
        print(
            f"| {label} | "
            + " | ".join("" if v is None else f"{v:.3f}" for v in cells)
            + " |"
        )


if __name__ == "__main__":
    main()
