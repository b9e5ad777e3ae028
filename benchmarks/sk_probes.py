r"""Scikit-learn probes of a finished run's configurations: the independent check.

For a finished run (``--run``) this exports the frozen CLS vectors of the
core, core + each diff, core + all diffs and core + each token-merge diff
the run's report built (``benchmarks/fresh_probe.py``'s
``eval/reps/<configuration>.npz``, skipped when already there), then per
attribute fits scikit-learn probes on train and scores them on test
(``benchmarks/linear_eraser.py``'s ``probes``: logistic regression with
balanced class weights and an MLP with 300 hidden units, both on
standardized representations; balanced accuracy). It prints, per
configuration, the task accuracy of the run's own head, each attribute's
linear / MLP leakage and the share of the core-to-floor gap closed, and
writes them to ``eval/sk_probes.json``. Several ``--run`` directories
(training seeds) are also summarised as mean ± std.

    python benchmarks/sk_probes.py --run runs/moddiffy_par

Needs scikit-learn (not a dependency of the library).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fresh_probe  # noqa: E402
import linear_eraser  # noqa: E402


def probe_run(run: Path, test_examples: int = 0) -> dict:
    reps = fresh_probe.reps_dir(run, test_examples)
    if not (reps / "core.npz").exists():
        fresh_probe.export_run(run, test_examples)
    return probe_reps(reps)


def probe_reps(reps: Path) -> dict:
    """Probes every ``core*.npz`` of a representation directory (``core.npz``
    is the reference row)."""
    from moddiffy_jax.eval import removal

    files = sorted(reps.glob("core*.npz"), key=lambda p: (len(p.stem), p.stem))
    core = np.load(files[0])
    skip = ("train_h", "train_task", "train_task_pred")
    attrs = sorted(
        k[6:] for k in core.files if k.startswith("train_") and k not in skip
    )
    n_task = int(core["train_task"].max()) + 1
    floors = {
        a: removal.leakage_floor(
            core["train_task"],
            core[f"train_{a}"],
            core["test_task"],
            core[f"test_{a}"],
            num_task_classes=n_task,
            num_attr_classes=int(core[f"train_{a}"].max()) + 1,
        )
        for a in attrs
    }
    rows = {}
    for f in files:
        d = np.load(f)
        row = {"test_acc": float(np.mean(d["test_task_pred"] == d["test_task"]))}
        for a in attrs:
            lin, mlp = linear_eraser.probes(
                d["train_h"], d[f"train_{a}"], d["test_h"], d[f"test_{a}"]
            )
            row[f"{a}/lin"], row[f"{a}/mlp"] = float(lin), float(mlp)
        rows[f.stem] = row
    for row in rows.values():
        row["task_change_points"] = 100 * (row["test_acc"] - rows["core"]["test_acc"])
        for a in attrs:
            for kind in ("lin", "mlp"):
                gap = rows["core"][f"{a}/{kind}"] - floors[a]
                row[f"{a}/{kind}_closed"] = (
                    (rows["core"][f"{a}/{kind}"] - row[f"{a}/{kind}"]) / gap
                    if gap > 1e-9
                    else None
                )
    return {"attributes": attrs, "floors": floors, "rows": rows}


def _fmt(x):
    return "n/a" if x is None else f"{x:.2f}"


def print_probes(title: str, res: dict) -> None:
    print(
        f"## {title}  floors: "
        + ", ".join(f"{a} {v:.3f}" for a, v in res["floors"].items())
    )
    for label, row in res["rows"].items():
        cells = [f"acc {row['test_acc']:.3f} ({row['task_change_points']:+.1f})"]
        for a in res["attributes"]:
            cells.append(
                f"{a} {row[f'{a}/lin']:.3f} / {row[f'{a}/mlp']:.3f} "
                f"closed {_fmt(row[f'{a}/lin_closed'])} / {_fmt(row[f'{a}/mlp_closed'])}"
            )
        print(f"{label:24s} " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True)
    parser.add_argument(
        "--test_examples",
        type=int,
        default=0,
        help="synthetic runs: score on a fresh test split of this many examples "
        "(the run's own: 500; see benchmarks/gap_noise.py for why more)",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    results = {}
    for r in args.run:
        res = probe_run(Path(r), args.test_examples)
        name = (
            f"sk_probes_test{args.test_examples}" if args.test_examples else "sk_probes"
        )
        (Path(r) / "eval" / f"{name}.json").write_text(json.dumps(res, indent=1))
        results[r] = res
        print_probes(r, res)
    if len(results) > 1:
        print("## mean ± std over runs")
        first = next(iter(results.values()))
        for label in first["rows"]:
            cells = []
            keys = ["task_change_points"] + [
                f"{a}/{k}_closed" for a in first["attributes"] for k in ("lin", "mlp")
            ]
            for key in keys:
                vals = [
                    res["rows"][label][key]
                    for res in results.values()
                    if res["rows"].get(label, {}).get(key) is not None
                ]
                if vals:
                    cells.append(f"{key} {np.mean(vals):+.2f} ± {np.std(vals):.2f}")
            print(f"{label:18s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
