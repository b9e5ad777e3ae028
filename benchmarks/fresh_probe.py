r"""The same fresh probes on our runs and on the reference's saved CLS vectors.

A side-by-side efficacy table needs one measuring stick. This script reads
frozen CLS representations of every configuration (core, core + each diff,
core + all diffs with their correction where the run fitted one, core +
each token-merge diff the run's report built) and, per protected
attribute, fits on train and scores on test:

* ``lin``: a class-balanced logistic-regression probe (the library's
  L-BFGS fit, :func:`moddiffy_jax.eval.probes.linear_probe`);
* ``mlp``: the paper's attacker, an ensemble of 5 two-layer MLP probes with
  early stopping on dev (:func:`moddiffy_jax.eval.probes.train_probe_ensemble`),
  mean over probe seeds;
* ``conv``: an MLP trained until its dev balanced accuracy stops improving
  (:func:`moddiffy_jax.eval.probes.converged_mlp_probe`, the report's
  ``mlp`` column; the attacker stops far from convergence and misses what
  a linear eraser leaves nonlinear); ``--noconverged`` leaves it out;

next to the floor (what the gold task label alone gives,
:func:`moddiffy_jax.eval.removal.leakage_floor`), chance, and the share of the
core-to-floor gap each configuration closes.

Inputs, one per column group:

* ``--npz DIR``: a directory of ``<configuration>.npz`` files with arrays
  ``{split}_h``, ``{split}_task``, ``{split}_<attr>`` and ``{split}_task_pred``
  for split in train/dev/test (what ``benchmarks/reference/
  run_reference_moddiffy_par.py`` writes for the official code);
* ``--run DIR``: a finished run of this library (exports its configurations'
  representations to ``DIR/eval/reps/`` in the same format first, with the
  task-only references ``core decision`` and ``core+bottleneck`` of
  :mod:`moddiffy_jax.eval.bottleneck` and the ``core+discriminant(...)`` rows
  of :mod:`moddiffy_jax.eval.discriminant`).

Usage::

    python benchmarks/fresh_probe.py --name ours --run runs/moddiffy_par \
        --name reference --npz /work/ref/out/synthetic --out docs/results/x.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

SPLITS = ("train", "dev", "test")


def reps_dir(run: Path, test_examples: int = 0) -> Path:
    """Where :func:`export_run` writes: ``eval/reps``, or ``eval/reps_test<N>``
    for a run probed on a larger synthetic test split."""
    return run / "eval" / (f"reps_test{test_examples}" if test_examples else "reps")


def export_run(run: Path, test_examples: int = 0) -> Path:
    """Writes ``run/eval/reps/<configuration>.npz`` for a finished run.

    ``test_examples > 0`` (synthetic data only) regenerates the test split
    with that many examples; each split has its own random stream, so the
    train and dev splits (and every trained weight) stay as they were.
    """
    from moddiffy_jax import train
    from moddiffy_jax.eval import bottleneck, composition, discriminant
    from moddiffy_jax.eval import evaluator as evaluator_lib
    from moddiffy_jax.subnets import diff_files

    run = Path(run)
    config = composition.load_run_config(run)
    if test_examples:
        if config.data.source != "synthetic":
            raise SystemExit(
                f"--test_examples regenerates a synthetic test split; {run} "
                f"trained on {config.data.source!r}."
            )
        with config.unlocked():
            config.data.synthetic.num_test = test_examples
    art = composition.load_artifacts(run)
    ctx = train.build_context(config)
    evaluator = train.Evaluator(ctx)
    rep = composition.Representer(ctx, 128)
    names = [a for a in ctx.attributes if a in art.diffs]
    out = reps_dir(run, test_examples)
    out.mkdir(parents=True, exist_ok=True)
    # The rows the run's own table has (a task diff in every row, a
    # composition's correction where it was fitted: evaluator.compositions),
    # less the partial compositions of three or more diffs.
    for label, subset, params in evaluator_lib.compositions(
        evaluator, art.core, {**art.diffs, **art.joint}, names
    ):
        if 1 < len(subset) < len(names):
            continue
        np.savez(out / f"{label}.npz", **split_arrays(ctx, rep, params, art.head))
    # The task-only references (eval/bottleneck.py), from the core's vectors.
    core = np.load(out / "core.npz")
    task_only = config.eval.get("task_only")
    max_drop = task_only.max_drop if task_only is not None else None
    built = bottleneck.task_only_reps(
        ctx,
        rep,
        art.head,
        {s: core[f"{s}_h"] for s in SPLITS},
        **({} if max_drop is None else {"max_drop": max_drop}),
    )
    # The discriminant rows (eval/discriminant.py), likewise.
    # Written into weights as the run's report writes them (default 'auto').
    options = dict(config.eval.get("discriminant") or {})
    options.pop("enabled", None)
    options.setdefault("weights", "auto")
    built.update(
        discriminant.discriminant_reps(
            ctx,
            rep,
            art.head,
            {s: core[f"{s}_h"] for s in SPLITS},
            core_params=art.core,
            **options,
        )
    )
    for label, (reps, predict, _) in built.items():
        arrays = {k: core[k] for k in core.files}
        for s in SPLITS:
            arrays[f"{s}_h"] = reps[s]
            arrays[f"{s}_task_pred"] = np.asarray(predict(reps[s]))
        np.savez(out / f"{label}.npz", **arrays)
    # The token-merge diffs the run's report built (token_merge/), each alone.
    for path in sorted((run / "token_merge").glob("*.safetensors")):
        merge = diff_files.load_sparse_diff(path, base=art.core)
        params = evaluator.compose(art.core, [merge])
        arrays = split_arrays(ctx, rep, params, art.head)
        np.savez(out / f"core+merge({path.stem}).npz", **arrays)
    return out


def split_arrays(ctx, rep, params, head, splits=SPLITS) -> dict:
    """Per split: CLS vectors (``<split>_h``), task labels and the head's
    predictions, and each attribute's labels, for one configuration."""
    arrays = {}
    for s in splits:
        split = ctx.data.splits[s]
        h = rep.represent(params, s)
        arrays[f"{s}_h"] = h
        arrays[f"{s}_task"] = np.asarray(split.task)
        arrays[f"{s}_task_pred"] = rep.predict(head, h)
        for a in ctx.attributes:
            arrays[f"{s}_{a}"] = np.asarray(split.attrs[a])
    return arrays


