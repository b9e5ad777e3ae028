"""The composition matrix of a run: task metrics and leakage for every subset.

``evaluate_run(workdir)`` reads only what a run directory holds (config.json,
``export/core.safetensors``, ``export/task_head.safetensors``,
``export/diffs/*.safetensors``) and evaluates:

* the core alone, each attribute diff, every pair, ..., all diffs (optionally
  each diff scaled by a weight); DiffPrun's task diff is part of the model and
  is always applied;
* INLP (Ravfogel et al. 2020) per attribute on the core's representations,
  as a post-hoc baseline.

For each configuration: task accuracy, macro-F1, balanced accuracy and
per-group fairness metrics (TPR gap RMS) of the run's own task head, and, for
every protected attribute, the leakage: the paper's probe ensemble trained on
frozen CLS representations (mean and std over seeds of the balanced accuracy)
and a linear probe. Results go to ``workdir/eval/results.json`` and a
Markdown report ``workdir/eval/report.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from moddiffy_jax import checkpoints
from moddiffy_jax.eval import inlp as inlp_lib
from moddiffy_jax.eval import metrics as metrics_lib
from moddiffy_jax.eval import probes as probes_lib
from moddiffy_jax.subnets import diffs as diffs_lib

SPLITS = ("train", "dev", "test")


def load_run_config(workdir: str | Path) -> ml_collections.ConfigDict:
    """The config a run was trained with (its ``config.json``)."""
    path = Path(workdir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {workdir} is not a run directory of this library "
            "(train one with python -m moddiffy_jax.main)."
        )
    return ml_collections.ConfigDict(json.loads(path.read_text()))


@dataclasses.dataclass
class RunArtifacts:
    """What evaluation needs from a finished run, checked for consistency."""

    core: Any
    head: Any
    diffs: dict[str, diffs_lib.SparseDiff]

    @property
    def attribute_diffs(self) -> list[str]:
        return [n for n in self.diffs if n != "task"]


def load_artifacts(workdir: str | Path) -> RunArtifacts:
    """Core, task head and diffs of a run; diffs are checked against the core.

    Raises:
      FileNotFoundError: a missing export (an unfinished or partial run).
      ValueError: a diff trained on another base (fingerprint or shapes).
    """
    export = Path(workdir) / "export"
    for name in ("core.safetensors", "task_head.safetensors"):
        if not (export / name).is_file():
            raise FileNotFoundError(
                f"{export / name} is missing: the run in {workdir} has not finished "
                "(re-run its training command to resume it) or was not trained here."
            )
    core, _ = checkpoints.load_params(export / "core.safetensors")
    head, _ = checkpoints.load_params(export / "task_head.safetensors")
    diffs = {}
    for path in sorted((export / "diffs").glob("*.safetensors")):
        # A diff from another base is refused here with a message naming both
        # fingerprints.
        diffs[path.stem] = diffs_lib.load_sparse_diff(path, base=core)
    return RunArtifacts(core=core, head=head, diffs=diffs)


def _subsets(names: Sequence[str], max_size: int | None) -> list[tuple[str, ...]]:
    top = len(names) if max_size is None else min(max_size, len(names))
    return [()] + [
        c for r in range(1, top + 1) for c in itertools.combinations(names, r)
    ]


def _label(subset: Sequence[str], weights: Mapping[str, float]) -> str:
    if not subset:
        return "core"
    parts = [n if weights.get(n, 1.0) == 1.0 else f"{weights[n]:g}*{n}" for n in subset]
    return "core+" + "+".join(parts)


class Representer:
    """CLS representations and task logits of any encoder params (jitted)."""

    def __init__(self, ctx: Any, batch_size: int):
        self.ctx = ctx
        self.batch_size = batch_size
        model = ctx.model
        self._represent = jax.jit(lambda p, b: model.represent(p, b, None, False))
        self._logits = jax.jit(lambda hp, h: model.task_logits(hp, h, None, False))

    def represent(self, params: Any, split: str) -> np.ndarray:
        from moddiffy_jax.data import eval_batches

        out = []
        for batch in eval_batches(self.ctx.data.splits[split], self.batch_size):
            inputs = {
                k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")
            }
            h = np.asarray(self._represent(params, inputs))
            out.append(h[batch["weight"] > 0])
        return np.concatenate(out)

    def predict(self, head: Any, h: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.argmax(self._logits(head, jnp.asarray(h)), -1))


def _task_metrics(ctx, rep: Representer, head, reps, splits) -> dict[str, Any]:
    out = {}
    attrs = list(ctx.data.attr_classes)
    for split in splits:
        data = ctx.data.splits[split]
        pred = rep.predict(head, reps[split])
        report = metrics_lib.task_report(
            data.task,
            pred,
            num_classes=len(ctx.data.task_classes),
            attrs={a: data.attrs[a] for a in attrs},
            attr_num_classes={a: len(ctx.data.attr_classes[a]) for a in attrs},
        )
        out[split] = report
    return out


def _leakage(ctx, reps, probe_config, *, linear: bool) -> dict[str, Any]:
    out = {}
    for attr in ctx.attributes:
        labels = {s: ctx.data.splits[s].attrs[attr] for s in SPLITS}
        n = len(ctx.data.attr_classes[attr])
        result = probes_lib.train_probe_ensemble(
            reps["train"],
            labels["train"],
            reps["dev"],
            labels["dev"],
            reps["test"],
            labels["test"],
            num_classes=n,
            config=probe_config,
        )
        summary = result.summary()
        entry = {
            "mean": summary["test_balanced_accuracy/mean"],
            "std": summary["test_balanced_accuracy/std"],
            "dev_mean": summary["dev_balanced_accuracy/mean"],
            "dev_std": summary["dev_balanced_accuracy/std"],
            "per_seed_test": [float(x) for x in result.test_balanced_accuracy],
            "best_epoch": [int(x) for x in result.best_epoch],
            "notes": list(result.notes),
            "chance": 1.0 / n,
        }
        if linear:
            lin = probes_lib.linear_probe(
                reps["train"],
                labels["train"],
                reps["dev"],
                labels["dev"],
                reps["test"],
                labels["test"],
                num_classes=n,
                tol=1e-4,
            )
            entry["linear"] = lin.summary() | {"converged": bool(lin.converged)}
        out[attr] = entry
    return out


def _row(ctx, rep, head, reps, probe_config, linear, splits) -> dict[str, Any]:
    task = _task_metrics(ctx, rep, head, reps, splits)
    row = {f"{s}_task_acc": task[s]["accuracy"] for s in splits}
    row["task"] = task
    row["leakage"] = _leakage(ctx, reps, probe_config, linear=linear)
    return row


def evaluate_run(
    workdir: str | Path,
    *,
    probe_config: probes_lib.ProbeConfig | None = None,
    weights: Mapping[str, float] | None = None,
    max_subset_size: int | None = None,
    inlp: bool = True,
    linear: bool = True,
    batch_size: int = 128,
) -> dict[str, Any]:
    """Evaluates the composition matrix of a finished run; see the module doc.

    Args:
      workdir: the run directory.
      probe_config: the attacker protocol (default: the paper's, 3 seeds).
      weights: optional weight per diff name (default 1 each).
      max_subset_size: largest number of diffs combined (default: all).
      inlp: add INLP rows (one per attribute) on the core representations.
      linear: add a linear probe to every leakage entry.
      batch_size: batch size for extracting representations.

    Returns:
      The results (also written to ``workdir/eval/results.json``).
    """
    from moddiffy_jax import train

    start = time.time()
    workdir = Path(workdir)
    config = load_run_config(workdir)
    art = load_artifacts(workdir)
    ctx = train.build_context(config)
    missing = [s for s in SPLITS if s not in ctx.data.splits]
    if missing:
        raise ValueError(
            f"The run's data has no {missing} split; leakage probes need train, dev "
            "and test (set config.data.splits)."
        )
    probe_config = probe_config or probes_lib.ProbeConfig()
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(art.attribute_diffs))
    if unknown:
        raise ValueError(
            f"Weights given for {unknown}, which are not diffs of this run "
            f"(its diffs: {art.attribute_diffs})."
        )
    evaluator = train.Evaluator(ctx)
    base = art.core
    if "task" in art.diffs:  # DiffPrun: the task diff is part of the model.
        base = evaluator.compose(art.core, [art.diffs["task"]])
    rep = Representer(ctx, batch_size)
    # The run's attribute order (as in its own results), then any other diff.
    names = [a for a in ctx.attributes if a in art.diffs]
    names += [n for n in art.attribute_diffs if n not in names]
    attr_diffs = [art.diffs[n] for n in names]
    rows: dict[str, Any] = {}
    core_reps = None
    for subset in _subsets(names, max_subset_size):
        w = [weights.get(n, 1.0) if n in subset else 0.0 for n in names]
        params = evaluator.compose(base, attr_diffs, w) if names else base
        reps = {s: rep.represent(params, s) for s in SPLITS}
        if not subset:
            core_reps = reps
        label = _label(subset, weights)
        logging.info("Evaluating %s", label)
        rows[label] = _row(
            ctx, rep, art.head, reps, probe_config, linear, ("dev", "test")
        )
    if inlp:
        for attr in ctx.attributes:
            y = {s: ctx.data.splits[s].attrs[attr] for s in SPLITS}
            fit = inlp_lib.fit_inlp(
                core_reps["train"],
                y["train"],
                core_reps["dev"],
                y["dev"],
                num_classes=len(ctx.data.attr_classes[attr]),
                tol=1e-4,
            )
            projected = {
                s: np.asarray(inlp_lib.apply_projection(core_reps[s], fit.projection))
                for s in SPLITS
            }
            row = _row(
                ctx, rep, art.head, projected, probe_config, linear, ("dev", "test")
            )
            row["inlp"] = {
                "attribute": attr,
                "directions_removed": int(fit.num_removed),
            }
            rows[f"core+INLP({attr})"] = row
    results = {
        "workdir": str(workdir),
        "method": config.method.name,
        "dataset": ctx.data.name,
        "synthetic": bool(ctx.data.synthetic),
        "attributes": list(ctx.attributes),
        "diffs": {
            n: {"nnz": int(d.nnz()), "density": float(d.density())}
            for n, d in art.diffs.items()
        },
        "weights": weights,
        "probe_config": dataclasses.asdict(probe_config),
        "composition": rows,
        "wall_time_s": time.time() - start,
    }
    out_dir = workdir / "eval"
    checkpoints.write_json_atomic(out_dir / "results.json", _jsonable(results))
    (out_dir / "report.md").write_text(format_report(results))
    return results


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        value = float(obj)
        return None if math.isnan(value) else value
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    return obj


def _fmt(mean: float | None, std: float | None = None) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "n/a"
    if std is None or (isinstance(std, float) and math.isnan(std)):
        return f"{mean:.3f}"
    return f"{mean:.3f} ± {std:.3f}"


def format_report(results: Mapping[str, Any]) -> str:
    """The composition table as Markdown (one row per configuration)."""
    attrs = results["attributes"]
    synthetic = " (SYNTHETIC data)" if results.get("synthetic") else ""
    lines = [
        f"# Composition matrix: {results['method']} on {results['dataset']}{synthetic}",
        "",
        "Task metrics use the run's task head. Leakage is the balanced accuracy of "
        "attacker probes on frozen CLS representations (test split; ensemble of "
        f"{results['probe_config']['members']} probes, mean ± std over seeds "
        f"{tuple(results['probe_config']['seeds'])}); lower is better, chance is "
        "1/#classes. `lin` is a linear probe.",
        "",
    ]
    header = ["configuration", "dev acc", "test acc", "test macro-F1"]
    for a in attrs:
        header += [f"{a} leakage", f"{a} lin", f"{a} RMS TPR gap"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for label, row in results["composition"].items():
        test = row["task"]["test"]
        cells = [
            label,
            _fmt(row["dev_task_acc"]),
            _fmt(row["test_task_acc"]),
            _fmt(test["macro_f1"]),
        ]
        for a in attrs:
            leak = row["leakage"][a]
            cells.append(_fmt(leak["mean"], leak["std"]))
            cells.append(_fmt(leak.get("linear", {}).get("test_balanced_accuracy")))
            cells.append(_fmt(test.get(f"{a}/rms_tpr_gap")))
        lines.append("| " + " | ".join(cells) + " |")
    notes = sorted(
        {
            n
            for row in results["composition"].values()
            for a in attrs
            for n in row["leakage"][a]["notes"]
        }
    )
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
