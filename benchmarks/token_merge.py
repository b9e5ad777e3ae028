r"""Token-merge diffs on a finished run's core, scored beside its trained diffs.

For a finished run (``--run``), per attribute: rank the tokens by
``I(token present; attribute | task label)`` on the training split
(:mod:`moddiffy_jax.methods.word_rows`, at most ``--candidates`` tokens,
each at least ``--share`` of the best), read the task cost of merging each
prefix of that ranking (the run's own head; accuracy points lost on train
and dev pooled, ``--cost_splits``), and merge the longest prefix whose
cost, fitted non-decreasing, stays within ``--max_drop`` points, stopping
early at the first prefix whose dev leakage (a class-balanced logistic
regression fit on train) reaches the attribute's dev floor
(:func:`moddiffy_jax.methods.token_merge.choose_count`). The merge diffs
are written to ``<run>/token_merge/<attribute>.safetensors`` (ordinary
sparse diff files on the core). Then the core, core + each merge diff and
core + all of them are probed as ``benchmarks/sk_probes.py`` does
(scikit-learn linear / MLP probes fit on train, test balanced accuracy, gap
closed toward the floor), with ``--test_examples`` as there.

    python benchmarks/token_merge.py --run runs/moddiffy_par --max_drop 1.0

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

import sk_probes  # noqa: E402

SPLITS = ("train", "test")
COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _with_table(params, table):
    from moddiffy_jax.methods.word_rows import WORD_TABLE
    from moddiffy_jax.subnets import selection

    flat = dict(selection.flatten(params))
    flat[WORD_TABLE] = table
    return selection.unflatten(flat)


def _accuracy(evaluator, params, head, splits) -> float:
    """Task accuracy over several splits pooled (example-weighted)."""
    hits = n = 0
    for s in splits:
        data = evaluator.ctx.data.splits[s]
        pred = evaluator.predict(params, head, data)
        hits += int(np.sum(pred == np.asarray(data.task)))
        n += len(pred)
    return hits / n


def _dev_probe(rep, params, ctx, attr) -> float:
    """Dev balanced accuracy of a class-balanced logistic regression on the
    standardized representations, fit on train."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import balanced_accuracy_score
    from sklearn.preprocessing import StandardScaler

    h_train, h_dev = rep.represent(params, "train"), rep.represent(params, "dev")
    y_train = np.asarray(ctx.data.splits["train"].attrs[attr])
    y_dev = np.asarray(ctx.data.splits["dev"].attrs[attr])
    scaler = StandardScaler().fit(h_train)
    model = LogisticRegression(class_weight="balanced", max_iter=3000)
    model.fit(scaler.transform(h_train), y_train)
    return float(balanced_accuracy_score(y_dev, model.predict(scaler.transform(h_dev))))