def probe_dir(directory: Path, seeds: tuple[int, ...], converged: bool = True) -> dict:
    from moddiffy_jax.eval import probes, removal

    files = sorted(directory.glob("core*.npz"), key=lambda p: (len(p.stem), p.stem))
    if not files or files[0].stem != "core":
        raise SystemExit(f"error: {directory} has no core.npz")
    core = np.load(files[0])
    attrs = sorted(
        k[len("train_") :]
        for k in core.files
        if k.startswith("train_")
        and k not in ("train_h", "train_task", "train_task_pred")
    )
    n_task = int(max(core["train_task"].max(), core["test_task"].max())) + 1
    result = {"attributes": attrs, "rows": {}, "floors": {}}
    for a in attrs:
        n = int(max(core[f"train_{a}"].max(), core[f"test_{a}"].max())) + 1
        result["floors"][a] = {
            "floor": removal.leakage_floor(
                core["train_task"],
                core[f"train_{a}"],
                core["test_task"],
                core[f"test_{a}"],
                num_task_classes=n_task,
                num_attr_classes=n,
            ),
            "chance": 1.0 / n,
        }
    config = probes.ProbeConfig(seeds=seeds)
    for f in files:
        d = np.load(f)
        row = {"test_acc": float(np.mean(d["test_task_pred"] == d["test_task"]))}
        for a in attrs:
            n = int(result["floors"][a]["chance"] ** -1 + 0.5)
            args = [d[f"{s}_{x}"] for s in SPLITS for x in ("h", a)]
            lin = probes.linear_probe(
                *args, num_classes=n, tol=1e-4, class_weighted=True
            )
            row[f"{a}/lin"] = float(lin.test_balanced_accuracy)
            if f.stem == "core decision":
                # As in the report: on a few logits the early-stopped
                # attacker is no reader (composition.NO_ATTACKER_NOTE).
                row[f"{a}/mlp"] = row[f"{a}/mlp_std"] = None
            else:
                mlp = probes.train_probe_ensemble(*args, num_classes=n, config=config)
                summary = mlp.summary()
                row[f"{a}/mlp"] = float(summary["test_balanced_accuracy/mean"])
                row[f"{a}/mlp_std"] = float(summary["test_balanced_accuracy/std"])
            if converged:
                conv = probes.converged_mlp_probe(*args, num_classes=n)
                row[f"{a}/conv"] = conv["test_balanced_accuracy"]
        result["rows"][f.stem] = row
    core_row = result["rows"]["core"]
    for row in result["rows"].values():
        for a in attrs:
            floor = result["floors"][a]["floor"]
            for kind in ("lin", "mlp", "conv"):
                if f"{a}/{kind}" not in row:
                    continue
                if row[f"{a}/{kind}"] is None:
                    row[f"{a}/{kind}_gap_closed"] = None
                    continue
                gap = core_row[f"{a}/{kind}"] - floor
                row[f"{a}/{kind}_gap_closed"] = (
                    (core_row[f"{a}/{kind}"] - row[f"{a}/{kind}"]) / gap
                    if gap > 1e-9
                    else None
                )
    return result


