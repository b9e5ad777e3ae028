"""Command line: analyse finished run directories.

Usage::

    python -m moddiffy_jax.analyze DIR [DIR ...] [--out=OUTDIR] [--nonzero_only]
        [--split=test|dev]

Writes per run a sparsity CSV and heatmap and the overlap between its diffs;
across several runs the overlap of same-named diffs (e.g. gender over seeds);
a task-accuracy vs leakage plot where runs have ``eval/results.json``; and a
``summary.md``. Default output: ``DIR/analysis`` for one run, ``./analysis``
for several. Prints the paths it wrote. Flags are absl flags, as for
``moddiffy_jax.main``. See :func:`moddiffy_jax.analysis.analyze_runs`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from moddiffy_jax.evaluate import parse

FLAGS = flags.FlagValues()
flags.DEFINE_string(
    "out",
    None,
    "Output directory (default: DIR/analysis for one run, ./analysis for several).",
    flag_values=FLAGS,
)
flags.DEFINE_bool(
    "nonzero_only",
    False,
    "Overlaps count only stored entries whose value is not 0.",
    flag_values=FLAGS,
)
flags.DEFINE_enum(
    "split",
    "test",
    ["test", "dev"],
    "Task accuracy split for the trade-off plot.",
    flag_values=FLAGS,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (2 for a bad run directory or flag)."""
    try:
        run_dirs = parse(argv, FLAGS)
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not run_dirs:
        print("error: give one or more run directories", file=sys.stderr)
        return 2
    from moddiffy_jax.analysis import RunError, analyze_runs

    try:
        written = analyze_runs(
            run_dirs, out=FLAGS.out, nonzero_only=FLAGS.nonzero_only, split=FLAGS.split
        )
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
