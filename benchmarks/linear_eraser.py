r"""A closed-form linear eraser on frozen representations, probed afresh.

Reads one ``<configuration>.npz`` of ``benchmarks/fresh_probe.py``'s export
(``{split}_h``, ``{split}_task``, ``{split}_<attribute>``), fits on the train
split a LEACE-form eraser per attribute (Belrose et al. 2023): whiten with
the train covariance, project out the span of the attribute groups' mean
differences (within each task class with ``conditional``, else overall),
map back. The same affine map is applied to test. Then scikit-learn probes
(logistic regression with balanced class weights; an MLP with 300 hidden
units), both on standardized representations, fit on train and scored on
test (balanced accuracy), before and after the eraser, beside the floor;
a logistic task probe says what the eraser costs the task.

    python benchmarks/linear_eraser.py runs/moddiffy_par/eval/reps/core.npz

Needs scikit-learn (not a dependency of the library). docs/efficacy.md
("Stop 20") has what it measured.
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np


def fit_eraser(h, task, attr, conditional=True, ridge=1e-3):
    """(erase, rank): ``erase(x) = x - P (x - mean)`` with P the oblique
    projection onto the attribute's mean-difference span in the whitened
    metric; ``rank`` is that span's dimension."""
    mu = h.mean(0)
    centred = h - mu
    cov = centred.T @ centred / len(h)
    cov += ridge * np.trace(cov) / len(cov) * np.eye(len(cov))
    ev, vecs = np.linalg.eigh(cov)
    whiten = vecs @ np.diag(ev**-0.5) @ vecs.T
    unwhiten = vecs @ np.diag(ev**0.5) @ vecs.T
    directions = []
    for c in np.unique(task) if conditional else [None]:
        rows = np.ones(len(h), bool) if c is None else task == c
        values = np.unique(attr[rows])
        if len(values) < 2:
            continue
        mean = h[rows].mean(0)
        for v in values:
            directions.append(whiten @ (h[rows & (attr == v)].mean(0) - mean))
    u, s, _ = np.linalg.svd(np.stack(directions, 1), full_matrices=False)
    u = u[:, s > 1e-6 * s.max()]
    proj = unwhiten @ u @ u.T @ whiten
    return (lambda x: x - (x - mu) @ proj.T), u.shape[1]


def probes(h_train, y_train, h_test, y_test, seed=0):
    """Test balanced accuracy of a fresh linear and a fresh MLP probe."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import balanced_accuracy_score
    from sklearn.neural_network import MLPClassifier
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(h_train)
    x_train, x_test = scaler.transform(h_train), scaler.transform(h_test)
    lin = LogisticRegression(class_weight="balanced", max_iter=3000)
    mlp = MLPClassifier((300,), max_iter=500, random_state=seed)
    return tuple(
        balanced_accuracy_score(y_test, m.fit(x_train, y_train).predict(x_test))
        for m in (lin, mlp)
    )


def task_probe(h_train, y_train, h_test, y_test):
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    scaler = StandardScaler().fit(h_train)
    model = LogisticRegression(max_iter=3000)
    model.fit(scaler.transform(h_train), y_train)
    return model.score(scaler.transform(h_test), y_test)


def main():
    from moddiffy_jax.eval import removal

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("npz", help="a <configuration>.npz of fresh_probe.py")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    d = np.load(args.npz)
    skip = ("train_h", "train_task", "train_task_pred")
    attrs = [k[6:] for k in d.files if k.startswith("train_") and k not in skip]
    ytr, yte = d["train_task"], d["test_task"]
    htr, hte = d["train_h"], d["test_h"]
    task0 = task_probe(htr, ytr, hte, yte)
    for a in attrs:
        atr, ate = d[f"train_{a}"], d[f"test_{a}"]
        floor = removal.leakage_floor(
            ytr,
            atr,
            yte,
            ate,
            num_task_classes=int(ytr.max()) + 1,
            num_attr_classes=int(atr.max()) + 1,
        )
        before = probes(htr, atr, hte, ate)
        for conditional in (True, False):
            erase, rank = fit_eraser(htr, ytr, atr, conditional)
            etr, ete = erase(htr), erase(hte)
            after = probes(etr, atr, ete, ate)
            print(
                f"{a} conditional={conditional} rank={rank} floor={floor:.3f} "
                f"linear {before[0]:.3f} -> {after[0]:.3f}, "
                f"MLP {before[1]:.3f} -> {after[1]:.3f}, task probe "
                f"{task0:.3f} -> {task_probe(etr, ytr, ete, yte):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
