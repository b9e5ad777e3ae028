"""Command line: analyse finished run directories.

Usage::

    python -m moddiffy_jax.analyze DIR [DIR ...] [--out OUTDIR] [--nonzero-only]
        [--split {test,dev}]

Writes per run a sparsity CSV and heatmap and the overlap between its diffs;
across several runs the overlap of same-named diffs (e.g. gender over seeds);
a task-accuracy vs leakage plot where runs have ``eval/results.json``; and a
``summary.md``. Default output: ``DIR/analysis`` for one run, ``./analysis``
for several. Prints the paths it wrote. See
:func:`moddiffy_jax.analysis.analyze_runs`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m moddiffy_jax.analyze",
        description=(
            "Sparsity, overlap and trade-off analysis of moddiffy_jax run "
            "directories (written by python -m moddiffy_jax.main)."
        ),
    )
    parser.add_argument("run_dirs", nargs="+", metavar="DIR", help="run directories")
    parser.add_argument(
        "--out",
        default=None,
        help="output directory (default: DIR/analysis for one run, ./analysis "
        "for several)",
    )
    parser.add_argument(
        "--nonzero-only",
        action="store_true",
        help="overlaps count only stored entries whose value is not 0",
    )
    parser.add_argument(
        "--split",
        choices=("test", "dev"),
        default="test",
        help="task accuracy split for the trade-off plot (default: test)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (2 for a bad run directory)."""
    args = _parser().parse_args(argv)
    from moddiffy_jax.analysis import RunError, analyze_runs

    try:
        written = analyze_runs(
            args.run_dirs,
            out=args.out,
            nonzero_only=args.nonzero_only,
            split=args.split,
        )
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
