r"""What the main job's SYNTHETIC data allows: Bayes task accuracy and leakage.

The synthetic generator (``moddiffy_jax/data/synthetic.py``) plants three
cues of the gold task label y: the text's task word t (right with
probability 1 - label_noise), a gender marker g and an age marker a (each
follows y with the attribute's correlation, present with the marker
probability). This script draws a large sample from that process with the
main job's settings and prints, for representations that hold some of the
cues exactly (a lookup table per cue combination, the best any probe or
head can do):

* the Bayes task accuracy (what a head reading that representation can
  reach);
* each attribute's leakage: the best balanced accuracy of predicting the
  attribute's value from it (the attacker's metric, at its optimum).

Rows: all cues (what the core may learn), each attribute left out, the
gold label alone (the report's floor), and the cues kept only through the
Bayes decision y*(t, g, a) (a representation that holds the task word,
the other attribute and the decision: the decision uses the attribute, the
representation holds nothing more of it).

    python benchmarks/synthetic_bayes.py

Numbers are of the SYNTHETIC process, not of a trained model.
"""

from __future__ import annotations

import argparse

import numpy as np


def sample(n, rng, corr, label_noise, marker_prob):
    y = rng.integers(0, 2, n)
    t = np.where(rng.random(n) < label_noise, 1 - y, y)
    values, seen = {}, {}
    for name in ("gender", "age"):  # the generator's draw order
        value = np.where(rng.random(n) < corr[name], y, rng.integers(0, 2, n))
        present = rng.random(n) < marker_prob
        values[name], seen[name] = value, np.where(present, value, 2)
    return y, t, values, seen


def _cells(columns):
    key = np.zeros(len(columns[0]), np.int64)
    for c in columns:
        key = key * 4 + c
    return np.unique(key, return_inverse=True)[1]


def decide(columns, target, balanced=False):
    """The best prediction of ``target`` per cell of ``columns`` (balanced:
    the rule that maximises balanced accuracy)."""
    cells = _cells(columns)
    n_cells = cells.max() + 1
    ones = np.bincount(cells, weights=target, minlength=n_cells)
    count = np.bincount(cells, minlength=n_cells)
    rate = ones / np.maximum(count, 1)
    if balanced:
        p = target.mean()
        choose = rate / p > (1 - rate) / (1 - p)
    else:
        choose = rate > 0.5
    return choose[cells].astype(int)


def balanced_accuracy(pred, target):
    return 0.5 * ((pred[target == 0] == 0).mean() + (pred[target == 1] == 1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2_000_000)
    parser.add_argument("--gender_corr", type=float, default=0.8)
    parser.add_argument("--age_corr", type=float, default=0.5)
    parser.add_argument("--label_noise", type=float, default=0.1)
    parser.add_argument("--marker_prob", type=float, default=0.9)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    corr = {"gender": args.gender_corr, "age": args.age_corr}
    y, t, values, seen = sample(args.n, rng, corr, args.label_noise, args.marker_prob)
    g, a = seen["gender"], seen["age"]
    decision = decide([t, g, a], y)
    rows = [
        ("t, g, a (all cues)", [t, g, a]),
        ("t, a (gender left out)", [t, a]),
        ("t, g (age left out)", [t, g]),
        ("t (both left out)", [t]),
        ("y (gold label: the floor)", [y]),
        ("t, a, y*(t, g, a)", [t, a, decision]),
        ("t, g, y*(t, g, a)", [t, g, decision]),
        ("t, y*(t, g, a)", [t, decision]),
    ]
    print("| representation holds | task accuracy | gender leakage | age leakage |")
    print("|---|---|---|---|")
    for label, cols in rows:
        acc = np.mean(decide(cols, y) == y)
        leak = [
            balanced_accuracy(decide(cols, values[n], balanced=True), values[n])
            for n in ("gender", "age")
        ]
        print(f"| {label} | {acc:.3f} | {leak[0]:.3f} | {leak[1]:.3f} |")


if __name__ == "__main__":
    main()
