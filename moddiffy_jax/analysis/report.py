"""The full analysis of one or several run directories: CSVs, plots, summary.

:func:`analyze_runs` is what ``python -m moddiffy_jax.analyze`` calls.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from absl import logging

from moddiffy_jax.analysis import overlap as overlap_lib
from moddiffy_jax.analysis import plots
from moddiffy_jax.analysis import sparsity as sparsity_lib
from moddiffy_jax.analysis.runs import Run, composition_points, load_run
from moddiffy_jax.analysis.tables import write_csv


def run_labels(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Short unique labels for run directories (file-name safe).

    The base name when it is unique, else as many trailing path components as
    needed (joined with ``_``), else the base name with a ``-{i}`` suffix.

    Args:
      paths: run directories.

    Returns:
      One label per path, in order.
    """
    parts = [Path(p).absolute().parts for p in paths]
    depth = max((len(x) for x in parts), default=1)
    for n in range(1, depth + 1):
        labels = ["_".join(x[-n:]).lstrip("/_") or "run" for x in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{Path(p).absolute().name}-{i}" for i, p in enumerate(paths)]


def _fmt(value: Any, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _rel(path: Path, out: Path) -> str:
    try:
        return str(path.relative_to(out))
    except ValueError:
        return str(path)


def _run_section(
    label: str,
    run: Run,
    sparsity_rows: Sequence[Mapping[str, Any]],
    overlap_rows: Sequence[Mapping[str, Any]] | None,
    overlap_note: str,
) -> list[str]:
    cfg, res = run.config, run.results or {}
    method = res.get("method") or (cfg.get("method") or {}).get("name", "?")
    dataset = res.get("dataset") or (cfg.get("data") or {}).get("name", "?")
    lines = [f"## Run `{label}`", "", f"- directory: `{run.path}`"]
    lines.append(f"- method: {method}; dataset: {dataset}")
    if res.get("synthetic"):
        lines.append("- **synthetic data**: numbers are not meaningful results")
    if res.get("attributes"):
        lines.append(f"- attributes: {', '.join(map(str, res['attributes']))}")
    lines.append(f"- core fingerprint: `{run.core_fingerprint or 'unknown'}`")
    if run.results is None:
        lines.append("- no results.json (run unfinished?)")
    lines.append(f"- metrics records: {len(run.metrics)}")
    lines.append("")
    comp = res.get("composition")
    if isinstance(comp, Mapping) and comp:
        cols = sorted({k for r in comp.values() if isinstance(r, Mapping) for k in r})
        cols = [
            c
            for c in cols
            if all(
                isinstance(r.get(c), (int, float)) or c not in r
                for r in comp.values()
                if isinstance(r, Mapping)
            )
        ]
        lines += ["Task accuracy per composition (results.json):", ""]
        lines += _md_table(
            ["configuration", *cols],
            [
                [lab, *(_fmt(r.get(c)) for c in cols)]
                for lab, r in comp.items()
                if isinstance(r, Mapping)
            ],
        )
    overall = [r for r in sparsity_rows if r["level"] == "overall"]
    diff_rows = []
    for r in overall:
        d = run.diff(r["diff"])
        if not run.core_fingerprint or not d.base_fingerprint:
            base = "unknown"
        else:
            base = "yes" if d.base_fingerprint == run.core_fingerprint else "**no**"
        diff_rows.append(
            [
                r["diff"],
                f"{r['nnz']:,}",
                f"{r['size']:,}",
                _fmt(r["percent"], ".3f"),
                f"{r['nnz'] - r['nonzero']:,}",
                base,
            ]
        )
    lines += ["Diffs:", ""]
    lines += _md_table(
        ["diff", "kept", "selected", "kept %", "stored zeros", "base = core"],
        diff_rows,
    )
    by_kind = [r for r in sparsity_rows if r["level"] == "kind"]
    kinds = sorted({r["kind"] for r in by_kind}, key=sparsity_lib.kind_sort_key)
    if kinds:
        cell = {(r["diff"], r["kind"]): r["percent"] for r in by_kind}
        lines += ["Kept % per matrix kind:", ""]
        lines += _md_table(
            ["diff", *kinds],
            [
                [r["diff"], *(_fmt(cell.get((r["diff"], k)), ".3f") for k in kinds)]
                for r in overall
            ],
        )
    if overlap_rows:
        lines += ["Overlap between the diffs of this run (all leaves):", ""]
        lines += _overlap_table(overlap_rows)
    elif overlap_note:
        lines += [overlap_note, ""]
    return lines


def _overlap_table(rows: Sequence[Mapping[str, Any]], *, diff_col=False) -> list[str]:
    total = [r for r in rows if r["level"] == "total"]
    header = ["a", "b", "shared", "Jaccard", "random Jaccard", "sign agreement"]
    if diff_col:
        header = ["diff", *header]
    body = []
    for r in total:
        row = [
            r["a"],
            r["b"],
            f"{r['intersection']:,}",
            _fmt(r["jaccard"]),
            _fmt(r["expected_jaccard"]),
            _fmt(r["sign_agreement"]),
        ]
        body.append([r["diff"], *row] if diff_col else row)
    return _md_table(header, body)


def analyze_runs(
    run_dirs: Sequence[str | os.PathLike],
    *,
    out: str | os.PathLike | None = None,
    nonzero_only: bool = False,
    split: str = "test",
) -> list[Path]:
    """Writes the sparsity, overlap and trade-off analysis of some runs.

    Files, with ``OUT`` the output directory and ``R`` = ``OUT`` for a single
    run, ``OUT/<run label>`` for several (see :func:`run_labels`):

    * ``R/sparsity.csv``: :func:`~moddiffy_jax.analysis.sparsity.sparsity_rows`
      of every diff of the run, all levels;
    * ``R/sparsity_heatmap.png``: layers x matrix kinds, one panel per diff;
    * ``R/overlap_attributes.csv``: pairwise overlap of the run's diffs, all
      levels (only if it has two or more);
    * ``OUT/overlap_runs.csv``: several runs only: for each diff name present
      in two or more runs, pairwise overlap across runs (column ``diff``);
      pairs over different leaves are skipped with a note;
    * ``OUT/sparsity_all.csv``: several runs only: all sparsity rows;
    * ``OUT/tradeoff.png``: task accuracy vs leakage from the runs'
      ``eval/results.json`` (skipped, with a logged note, when no run has
      one with leakage values);
    * ``OUT/summary.md``: a short human-readable summary.

    Args:
      run_dirs: run directories (at least one).
      out: output directory; default ``DIR/analysis`` for a single run and
        ``./analysis`` for several.
      nonzero_only: overlap counts only stored entries whose value is not 0.
      split: split whose task accuracy the trade-off plot uses (``"test"`` or
        ``"dev"``; the other is the fallback).

    Returns:
      The paths written, in the order above (summary last).

    Raises:
      RunError: if a directory is not a complete run (see
        :func:`~moddiffy_jax.analysis.runs.load_run`).
      ValueError: if ``run_dirs`` is empty.
    """
    if not run_dirs:
        raise ValueError("analyze_runs needs at least one run directory.")
    runs = [load_run(d, load_diffs=True) for d in run_dirs]
    labels = run_labels([r.path for r in runs])
    single = len(runs) == 1
    if out is None:
        out = runs[0].path / "analysis" if single else Path("analysis")
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    summary = ["# MoDDiffy run analysis", ""]
    if nonzero_only:
        summary += ["Overlaps count only stored entries with non-zero values.", ""]
    all_sparsity = []

    for label, run in zip(labels, runs, strict=True):
        rdir = out if single else out / label
        diffs = run.diffs()
        rows = [
            row
            for d in diffs.values()
            for row in sparsity_lib.sparsity_rows(d, run=label)
        ]
        all_sparsity += rows
        written.append(write_csv(rows, rdir / "sparsity.csv"))
        written.append(
            sparsity_lib.plot_sparsity_heatmap(
                diffs, rdir / "sparsity_heatmap.png", run=label
            )
        )
        ov_rows, note = None, ""
        if len(diffs) >= 2:
            try:
                ov_rows = [
                    {"run": label, **r}
                    for r in overlap_lib.pairwise_overlap(
                        list(diffs.items()),
                        levels=overlap_lib.LEVELS,
                        nonzero_only=nonzero_only,
                    )
                ]
                written.append(write_csv(ov_rows, rdir / "overlap_attributes.csv"))
            except ValueError as e:
                note = f"Overlap between the diffs skipped: {e}"
                logging.warning("Run %s: %s", label, note)
        summary += _run_section(label, run, rows, ov_rows, note)

    if not single:
        written.append(write_csv(all_sparsity, out / "sparsity_all.csv"))
        names = sorted({n for r in runs for n in r.diff_names})
        cross, notes = [], []
        for name in names:
            having = [
                (label, run.diff(name))
                for label, run in zip(labels, runs, strict=True)
                if name in run.diff_files
            ]
            if len(having) < 2:
                continue
            try:
                rows = overlap_lib.pairwise_overlap(
                    having, levels=overlap_lib.LEVELS, nonzero_only=nonzero_only
                )
            except ValueError as e:
                notes.append(f"- diff `{name}` skipped: {e}")
                logging.warning("Overlap of diff %s across runs skipped: %s", name, e)
                continue
            cross += [{"diff": name, **r} for r in rows]
        summary += ["## Across runs", ""]
        if cross:
            written.append(write_csv(cross, out / "overlap_runs.csv"))
            summary += ["Overlap of same-named diffs across runs (all leaves):", ""]
            summary += _overlap_table(cross, diff_col=True)
        else:
            summary += ["No diff name is shared by two runs with the same leaves.", ""]
        summary += notes + ([""] if notes else [])

    points = []
    for label, run in zip(labels, runs, strict=True):
        prefix = "" if single else f"{label}/"
        points += composition_points(run.eval_results, split=split, label_prefix=prefix)
    summary += ["## Trade-off", ""]
    if points:
        title = labels[0] if single else f"{len(runs)} runs"
        path = plots.plot_tradeoff(
            points, out / "tradeoff.png", title=f"Task accuracy vs leakage: {title}"
        )
        written.append(path)
        summary += [f"Task accuracy ({split}) vs leakage: `{_rel(path, out)}`", ""]
        summary += _md_table(
            ["configuration", "task acc", "leakage"],
            [
                [
                    p["label"],
                    _fmt(p["task_acc"]),
                    ", ".join(f"{a} {_fmt(v)}" for a, v in p["leakage"].items()),
                ]
                for p in points
            ],
        )
    else:
        note = (
            "No eval/results.json with composition leakage results in the given "
            "runs; trade-off plot skipped."
        )
        logging.info(note)
        summary += [note, ""]

    summary_path = out / "summary.md"
    summary += ["## Files", ""]
    summary += [f"- `{_rel(p, out)}`" for p in written]
    summary_path.write_text("\n".join(summary) + "\n")
    written.append(summary_path)
    return written
