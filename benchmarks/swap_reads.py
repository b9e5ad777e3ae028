r"""The bag-of-tokens reads of every prefix of each attribute's swap groups.

Before training anything: what swapping (merging) each prefix of an
attribute's counterpart groups would cost the task and remove, read by
logistic regressions on which tokens an example holds (fit on train, read
on dev; methods/swap_budget.py), and which prefix ``swap_target`` /
``swap_max_drop`` would choose.

    python benchmarks/swap_reads.py --arg data=dwmw17 --candidates 256

Prints one table per attribute (groups as text, task accuracy, attribute
balanced accuracy, cost in points, share of the gap to the floor closed).
"""

from __future__ import annotations

import argparse


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", default="moddiffy_par")
    parser.add_argument("--arg", default="", help="config argument, e.g. data=dwmw17")
    parser.add_argument("--seed", type=int, default=0, help="config.data.seed")
    parser.add_argument("--candidates", type=int, default=64)
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--target", type=float, default=0.75)
    parser.add_argument("--max_drop", type=float, default=2.5)
    args = parser.parse_args()

    from moddiffy_jax import train
    from moddiffy_jax.config_lib import experiment_config
    from moddiffy_jax.methods import swap_budget

    arg = ",".join(x for x in (args.arg, "objective=swap") if x)
    config = experiment_config(args.method, arg)
    with config.unlocked():
        config.data.seed = args.seed
        config.method.swap_candidates = args.candidates
        config.method.swap_share = args.share
    ctx = train.build_context(config)
    text = train.swap_group_text(config, ctx.swap_groups)
    splits = ctx.data.splits
    for attr, groups in ctx.swap_groups.items():
        choice = swap_budget.choose_groups(
            splits["train"],
            splits["dev"],
            attr,
            groups,
            num_task_classes=len(ctx.data.task_classes),
            num_attr_classes=int(ctx.debias.attr_classes[attr]),
            target=args.target,
            max_drop=args.max_drop,
        )
        print(
            f"\n{attr}: {len(groups)} groups, floor {choice.floor:.3f}; "
            f"target {args.target} within {args.max_drop} points: "
            f"{choice.chosen} ({choice.reason})"
        )
        print("| groups | last group | task acc | leakage | cost (pts) | gap closed |")
        print("|---|---|---|---|---|---|")
        for r in choice.reads:
            last = " / ".join(text[attr][r.groups - 1]) if r.groups else ""
            print(
                f"| {r.groups} | {last} | {r.task_accuracy:.4f} | {r.leakage:.4f} "
                f"| {r.cost:.2f} | {r.closed:.3f} |"
            )


if __name__ == "__main__":
    main()