def merge_run(run: Path, args) -> dict:
    import jax.numpy as jnp

    from moddiffy_jax import train
    from moddiffy_jax.eval import composition, removal
    from moddiffy_jax.methods import token_merge, word_rows
    from moddiffy_jax.models import text as text_lib
    from moddiffy_jax.subnets import diff_files, selection

    config = composition.load_run_config(run)
    if args.test_examples:
        if config.data.source != "synthetic":
            raise SystemExit("--test_examples regenerates a synthetic test split.")
        with config.unlocked():
            config.data.synthetic.num_test = args.test_examples
    art = composition.load_artifacts(run)
    ctx = train.build_context(config)
    evaluator = train.Evaluator(ctx)
    rep = composition.Representer(ctx, 128)
    core = art.core
    table = np.asarray(selection.flatten(core)[word_rows.WORD_TABLE])
    cost_splits = args.cost_splits.split(",")
    core_acc = _accuracy(evaluator, core, art.head, cost_splits)
    tokenizer = text_lib.load_tokenizer_for(config.model)
    out_dir = run / "token_merge"
    out_dir.mkdir(exist_ok=True)
    summary, diffs = {}, {}
    for attr in ctx.attributes:
        ranked = word_rows.attribute_tokens(
            ctx.data.splits["train"],
            [attr],
            args.candidates,
            args.share,
            table.shape[0],
        )[attr]
        target = token_merge.merge_target(core, ranked)

        def merged(ids, target=target):
            t = table.copy()
            t[ids] = target
            return _with_table(core, jnp.asarray(t))

        def drop(ids):
            return 100.0 * (
                core_acc - _accuracy(evaluator, merged(ids), art.head, cost_splits)
            )

        def leak(ids, attr=attr):
            p = merged(ids)
            return _dev_probe(rep, p, ctx, attr)

        train, dev = ctx.data.splits["train"], ctx.data.splits["dev"]
        floor = removal.leakage_floor(
            np.asarray(train.task),
            np.asarray(train.attrs[attr]),
            np.asarray(dev.task),
            np.asarray(dev.attrs[attr]),
            num_task_classes=int(np.max(train.task)) + 1,
            num_attr_classes=int(np.max(train.attrs[attr])) + 1,
        )
        counts = [c for c in COUNTS if c < len(ranked)] + [len(ranked)]
        tolerance = token_merge.balanced_accuracy_se(floor, dev.attrs[attr])
        probe = {"leakage": leak, "floor": floor, "tolerance": tolerance}
        probe = {} if args.no_floor_stop else probe
        k, read = token_merge.choose_count(ranked, drop, args.max_drop, counts, **probe)
        tokens = word_rows.describe({attr: ranked[:k]}, tokenizer)[attr] if k else []
        print(
            f"{attr}: {len(ranked)} candidates; dev floor {floor:.3f} "
            f"(+ {tolerance:.3f}); merged {k}: {tokens}"
        )
        for rec in read:
            print("   ", {key: round(v, 3) for key, v in rec.items()}, flush=True)
        summary[attr] = {
            "candidates": len(ranked),
            "dev_floor": floor,
            "tolerance": tolerance,
            "read": read,
            "merged": k,
            "tokens": tokens,
        }
        if k:
            diff = token_merge.merge_diff(
                core, ranked[:k], target, name=attr, info={"max_drop": args.max_drop}
            )
            diff_files.save_sparse_diff(
                out_dir / f"{attr}.safetensors", diff, overwrite=True
            )
            diffs[attr] = diff
    reps = out_dir / (
        f"reps_test{args.test_examples}" if args.test_examples else "reps"
    )
    reps.mkdir(exist_ok=True)
    names = list(diffs)
    subsets = [()] + [(n,) for n in names] + ([tuple(names)] if len(names) > 1 else [])
    for subset in subsets:
        params = evaluator.compose(core, [diffs[n] for n in subset]) if subset else core
        arrays = {}
        for s in SPLITS:
            split = ctx.data.splits[s]
            h = rep.represent(params, s)
            arrays[f"{s}_h"] = h
            arrays[f"{s}_task"] = np.asarray(split.task)
            arrays[f"{s}_task_pred"] = rep.predict(art.head, h)
            for a in ctx.attributes:
                arrays[f"{s}_{a}"] = np.asarray(split.attrs[a])
        np.savez(
            reps / ("core" + "".join(f"+merge_{n}" for n in subset) + ".npz"), **arrays
        )
    res = sk_probes.probe_reps(reps)
    res["merge"] = summary
    (reps / "probes.json").write_text(json.dumps(res, indent=1))
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True)
    parser.add_argument("--max_drop", type=float, default=1.0, help="dev task points")
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--test_examples", type=int, default=0)
    parser.add_argument(
        "--cost_splits",
        default="train,dev",
        help="splits the task cost of a merge is read on, pooled (dev alone: "
        "500 examples on the main job, about 0.6 points of noise per read)",
    )
    parser.add_argument(
        "--no_floor_stop",
        action="store_true",
        help="merge the longest prefix within budget, without the dev probe",
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for r in args.run:
        sk_probes.print_probes(r, merge_run(Path(r), args))


if __name__ == "__main__":
    main()
