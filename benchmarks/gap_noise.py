r"""How precisely a test split can measure "share of the gap closed".

The efficacy bar reads ``(core - diff) / (core - floor)`` of a probe's test
balanced accuracy. When the gap ``core - floor`` is a few points (the main
job's gender: 0.97 against a floor of 0.91) the test split's sampling alone
moves that share by a lot. For a finished run whose representations
``benchmarks/sk_probes.py`` (or ``fresh_probe.py``) exported, this fits the
scikit-learn linear probe of ``sk_probes.py`` once per configuration on the
train split, then resamples the test examples with replacement (one paired
draw for the core, each configuration and the floor) and prints the
bootstrap mean and standard deviation of each attribute's leakage and of
the gap closed. The probe is fitted once, so this is the test split's share
of the noise only, not the probe's or the training seed's.

    python benchmarks/gap_noise.py --run runs/moddiffy_par [--draws 2000]
        [--test_examples 5000]

Needs scikit-learn (not a dependency of the library).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _balanced_accuracy(y, pred, draws_idx, num_classes):
    """Balanced accuracy of ``pred`` on each resample (rows of draws_idx)."""
    y, pred = y[draws_idx], pred[draws_idx]
    recalls = []
    for c in range(num_classes):
        in_class = y == c
        n = in_class.sum(1)
        hit = (in_class & (pred == c)).sum(1)
        recalls.append(np.where(n > 0, hit / np.maximum(n, 1), np.nan))
    return np.nanmean(np.stack(recalls), 0)


def _floor_predictions(train_task, train_a, test_task, num_attr):
    """The floor's classifier: the attribute the gold task label alone makes
    most likely under balanced weighting (eval.removal.leakage_floor)."""
    counts = np.zeros((int(train_task.max()) + 1, num_attr))
    np.add.at(counts, (train_task, train_a), 1.0)
    p_y_given_a = counts / np.maximum(counts.sum(0, keepdims=True), 1.0)
    return p_y_given_a.argmax(1)[test_task]


def gap_noise(run: Path, draws: int, seed: int = 0, test_examples: int = 0) -> dict:
    import fresh_probe
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from moddiffy_jax.eval import removal

    reps = fresh_probe.reps_dir(run, test_examples)
    files = sorted(reps.glob("core*.npz"), key=lambda p: (len(p.stem), p.stem))
    if not files:
        raise SystemExit(
            f"{reps} has no core*.npz: run benchmarks/sk_probes.py --run {run} "
            f"--test_examples {test_examples} first."
        )
    core = np.load(files[0])
    skip = ("train_h", "train_task", "train_task_pred")
    attrs = sorted(
        k[6:] for k in core.files if k.startswith("train_") and k not in skip
    )
    n_test = core["test_task"].shape[0]
    idx = np.random.default_rng(seed).integers(0, n_test, size=(draws, n_test))
    out = {}
    for a in attrs:
        k = int(core[f"train_{a}"].max()) + 1
        y = core[f"test_{a}"]
        floor_pred = _floor_predictions(
            core["train_task"], core[f"train_{a}"], core["test_task"], k
        )
        floor_full = removal.leakage_floor(
            core["train_task"],
            core[f"train_{a}"],
            core["test_task"],
            y,
            num_task_classes=int(core["train_task"].max()) + 1,
            num_attr_classes=k,
        )
        floor = _balanced_accuracy(y, floor_pred, idx, k)
        leak = {}
        for f in files:
            d = np.load(f)
            scaler = StandardScaler().fit(d["train_h"])
            lin = LogisticRegression(class_weight="balanced", max_iter=3000)
            lin.fit(scaler.transform(d["train_h"]), d[f"train_{a}"])
            pred = lin.predict(scaler.transform(d["test_h"]))
            leak[f.stem] = _balanced_accuracy(y, pred, idx, k)
        rows = {}
        for label, values in leak.items():
            gap = leak["core"] - floor
            closed = (leak["core"] - values) / np.where(np.abs(gap) > 1e-9, gap, np.nan)
            rows[label] = {
                "leakage_mean": float(np.mean(values)),
                "leakage_std": float(np.std(values)),
                "closed_mean": float(np.nanmean(closed)),
                "closed_std": float(np.nanstd(closed)),
            }
        out[a] = {
            "floor_full_split": float(floor_full),
            "floor_bootstrap": [float(np.mean(floor)), float(np.std(floor))],
            "gap_mean": float(np.mean(leak["core"] - floor)),
            "gap_std": float(np.std(leak["core"] - floor)),
            "minority_test_examples": int(np.bincount(y, minlength=k).min()),
            "rows": rows,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument(
        "--test_examples",
        type=int,
        default=0,
        help="read the representations sk_probes.py exported for a larger test split",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for r in args.run:
        res = gap_noise(Path(r), args.draws, test_examples=args.test_examples)
        print(f"## {r}  ({args.draws} bootstrap draws of the test split, linear probe)")
        for a, v in res.items():
            print(
                f"{a}: floor {v['floor_full_split']:.3f} "
                f"(bootstrap {v['floor_bootstrap'][0]:.3f} ± {v['floor_bootstrap'][1]:.3f}), "
                f"gap {v['gap_mean']:.3f} ± {v['gap_std']:.3f}, "
                f"smallest class {v['minority_test_examples']} test examples"
            )
            for label, row in v["rows"].items():
                print(
                    f"  {label:18s} leakage {row['leakage_mean']:.3f} ± "
                    f"{row['leakage_std']:.3f}  closed {row['closed_mean']:+.2f} ± "
                    f"{row['closed_std']:.2f}"
                )


if __name__ == "__main__":
    main()
