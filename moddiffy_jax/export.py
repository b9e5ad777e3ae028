"""The end of a run: export the core, head and diffs, and evaluate what was exported.

Process 0 writes ``export/core.safetensors``, ``export/task_head.safetensors``
and one ``export/diffs/<name>.safetensors`` per diff the method exports
(``Method.exports``; a correction fit for a composition of diffs,
``gender+age``, goes to ``export/joint/``); every process computes the
composition table (task accuracy of the core, each diff and every larger
subset of diffs), the bias-aligned / conflicting and OOD rows, and the
method's own report.

The export is staged and lands whole, with its manifest
(:mod:`moddiffy_jax.manifest`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from moddiffy_jax import checkpoints
from moddiffy_jax.eval.during import ood_and_bias
from moddiffy_jax.eval.evaluator import composition_table
from moddiffy_jax.manifest import (  # noqa: F401 - re-exported
    MANIFEST_NAME,
    IncompleteExport,
    staged_export,
    verify_export,
    write_manifest,
)
from moddiffy_jax.methods import joint_erasure
from moddiffy_jax.subnets import diffs as diffs_lib


def export_and_evaluate(
    ctx,
    evaluator,
    workdir: Path,
    trainable,
    frozen,
    phase: str,
    reps_out: dict | None = None,
    parts_out: dict | None = None,
) -> dict:
    """Exports core, head and diffs (process 0 writes) and evaluates them.

    A finished run re-exports the same values when re-run (resume is exact),
    so replacing its own export files loses nothing. ``reps_out``, if given,
    receives the composition table's representations and ``parts_out`` its
    core's last-layer parts
    (:func:`~moddiffy_jax.eval.evaluator.composition_table`).
    """
    core, head = ctx.method.model(ctx, trainable, frozen)
    chief = jax.process_index() == 0
    fp = diffs_lib.fingerprint(core)
    sparse = ctx.method.exports(ctx, trainable, frozen, phase)
    with staged_export(workdir, fingerprint=fp, write=chief) as stage:
        diff_info, extra = _write_export(
            ctx, stage, core, head, sparse, trainable, frozen, fp, chief
        )
    splits = tuple(s for s in ("dev", "test") if s in ctx.data.splits)
    params_by_row: dict[str, Any] = {}
    rows = composition_table(
        ctx, evaluator, core, head, sparse, splits, params_by_row, reps_out, parts_out
    )
    ood = ood_and_bias(ctx, evaluator, rows, params_by_row, splits)
    if ood:
        extra["ood"] = ood
    if getattr(ctx.data, "bias_summary", None):
        extra["bias_model"] = ctx.data.bias_summary
    return {
        **extra,
        "method": ctx.method.name,
        "dataset": ctx.data.name,
        "synthetic": bool(ctx.data.synthetic),
        "attributes": list(ctx.attributes),
        "core_params": int(sum(np.size(x) for x in jax.tree.leaves(core))),
        "core_fingerprint": fp,
        "composition": rows,
        "diffs": diff_info,
    }


def _write_export(ctx, stage, core, head, sparse, trainable, frozen, fp, chief):
    """Writes the export's files into ``stage.dir``; returns (diff info, the
    method's report with paths under the final ``export/``)."""
    export = stage.dir
    meta = {"fingerprint": fp, "method": ctx.method.name}
    diff_info = {}
    if chief:
        checkpoints.save_params(
            export / "core.safetensors", core, metadata=meta, overwrite=True
        )
        checkpoints.save_params(
            export / "task_head.safetensors", head, metadata=meta, overwrite=True
        )
    for name, sd in sparse.items():
        # A correction of a composition (gender+age) goes beside the diffs.
        folder = "joint" if joint_erasure.is_joint(name) else "diffs"
        path = export / folder / f"{name}.safetensors"
        if chief:
            path.parent.mkdir(parents=True, exist_ok=True)
            diffs_lib.save_sparse_diff(path, sd, overwrite=True)
        diff_info[name] = {
            "nnz": int(sd.nnz()),
            "num_selected": int(sd.num_selected()),
            "density": float(sd.density()),
            "file_bytes": path.stat().st_size if chief else None,
            "path": str(stage.final_path(path)),
        }
    extra = ctx.method.report(ctx, trainable, frozen, export, chief)
    return diff_info, stage.final_paths(extra)
