"""Sanity probe of the reference's saved CLS vectors (run_reference_moddiffy_par.py).

For each ``<config>.npz`` in ``--out_dir``: a fresh scikit-learn
``LogisticRegression(class_weight="balanced", max_iter=2000)`` is fit on
``train_h`` -> attribute and scored by balanced accuracy on ``test_h``; the
reference task head's own test accuracy comes from ``test_task_pred``. The
floor row fits the same probe on the one-hot gold task label alone.

Usage: python benchmarks/reference/probe_reference.py --out_dir /work/ref/out/synthetic
"""

import argparse
import json
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import balanced_accuracy_score


def probe(x_tr, y_tr, x_te, y_te):
    clf = LogisticRegression(class_weight="balanced", max_iter=2000)
    clf.fit(x_tr, y_tr)
    return float(balanced_accuracy_score(y_te, clf.predict(x_te)))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", default="/work/ref/out/synthetic")
    p.add_argument("--attrs", default=None, help="default: from info.json")
    a = p.parse_args()
    out = Path(a.out_dir)
    info = json.loads((out / "info.json").read_text())
    attrs = a.attrs.split(",") if a.attrs else info["driver_args"]["attrs"].split(",")
    configs = ["core"] + [f"core+{k}" for k in attrs]
    if len(attrs) > 1:
        configs.append("core+" + "+".join(attrs))
    rows = {}
    for name in configs:
        d = np.load(out / f"{name}.npz")
        row = {"test_task_acc": float(np.mean(d["test_task_pred"] == d["test_task"]))}
        for k in attrs:
            row[f"{k}_bacc"] = probe(
                d["train_h"], d[f"train_{k}"], d["test_h"], d[f"test_{k}"]
            )
        rows[name] = row
    d = np.load(out / "core.npz")
    n_cls = int(max(d["train_task"].max(), d["test_task"].max())) + 1
    onehot = lambda y: np.eye(n_cls)[y]
    rows["floor (gold task label)"] = {
        f"{k}_bacc": probe(
            onehot(d["train_task"]),
            d[f"train_{k}"],
            onehot(d["test_task"]),
            d[f"test_{k}"],
        )
        for k in attrs
    }
    cols = ["test_task_acc"] + [f"{k}_bacc" for k in attrs]
    print("| configuration | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, r in rows.items():
        print(
            f"| {name} | "
            + " | ".join(f"{r[c]:.3f}" if c in r else "" for c in cols)
            + " |"
        )
    (out / "probe_check.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