def markdown(results: dict) -> str:
    """One table per source: task accuracy, then per attribute the
    attacker (mean ± std over probe seeds), the linear probe and, where
    measured, the converged MLP, and the share of the core-to-floor gap
    each closes; the floor and chance below."""
    lines = []
    for name, res in results.items():
        attrs = res["attributes"]
        first = next(iter(res["rows"].values()))
        kinds = [k for k in ("mlp", "lin", "conv") if f"{attrs[0]}/{k}" in first]
        heads = {"mlp": "attacker", "lin": "lin", "conv": "converged mlp"}
        cols = ["test acc"]
        for a in attrs:
            cols += [f"{a} {heads[k]}" for k in kinds]
            cols.append(f"{a} gap closed " + " / ".join(heads[k] for k in kinds))
        lines += [f"### {name}", "", "| configuration | " + " | ".join(cols) + " |"]
        lines.append("|---" * (len(cols) + 1) + "|")
        for label, row in res["rows"].items():
            cells = [f"{row['test_acc']:.3f}"]
            for a in attrs:
                for k in kinds:
                    if row[f"{a}/{k}"] is None:
                        cells.append("n/a")
                        continue
                    v = f"{row[f'{a}/{k}']:.3f}"
                    cells.append(
                        f"{v} ± {row[f'{a}/mlp_std']:.3f}" if k == "mlp" else v
                    )
                g = [row.get(f"{a}/{k}_gap_closed") for k in kinds]
                cells.append(" / ".join("n/a" if x is None else f"{x:.2f}" for x in g))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        for what in ("floor", "chance"):
            cells = [""]
            for a in attrs:
                v = res["floors"][a][what]
                cells += [f"{v:.3f}"] * len(kinds) + [""]
            lines.append(f"| *{what}* | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", action="append", required=True)
    parser.add_argument("--run", action="append", default=[])
    parser.add_argument("--npz", action="append", default=[])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", help="JSON file for the results")
    parser.add_argument(
        "--noconverged",
        action="store_true",
        help="leave out the converged MLP probe (the slowest of the three)",
    )
    args = parser.parse_args()
    sources = [("run", Path(r)) for r in args.run] + [
        ("npz", Path(d)) for d in args.npz
    ]
    if len(sources) != len(args.name):
        raise SystemExit("error: give one --name per --run/--npz, in that order")
    seeds = tuple(int(s) for s in args.seeds.split(","))
    results = {}
    for name, (kind, path) in zip(args.name, sources, strict=True):
        directory = export_run(path) if kind == "run" else path
        results[name] = probe_dir(directory, seeds, not args.noconverged)
    text = markdown(results)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
        Path(args.out).with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
