"""Analysis of finished runs: sparsity, overlap of diffs, trade-off plots.

Reads run directories back from what they hold (:func:`load_run`), so it needs
neither the data nor the pretrained model. The command line is
``python -m moddiffy_jax.analyze DIR [DIR ...]``.
"""

from moddiffy_jax.analysis.overlap import (
    check_same_leaves,
    overlap_rows,
    pairwise_overlap,
)
from moddiffy_jax.analysis.plots import plot_tradeoff
from moddiffy_jax.analysis.report import analyze_runs, run_labels
from moddiffy_jax.analysis.runs import (
    Run,
    RunError,
    composition_points,
    load_run,
    read_metrics,
)
from moddiffy_jax.analysis.sparsity import (
    KINDS,
    density_grid,
    kind_of,
    layer_of,
    leaf_rows,
    param_of,
    plot_sparsity_heatmap,
    sparsity_rows,
)
from moddiffy_jax.analysis.tables import write_csv

__all__ = [
    "KINDS",
    "Run",
    "RunError",
    "analyze_runs",
    "check_same_leaves",
    "composition_points",
    "density_grid",
    "kind_of",
    "layer_of",
    "leaf_rows",
    "load_run",
    "overlap_rows",
    "pairwise_overlap",
    "param_of",
    "plot_sparsity_heatmap",
    "plot_tradeoff",
    "read_metrics",
    "run_labels",
    "sparsity_rows",
    "write_csv",
]
