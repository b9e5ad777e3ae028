"""Mean ± std over training runs (seeds) of evaluated composition matrices.

The ± of one run's report is over probe seeds only; a headline number needs
the spread over training seeds too. :func:`aggregate_runs` reads the
``eval/results.json`` of several runs of one experiment (each made by
:func:`moddiffy_jax.eval.composition.evaluate_run`) and reports, per
configuration, the mean and std over runs of task accuracy, each attribute's
leakage (probe ensemble, linear probe and converged MLP probe), the share
of the core-to-floor gap closed, and the RMS TPR gap.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moddiffy_jax.eval.composition import gap_closed


def _read(run: str | Path) -> dict[str, Any]:
    path = Path(run) / "eval" / "results.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: evaluate the run first "
            f"(python -m moddiffy_jax.evaluate --workdir={run})."
        )
    return json.loads(path.read_text())


def _metrics(row, core, attrs, floors) -> dict[str, float]:
    out = {"test acc": row.get("test_task_acc")}
    test = row.get("task", {}).get("test", {})
    for a in attrs:
        leak, core_leak = row["leakage"][a], core["leakage"][a]
        lin = leak.get("linear", {}).get("test_balanced_accuracy")
        core_lin = core_leak.get("linear", {}).get("test_balanced_accuracy")
        floor = floors.get(a, {}).get("floor")
        mlp = leak.get("mlp", {}).get("test_balanced_accuracy")
        core_mlp = core_leak.get("mlp", {}).get("test_balanced_accuracy")
        out[f"{a} leakage"] = leak["mean"]
        out[f"{a} lin"] = lin
        out[f"{a} mlp"] = mlp
        if floor is not None:
            out[f"{a} gap closed"] = gap_closed(core_leak["mean"], leak["mean"], floor)
            out[f"{a} gap closed (lin)"] = gap_closed(core_lin, lin, floor)
            out[f"{a} gap closed (mlp)"] = gap_closed(core_mlp, mlp, floor)
        out[f"{a} RMS TPR gap"] = test.get(f"{a}/rms_tpr_gap")
    return out


def aggregate_runs(runs: Sequence[str | Path]) -> dict[str, Any]:
    """Mean/std over ``runs`` per configuration present in all of them.

    Returns:
      ``{"runs": [...], "attributes": [...], "floors": {a: {"mean", "std"}},
      "rows": {label: {metric: {"mean", "std", "n"}}}}``.

    Raises:
      ValueError: fewer than one run, or runs of different methods/datasets.
    """
    if not runs:
        raise ValueError("aggregate_runs needs at least one run directory.")
    results = [_read(r) for r in runs]
    kinds = {(r["method"], r["dataset"], tuple(r["attributes"])) for r in results}
    if len(kinds) != 1:
        raise ValueError(
            f"The runs are of different experiments {sorted(kinds)}; aggregate "
            "runs of one method, dataset and attribute set."
        )
    attrs = results[0]["attributes"]
    labels = [
        label
        for label in results[0]["composition"]
        if all(label in r["composition"] for r in results)
    ]
    per_run = []
    for r in results:
        core = r["composition"]["core"]
        floors = r.get("floors", {})
        per_run.append(
            {
                label: _metrics(r["composition"][label], core, attrs, floors)
                for label in labels
            }
        )
    rows = {}
    for label in labels:
        keys = per_run[0][label]
        rows[label] = {}
        for k in keys:
            vals = [p[label][k] for p in per_run if p[label][k] is not None]
            rows[label][k] = {
                "mean": float(np.mean(vals)) if vals else None,
                "std": float(np.std(vals)) if vals else None,
                "n": len(vals),
            }
    floors = {}
    for a in attrs:
        vals = [r["floors"][a]["floor"] for r in results if a in r.get("floors", {})]
        if vals:
            floors[a] = {"mean": float(np.mean(vals)), "std": float(np.std(vals))}
    return {
        "runs": [str(r) for r in runs],
        "method": results[0]["method"],
        "dataset": results[0]["dataset"],
        "synthetic": bool(results[0].get("synthetic")),
        "attributes": attrs,
        "floors": floors,
        "rows": rows,
    }


def format_aggregate(agg: dict[str, Any]) -> str:
    """The aggregate as a Markdown table (mean ± std over runs)."""
    rows = agg["rows"]
    cols = list(next(iter(rows.values())))
    synthetic = " (SYNTHETIC data)" if agg.get("synthetic") else ""
    lines = [
        f"# {agg['method']} on {agg['dataset']}{synthetic}: "
        f"mean ± std over {len(agg['runs'])} training runs",
        "",
        "| configuration | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for label, row in rows.items():
        cells = []
        for c in cols:
            m = row[c]
            cells.append(
                "n/a" if m["mean"] is None else f"{m['mean']:.3f} ± {m['std']:.3f}"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for a, f in agg["floors"].items():
        lines.append(f"\n{a}: floor {f['mean']:.3f} (gold task label alone)")
    return "\n".join(lines) + "\n"
