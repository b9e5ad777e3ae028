r"""How much of each attribute a finished run's core holds through its task
decision, and what a linear erasure that keeps the decision leaves.

For the core's representations (``RUN/eval/reps/core.npz``, exported first
if missing; benchmarks/fresh_probe.py) this prints, per attribute, beside
the core's leakage, the floor (the gold task label alone) and chance:

* ``via decision``: the leakage of the core's own predicted class (the
  best balanced accuracy a predictor of the attribute from that class alone
  reaches on test, fit on train: the floor's computation with the core's
  decisions in place of the gold labels);
* ``via logit``: the leakage of a logistic task head refit on the training
  representations, its logit cut at 20 training quantiles (each bin
  predicts the attribute's class-balanced majority there);
* ``erased k``: the representations with ``k`` directions per attribute
  removed, each the weight of a class-balanced logistic probe of the
  attribute fit on what is left (INLP, Ravfogel et al. 2020), every one
  orthogonal to the refit head's weight, so the head's decisions do not
  change; read by a fresh linear probe and the MLP attacker ensemble
  (the library's probes, as fresh_probe.py's).

A decision that leaks near the floor says the gap lies in what the
representation holds beside the decision: removal that kept the decision
would cost no task accuracy (docs/efficacy.md, "Stop 49"). Where the MLP
attacker still reads the attribute after a linear erasure, that
information is not in a few linear directions.

    python benchmarks/decision_leakage.py RUN_DIR [RUN_DIR ...] [--erase 8,96]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fresh_probe  # noqa: E402

SPLITS = ("train", "dev", "test")


def _binned(z_train, a_train, z_test, bins: int = 20) -> np.ndarray:
    """Each test row's attribute class: the class-balanced majority among
    the training rows in its quantile bin of the score ``z``."""
    edges = np.quantile(z_train, np.linspace(0.0, 1.0, bins + 1)[1:-1])
    b_train, b_test = np.digitize(z_train, edges), np.digitize(z_test, edges)
    classes = np.unique(a_train)
    weight = {c: 1.0 / np.mean(a_train == c) for c in classes}
    choice = np.zeros(bins, np.int64)
    for b in range(bins):
        inside = a_train[b_train == b]
        if inside.size:
            choice[b] = max(classes, key=lambda c: weight[c] * np.sum(inside == c))
    return choice[b_test]


def _projector(directions: list[np.ndarray], width: int) -> np.ndarray:
    """I minus the projection onto the span of ``directions[1:]`` made
    orthogonal to ``directions[0]`` (the head's weight, kept)."""
    q, _ = np.linalg.qr(np.stack(directions, 1))
    return np.eye(width) - q[:, 1:] @ q[:, 1:].T


def report(run: Path, erase: tuple[int, ...], seeds: tuple[int, ...]) -> list[str]:
    from moddiffy_jax.eval import metrics, probes, removal

    out = fresh_probe.reps_dir(run)
    if not (out / "core.npz").exists():
        fresh_probe.export_run(run)
    d = np.load(out / "core.npz")
    h = {s: np.asarray(d[f"{s}_h"], np.float64) for s in SPLITS}
    mean, std = h["train"].mean(0), h["train"].std(0) + 1e-6
    h = {s: (x - mean) / std for s, x in h.items()}
    attrs = sorted(
        k[len("train_") :]
        for k in d.files
        if k.startswith("train_")
        and k not in ("train_h", "train_task", "train_task_pred")
    )
    n_task = int(max(d["train_task"].max(), d["test_task"].max())) + 1
    head = probes.linear_probe(
        h["train"], d["train_task"], h["dev"], d["dev_task"], h["test"],
        d["test_task"], num_classes=n_task, tol=1e-4,
    )  # fmt: skip
    w = np.asarray(head.kernel, np.float64)
    weight = (w[:, 1] - w[:, 0]) if n_task == 2 else w[:, 0]
    z = {s: h[s] @ weight for s in SPLITS}
    lines = [
        f"{run}: core test accuracy "
        f"{np.mean(d['test_task_pred'] == d['test_task']):.4f}, refit head "
        f"{head.test_accuracy:.4f}"
    ]
    config = probes.ProbeConfig(seeds=seeds)
    for a in attrs:
        n = int(max(d[f"train_{a}"].max(), d[f"test_{a}"].max())) + 1
        kw = {"num_task_classes": n_task, "num_attr_classes": n}
        floor = removal.leakage_floor(
            d["train_task"], d[f"train_{a}"], d["test_task"], d[f"test_{a}"], **kw
        )
        decided = removal.leakage_floor(
            d["train_task_pred"], d[f"train_{a}"], d["test_task_pred"],
            d[f"test_{a}"], **kw,
        )  # fmt: skip
        logit = metrics.balanced_accuracy(
            d[f"test_{a}"], _binned(z["train"], d[f"train_{a}"], z["test"]), n
        )
        parts = [f"floor {floor:.3f}", f"chance {1 / n:.3f}"]
        parts += [f"via decision {decided:.3f}", f"via logit {logit:.3f}"]
        directions, done = [weight / np.linalg.norm(weight)], 0
        for k in (0, *erase):
            while done < k:
                p = _projector(directions, weight.size)
                fit = probes.linear_probe(
                    h["train"] @ p, d[f"train_{a}"], h["dev"] @ p, d[f"dev_{a}"],
                    h["test"] @ p, d[f"test_{a}"], num_classes=n, tol=1e-4,
                    class_weighted=True,
                )  # fmt: skip
                v = np.asarray(fit.kernel, np.float64)
                v = (v[:, 1] - v[:, 0]) if n == 2 else v[:, 0]
                directions.append(p @ v / max(np.linalg.norm(p @ v), 1e-12))
                done += 1
            p = _projector(directions, weight.size)
            args = [x for s in SPLITS for x in (h[s] @ p, d[f"{s}_{a}"])]
            lin = probes.linear_probe(
                *args, num_classes=n, tol=1e-4, class_weighted=True
            )
            mlp = probes.train_probe_ensemble(*args, num_classes=n, config=config)
            kept = np.mean(
                np.sign(h["test"] @ p @ weight) == np.sign(h["test"] @ weight)
            )
            name = "core" if k == 0 else f"erased {k}"
            parts.append(
                f"{name} {lin.test_balanced_accuracy:.3f} / "
                f"{mlp.summary()['test_balanced_accuracy/mean']:.3f}"
                + (f" (head decisions kept {kept:.4f})" if k else "")
            )
        lines.append(f"  {a}: " + "; ".join(parts))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--erase", default="8,96", help="directions per attribute")
    parser.add_argument("--seeds", default="0", help="MLP attacker probe seeds")
    args = parser.parse_args()
    erase = tuple(sorted(int(k) for k in args.erase.split(",") if k.strip()))
    seeds = tuple(int(s) for s in args.seeds.split(","))
    for run in args.runs:
        print("\n".join(report(run, erase, seeds)), flush=True)


if __name__ == "__main__":
    main()
