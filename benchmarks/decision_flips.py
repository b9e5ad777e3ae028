r"""Where a finished run's diffs move the task decision (test split).

For each composition (core + each diff, core + all) this prints its test
accuracy, the share of test rows whose predicted class differs from the
core's ("flips"), and, for each attribute with a swap table (the
counterfactual swap recipe, ``objective=swap`` / ``auto``), the flips and
the task cost (points of the whole test split) on three kinds of rows: the
rows that attribute's swap changes (its chosen counterpart words occur),
rows with only other candidate words of the attribute (the ranked groups
the budget did not choose), and rows with none of its candidate words. A
diff that removes the attribute has a reason to move decisions in the
first two; in the third, flips are collateral (docs/efficacy.md, "Stop
48").

    python benchmarks/decision_flips.py RUN_DIR [RUN_DIR ...]

Exports the run's representations to ``RUN/eval/reps/`` first if they are
not there (benchmarks/fresh_probe.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fresh_probe  # noqa: E402


def flips(run: Path) -> list[str]:
    """The report's lines for one run."""
    from moddiffy_jax import train
    from moddiffy_jax.eval import composition

    out = fresh_probe.reps_dir(run)
    if not (out / "core.npz").exists():
        fresh_probe.export_run(run)
    ctx = train.build_context(composition.load_run_config(run))
    if not ctx.swap_tables:
        raise SystemExit(f"error: {run} trained without swap tables; nothing to split")
    ids = np.asarray(ctx.data.splits["test"].input_ids)
    core = np.load(out / "core.npz")
    y, base = core["test_task"], core["test_task_pred"]
    splits = {}
    for a, table in ctx.swap_tables.items():
        swapped = np.any(table[ids] != ids, axis=-1)
        ranked = (ctx.swap_ranked or {}).get(a, [])
        words = np.concatenate([np.ravel(g) for g in ranked]) if ranked else []
        candidate = np.isin(ids, np.asarray(words, ids.dtype)).any(-1)
        splits[a] = {
            f"{a} swapped": swapped,
            f"{a} other candidates": candidate & ~swapped,
            f"{a} no candidate": ~candidate & ~swapped,
        }
    lines = [f"{run}: core test accuracy {(base == y).mean():.4f}"]
    for path in sorted(out.glob("core+*.npz"), key=lambda p: (len(p.stem), p.stem)):
        if "merge(" in path.stem:
            continue
        pred = np.load(path)["test_task_pred"]
        parts = [
            f"{path.stem}: accuracy {(pred == y).mean():.4f}, flips "
            f"{100 * (pred != base).mean():.1f}%"
        ]
        for rows in splits.values():
            for label, m in rows.items():
                lost = ((base == y) & m).sum() - ((pred == y) & m).sum()
                parts.append(
                    f"{label} ({m.sum()} rows): flips "
                    f"{100 * (pred != base)[m].mean():.1f}%, cost "
                    f"{100 * lost / len(y):+.2f} pts"
                )
        lines.append("  " + "; ".join(parts))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    for run in parser.parse_args().runs:
        print("\n".join(flips(run)))


if __name__ == "__main__":
    main()
