r"""What the swaps' read promised against what the trained diffs did.

For finished runs that trained counterfactual swaps with a budget
(``swap_target > 0``, e.g. the main job's ``objective=auto``): per
attribute, the bag-of-tokens read of the chosen prefix (share of the gap
to the floor closed, task cost in points; ``results.json``'s
``swap_reads``) beside the run's own report for core + that attribute's
diff (attacker / linear probe, gap closed toward the same floor the report
prints, task points against the run's core; ``eval/results.json``), and
the ratio of the two.

    python benchmarks/swap_read_vs_trained.py RUN [RUN ...]

No training, no probes fitted: it reads the two JSON files of each run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(run: Path) -> list[dict]:
    """One row per swapped attribute of ``run``."""
    reads = json.loads((run / "results.json").read_text()).get("swap_reads") or {}
    report = json.loads((run / "eval" / "results.json").read_text())
    comp, floors = report["composition"], report["floors"]
    core = comp["core"]
    out = []
    for attr, choice in sorted(reads.items()):
        # The one-sided step where the choice took one (swap_one_sided).
        read = choice.get("one_sided") or choice["reads"][choice["chosen"]]
        diff = comp.get(f"core+{attr}")
        if diff is None:
            continue
        floor = floors[attr]["floor"]
        closed = []
        for key in ("attacker", "linear"):
            before, after = (_leakage(c["leakage"][attr], key) for c in (core, diff))
            closed.append((before - after) / (before - floor))
        cost = 100.0 * (core["test_task_acc"] - diff["test_task_acc"])
        out.append(
            {
                "run": str(run),
                "attribute": attr,
                "groups": f"{choice['chosen']} of {len(choice['reads']) - 1}"
                + (" + 1 one-sided" if choice.get("one_sided") else ""),
                "read_closed": read["closed"],
                "read_cost": read["cost"],
                "closed": closed,
                "cost": cost,
            }
        )
    return out


def _leakage(entry: dict, key: str) -> float:
    if key == "attacker":
        return float(entry["mean"])
    return float(entry["linear"]["test_balanced_accuracy"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished run dirs")
    args = parser.parse_args()
    print(
        "| run | attribute | groups | read: closed, cost | trained: closed "
        "(attacker / linear), cost | closed / read | cost - read |"
    )
    print("|---|---|---|---|---|---|---|")
    for run in args.runs:
        for r in rows(run):
            mean = sum(r["closed"]) / 2
            print(
                f"| {r['run']} | {r['attribute']} | {r['groups']} | "
                f"{r['read_closed']:.2f}, {r['read_cost']:.2f} | "
                f"{r['closed'][0]:.2f} / {r['closed'][1]:.2f}, {r['cost']:.2f} | "
                f"{mean / r['read_closed']:.2f} | {r['cost'] - r['read_cost']:+.2f} |"
            )


if __name__ == "__main__":
    main()
