r"""Where a run's linear attribute information sits: the groups' Mahalanobis
separation, by eigen-direction of the within-group covariance.

For the core and each core + diff of a finished run, on the train split's
CLS vectors: the pooled covariance within the (task, attribute) cells, its
eigen-directions, and per attribute the squared Mahalanobis distance of the
attribute groups' means within each task class (weighted by the class's
share). Printed per configuration and attribute:

* ``maha2``: that distance (what a fresh linear probe separates);
* ``top_k``: the share of it in the ``k`` largest-variance directions (a
  diff that moves the information into low-variance directions keeps it
  for a probe);
* ``ridge_r``: the distance with a ridge of ``r`` times the eigenvalues'
  geometric mean (what a whitening with that shrinkage sees).

Usage::

    python benchmarks/separation_spectrum.py runs/moddiffy_par [--out x.json]

docs/efficacy.md ("Stop 13") reports it for the stop-12 default and the
running erasure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import ml_collections
import numpy as np


def spectrum(x: np.ndarray, task: np.ndarray, attr: np.ndarray) -> dict:
    """Separation of a binary ``attr``'s groups in ``x`` [N, D] (see above)."""
    cells = task.astype(np.int64) * (int(attr.max()) + 1) + attr
    centred = x.copy()
    for c in np.unique(cells):
        centred[cells == c] -= x[cells == c].mean(0)
    cov = centred.T @ centred / (len(x) - len(np.unique(cells)))
    eigval, eigvec = np.linalg.eigh(cov)
    eigval = np.maximum(eigval, 1e-12)
    per_dir = np.zeros(len(eigval))
    for t in np.unique(task):
        m = task == t
        if min(np.sum(m & (attr == 0)), np.sum(m & (attr == 1))) < 5:
            continue
        diff = x[m & (attr == 1)].mean(0) - x[m & (attr == 0)].mean(0)
        per_dir += m.mean() * (diff @ eigvec) ** 2 / eigval
    total = float(per_dir.sum())
    order = np.argsort(-eigval)
    cum = np.cumsum(per_dir[order])
    geo = float(np.exp(np.mean(np.log(eigval))))
    return {
        "maha2": total,
        **{f"top_{k}": float(cum[min(k, len(cum)) - 1] / total) for k in (32, 64, 128)},
        **{
            f"ridge_{r}": float(np.sum(per_dir * eigval / (eigval + r * geo)))
            for r in (0.01, 0.1, 1.0)
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from moddiffy_jax import train as train_lib
    from moddiffy_jax.eval import composition

    config = ml_collections.ConfigDict(
        json.loads((args.workdir / "config.json").read_text())
    )
    ctx = train_lib.build_context(config)
    art = composition.load_artifacts(args.workdir)
    evaluator = train_lib.Evaluator(ctx)
    rep = composition.Representer(ctx, 128)
    names = art.attribute_diffs
    train = ctx.data.splits["train"]
    out = {}
    for sub in [()] + [(n,) for n in names]:
        weights = [1.0 if n in sub else 0.0 for n in names]
        params = evaluator.compose(art.core, [art.diffs[n] for n in names], weights)
        label = "core" + "".join("+" + n for n in sub)
        x = np.asarray(rep.represent(params, "train"), np.float64)
        for a in ctx.attributes:
            if len(ctx.data.attr_classes[a]) != 2:
                continue
            row = spectrum(x, np.asarray(train.task), np.asarray(train.attrs[a]))
            out[f"{label}/{a}"] = row
            print(label, a, json.dumps({k: round(v, 3) for k, v in row.items()}))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
