r"""Token-merge diffs on a finished run's core: built, written and probed.

For a finished run (``--run``), per attribute: rank the tokens by
``I(token present; attribute | task label)`` on the training split
(:mod:`moddiffy_jax.methods.word_rows`, at most ``--candidates`` tokens,
each at least ``--share`` of the best), read the task cost of merging each
prefix of that ranking (the run's own head; accuracy points lost on train
(at most ``--select_train``) and dev pooled), and merge the longest prefix whose
cost, fitted non-decreasing, stays within ``--max_drop`` points, stopping
early at the first prefix whose dev leakage (a class-balanced logistic
regression fit on train) comes within its standard error of the
attribute's dev floor
(:func:`moddiffy_jax.methods.token_merge.choose_count`). The merge diffs
are written to ``<run>/token_merge/<attribute>.safetensors`` (ordinary
sparse diff files on the core). Then the core, core + each merge diff and
core + all of them (with ``--with_trained`` also the run's own diff of each
attribute, alone and plus its merge) are probed as ``benchmarks/sk_probes.py`` does
(scikit-learn linear / MLP probes fit on train, test balanced accuracy, gap
closed toward the floor), with ``--test_examples`` as there.

    python benchmarks/token_merge.py --run runs/moddiffy_par --max_drop 1.5

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
import sk_probes  # noqa: E402

from moddiffy_jax.methods import token_merge as token_merge_lib  # noqa: E402

SPLITS = ("train", "test")


def _probe(h_train, y_train, h_dev, y_dev, num_classes) -> float:
    """Dev balanced accuracy of a class-balanced logistic regression on the
    standardized representations, fit on train (scikit-learn's, as the
    stop-28 numbers in docs/efficacy.md were selected with)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import balanced_accuracy_score
    from sklearn.preprocessing import StandardScaler

    del num_classes  # read from the labels
    scaler = StandardScaler().fit(h_train)
    model = LogisticRegression(class_weight="balanced", max_iter=3000)
    model.fit(scaler.transform(h_train), np.asarray(y_train))
    return float(
        balanced_accuracy_score(
            np.asarray(y_dev), model.predict(scaler.transform(h_dev))
        )
    )


def merge_run(run: Path, args) -> dict:
    from moddiffy_jax import train
    from moddiffy_jax.eval import composition
    from moddiffy_jax.methods import token_merge
    from moddiffy_jax.models import text as text_lib
    from moddiffy_jax.subnets import diff_files

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
    choices = token_merge.build_merges(
        core,
        ctx.data.splits["train"],
        ctx.data.splits["dev"],
        {a: len(ctx.data.attr_classes[a]) for a in ctx.attributes},
        rep.represent_split,
        lambda h: rep.predict(art.head, h),
        max_drop=args.max_drop,
        candidates=args.candidates,
        share=args.share,
        select_train=args.select_train,
        floor_stop=not args.no_floor_stop,
        leakage_probe=None if args.library_probe else _probe,
        order=args.order,
        target=args.target,
        every_size=not args.coarse_sizes,
    )
    tokenizer = text_lib.load_tokenizer_for(config.model)
    out_dir = run / ("token_merge" + (f"_{args.tag}" if args.tag else ""))
    out_dir.mkdir(exist_ok=True)
    summary, diffs = {}, {}
    for attr, choice in choices.items():
        summary[attr] = choice.summary(tokenizer)
        print(
            f"{attr}: {len(choice.ranked)} candidates; dev floor {choice.floor:.3f} "
            f"(+ {choice.tolerance:.3f}); merged {choice.merged}: "
            f"{summary[attr]['tokens']}"
        )
        for rec in choice.read:
            print("   ", {key: round(v, 3) for key, v in rec.items()}, flush=True)
        if choice.diff is not None:
            diff_files.save_sparse_diff(
                out_dir / f"{attr}.safetensors", choice.diff, overwrite=True
            )
            diffs[attr] = choice.diff
    reps = out_dir / (
        f"reps_test{args.test_examples}" if args.test_examples else "reps"
    )
    reps.mkdir(exist_ok=True)
    names = list(diffs)
    subsets = [()] + [(n,) for n in names] + ([tuple(names)] if len(names) > 1 else [])
    rows = {
        "core" + "".join(f"+merge_{n}" for n in subset): [diffs[n] for n in subset]
        for subset in subsets
    }
    if args.with_trained:  # the run's own diff of each attribute, then its merge
        for n in names:
            if n in art.diffs:
                rows[f"core+{n}"] = [art.diffs[n]]
                rows[f"core+{n}+merge_{n}"] = [art.diffs[n], diffs[n]]
    for label, parts in rows.items():
        params = evaluator.compose(core, parts) if parts else core
        arrays = fresh_probe.split_arrays(ctx, rep, params, art.head, SPLITS)
        np.savez(reps / f"{label}.npz", **arrays)
    res = sk_probes.probe_reps(reps)
    res["merge"] = summary
    (reps / "probes.json").write_text(json.dumps(res, indent=1))
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True)
    parser.add_argument(
        "--max_drop",
        type=float,
        default=1.5,
        help="task points a merge may cost, read on train and dev pooled",
    )
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--test_examples", type=int, default=0)
    parser.add_argument(
        "--select_train",
        type=int,
        default=2000,
        help="training examples the selection reads (task cost pooled with dev, "
        "and the dev probe's fit)",
    )
    parser.add_argument(
        "--no_floor_stop",
        action="store_true",
        help="merge the longest prefix within budget, without the dev probe",
    )
    parser.add_argument(
        "--with_trained",
        action="store_true",
        help="also probe the run's own diff of each attribute, alone and "
        "with that attribute's merge diff added",
    )
    parser.add_argument(
        "--order",
        default="counterparts",
        choices=token_merge_lib.ORDERS,
        help="candidate order (token_merge.build_merges' order)",
    )
    parser.add_argument(
        "--coarse_sizes",
        action="store_true",
        help="read the prefix sizes of token_merge.COUNTS only, not every size",
    )
    parser.add_argument(
        "--library_probe",
        action="store_true",
        help="select with the library's dev probe (as the main job does), "
        "not scikit-learn's",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=0.75,
        help="share of the dev gap to the floor at which merging stops",
    )
    parser.add_argument("--tag", default="", help="suffix of the output folder")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for r in args.run:
        sk_probes.print_probes(r, merge_run(Path(r), args))


if __name__ == "__main__":
    main()
