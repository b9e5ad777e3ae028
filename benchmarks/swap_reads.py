r"""The bag-of-tokens reads of every prefix of each attribute's swap groups.

Before training anything: what swapping (merging) each prefix of an
attribute's counterpart groups would cost the task and remove, read by
logistic regressions on which tokens an example holds (fit on train, read
on dev; methods/swap_budget.py), and which prefix ``swap_target`` /
``swap_max_drop`` would choose.

    python benchmarks/swap_reads.py --arg data=dwmw17 --candidates 256

Prints one table per attribute (groups as text, task accuracy, attribute
balanced accuracy, cost in points, share of the gap to the floor closed).
``--one_sided`` adds the attribute's filler tokens and the one-sided steps
read beside the choice (methods/one_sided.py; ``swap_one_sided``), and
the choice with them.
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
    parser.add_argument("--one_sided", action="store_true")
    args = parser.parse_args()

    from moddiffy_jax import train
    from moddiffy_jax.config_lib import experiment_config
    from moddiffy_jax.methods import one_sided, swap_budget

    arg = ",".join(x for x in (args.arg, "objective=swap") if x)
    config = experiment_config(args.method, arg)
    with config.unlocked():
        config.data.seed = args.seed
        config.method.swap_candidates = args.candidates
        config.method.swap_share = args.share
        config.method.swap_target = 0.0  # every group, read below
    ctx = train.build_context(config)
    text = train.swap_group_text(config, ctx.swap_groups)
    splits = ctx.data.splits
    for attr, groups in ctx.swap_groups.items():
        fillers = None
        if args.one_sided:
            fillers = one_sided.attribute_fillers(
                splits["train"],
                attr,
                groups,
                list(ctx.data.attr_classes),
                args.candidates,
                args.share,
            )
        choice = swap_budget.choose_groups(
            splits["train"],
            splits["dev"],
            attr,
            groups,
            num_task_classes=len(ctx.data.task_classes),
            num_attr_classes=int(ctx.debias.attr_classes[attr]),
            target=args.target,
            max_drop=args.max_drop,
            fillers=fillers,
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
        if fillers is not None:
            _print_one_sided(config, attr, choice, fillers, train.swap_group_text)


def _print_one_sided(config, attr, choice, fillers, as_text):
    """The fillers and the one-sided steps read (after ``groups`` whole
    groups, the word hidden), and what the choice took."""
    words = as_text(config, {attr: [fillers]})[attr][0] if len(fillers) else []
    print(f"\nfillers: {' / '.join(words) or 'none (no one-sided step)'}")
    if not choice.half_reads:
        return
    print(
        "| groups, then | word hidden | task acc | leakage | cost (pts) | gap closed |"
    )
    print("|---|---|---|---|---|---|")
    for h in choice.half_reads:
        word = as_text(config, {attr: [[h.word]]})[attr][0][0]
        print(
            f"| {h.groups} | {word} | {h.task_accuracy:.4f} | {h.leakage:.4f} "
            f"| {h.cost:.2f} | {h.closed:.3f} |"
        )
    taken = choice.one_sided
    print(
        f"chosen: {choice.chosen} groups"
        + (
            f" and {as_text(config, {attr: [[taken.word]]})[attr][0][0]} one-sided"
            if taken
            else ""
        )
        + f" ({choice.reason})"
    )


if __name__ == "__main__":
    main()
