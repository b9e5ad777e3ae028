r"""Where an attribute's swap diff costs the task: the test rows its swap
changes, split by whether the swap moves the core's own decision (the
"pivotal" rows, where the attribute decides the task) or not.

For each run and attribute this prints, over the rows the attribute's swap
table changes, how many are pivotal, and on each kind the share of rows
whose decision the core + diff model changes from the core's and the task
cost of those changes (points of the whole test split); and the same for the
core + diff model's decision on the twin (docs/efficacy.md, "Stop 72").

    python benchmarks/pivotal_flips.py RUN_DIR [RUN_DIR ...] [--attribute age]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np


def analyse(run: Path, attribute: str) -> list[str]:
    from moddiffy_jax import train
    from moddiffy_jax.eval import composition
    from moddiffy_jax.eval import evaluator as evaluator_lib

    config = composition.load_run_config(run)
    art = composition.load_artifacts(run)
    ctx = train.build_context(config)
    if attribute not in (ctx.swap_tables or {}):
        raise SystemExit(f"error: {run} has no swap table for {attribute!r}")
    table = np.asarray(ctx.swap_tables[attribute])
    test = ctx.data.splits["test"]
    ids = np.asarray(test.input_ids)
    twin_ids = table[ids]
    changed = np.any(twin_ids != ids, axis=-1)
    evaluator = train.Evaluator(ctx)
    params = {}
    for label, _subset, p in evaluator_lib.compositions(
        evaluator, art.core, {**art.diffs, **art.joint}, [attribute]
    ):
        params[label] = p
    y = np.asarray(test.task)
    preds = {}
    for which, split in (
        ("x", test),
        ("twin", dataclasses.replace(test, input_ids=twin_ids)),
    ):
        ctx.data.splits["test"] = split
        rep = composition.Representer(ctx, 128)
        for label, p in params.items():
            preds[label, which] = rep.predict(art.head, rep.represent(p, "test"))
    ctx.data.splits["test"] = test
    core, diff = "core", f"core+{attribute}"
    pivotal = changed & (preds[core, "x"] != preds[core, "twin"])
    n = len(y)
    lines = [
        f"{run} ({attribute}): core {np.mean(preds[core, 'x'] == y):.4f}, "
        f"core+{attribute} {np.mean(preds[diff, 'x'] == y):.4f}; "
        f"swapped rows {changed.sum()}, pivotal {pivotal.sum()}"
    ]
    for name, rows in (
        ("pivotal", pivotal),
        ("swapped, not pivotal", changed & ~pivotal),
        ("not swapped", ~changed),
    ):
        flip = rows & (preds[diff, "x"] != preds[core, "x"])
        cost = np.sum(rows & (preds[core, "x"] == y)) - np.sum(
            rows & (preds[diff, "x"] == y)
        )
        kept_twin = (
            np.mean(preds[diff, "x"][rows] != preds[diff, "twin"][rows])
            if rows.any()
            else 0
        )
        lines.append(
            f"  {name:22s} {rows.sum():5d} rows: flips {flip.sum() / max(rows.sum(), 1):.1%}, "
            f"cost {100 * cost / n:+.2f} pts; diff's decision moves with the swap on {kept_twin:.1%}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--attribute", default="age")
    args = parser.parse_args()
    for run in args.runs:
        print("\n".join(analyse(run, args.attribute)), flush=True)


if __name__ == "__main__":
    main()
