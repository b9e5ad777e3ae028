"""Where a sparse diff keeps its entries: per layer, per weight-matrix kind.

Parameter paths are those of :mod:`moddiffy_jax.models.bert`, e.g.
``encoder/layer_3/attention/self/query/kernel``. Each leaf is classified by

* layer: ``"embeddings"``, ``"layer_0"`` .. ``"layer_{n-1}"``, ``"pooler"``
  or ``"other"`` (:func:`layer_of`);
* kind: the weight matrix it belongs to, one of :data:`KINDS`
  (:func:`kind_of`), kernels and biases of one dense layer sharing a kind;
* param: the last path component, ``"kernel"``, ``"bias"``, ``"scale"``,
  ``"embedding"`` (:func:`param_of`).

:func:`sparsity_rows` aggregates the kept entries at several levels (the
MoDDiffy paper's Table 5 reports the kept fraction per matrix kind),
:func:`plot_sparsity_heatmap` draws layers x kinds.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moddiffy_jax.subnets.diffs import SparseDiff

# Matrix kinds in display order (heatmap columns).
KINDS = (
    "word_embeddings",
    "position_embeddings",
    "token_type_embeddings",
    "query",
    "key",
    "value",
    "attention_output",
    "intermediate",
    "output",
    "layernorm",
    "adapter",
    "pooler",
    "other",
)

# (kind, regex searched in the path); the first match wins.
_KIND_RULES = (
    ("layernorm", r"(^|/)LayerNorm/"),
    ("word_embeddings", r"(^|/)word_embeddings/"),
    ("position_embeddings", r"(^|/)position_embeddings/"),
    ("token_type_embeddings", r"(^|/)token_type_embeddings/"),
    ("query", r"/self/query/"),
    ("key", r"/self/key/"),
    ("value", r"/self/value/"),
    ("attention_output", r"/attention/output/dense/"),
    ("intermediate", r"/intermediate/dense/"),
    ("adapter", r"/adapter/"),
    ("output", r"(^|/)layer_\d+/output/dense/"),
    ("pooler", r"(^|/)pooler/"),
)

# Aggregation levels of sparsity_rows: level name -> grouping columns.
LEVELS = {
    "overall": (),
    "layer": ("layer",),
    "kind": ("kind",),
    "param": ("param",),
    "kind_param": ("kind", "param"),
    "layer_kind": ("layer", "kind"),
}

ALL = "all"

_LAYER_RE = re.compile(r"(?:^|/)layer_(\d+)/")


def layer_of(path: str) -> str:
    """The layer a parameter path belongs to.

    Args:
      path: a "/"-joined parameter path.

    Returns:
      ``"layer_{i}"`` for paths containing ``layer_{i}/`` (e.g.
      ``encoder/layer_3/...``), ``"embeddings"`` / ``"pooler"`` for paths
      starting with those, else ``"other"``.
    """
    m = _LAYER_RE.search(path)
    if m:
        return f"layer_{int(m.group(1))}"
    head = path.split("/", 1)[0]
    if head in ("embeddings", "pooler"):
        return head
    return "other"


def kind_of(path: str) -> str:
    """The weight-matrix kind of a parameter path, one of :data:`KINDS`."""
    for kind, pattern in _KIND_RULES:
        if re.search(pattern, path):
            return kind
    return "other"


def param_of(path: str) -> str:
    """The parameter type: the last path component (``kernel``, ``bias``, ...)."""
    return path.rsplit("/", 1)[-1]


def layer_sort_key(layer: str) -> tuple[int, int, str]:
    """Orders layers as embeddings, layer_0, layer_1, ..., pooler, other."""
    if layer == "embeddings":
        return (0, 0, layer)
    m = re.fullmatch(r"layer_(\d+)", layer)
    if m:
        return (1, int(m.group(1)), layer)
    if layer == "pooler":
        return (2, 0, layer)
    return (3, 0, layer)


def kind_sort_key(kind: str) -> tuple[int, str]:
    """Orders kinds as in :data:`KINDS`, unknown ones last (by name)."""
    return (KINDS.index(kind) if kind in KINDS else len(KINDS), kind)


def leaf_rows(diff: SparseDiff) -> list[dict[str, Any]]:
    """One row per selected leaf of ``diff``.

    Args:
      diff: the sparse diff.

    Returns:
      Rows (in leaf order) with ``path``, ``layer``, ``kind``, ``param``,
      ``size`` (entries of the leaf), ``nnz`` (stored entries) and
      ``nonzero`` (stored entries whose value is not 0; pruning to an exact
      budget can store zeros).
    """
    rows = []
    for p, shape in diff.shapes:
        values = np.asarray(diff.values[p])
        rows.append(
            {
                "path": p,
                "layer": layer_of(p),
                "kind": kind_of(p),
                "param": param_of(p),
                "size": math.prod(shape),
                "nnz": int(values.shape[0]),
                "nonzero": int(np.count_nonzero(values.astype(np.float32))),
            }
        )
    return rows


def sparsity_rows(
    diff: SparseDiff,
    *,
    run: str = "",
    levels: Sequence[str] = tuple(LEVELS),
) -> list[dict[str, Any]]:
    """Kept fraction of a diff, aggregated over layers, kinds and param types.

    Args:
      diff: the sparse diff.
      run: label of the run, copied into every row.
      levels: aggregation levels, keys of :data:`LEVELS`: ``overall``,
        ``layer``, ``kind``, ``param``, ``kind_param`` and ``layer_kind``.

    Returns:
      Tidy rows with ``run``, ``diff`` (``diff.name``), ``level``, ``layer``,
      ``kind``, ``param`` (:data:`ALL` where the level aggregates over it),
      ``size``, ``nnz``, ``nonzero``, ``density`` (``nnz / size``, the kept
      fraction of that group), ``percent`` (``100 * density``) and ``share``
      (``nnz / diff.nnz()``, the part of the budget spent there). Levels come
      in the given order; groups within a level in layer / kind order.

    Raises:
      ValueError: for an unknown level (the message lists the valid ones).
    """
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown:
        raise ValueError(f"Unknown levels {unknown}; valid: {', '.join(LEVELS)}.")
    leaves = leaf_rows(diff)
    total_nnz = sum(r["nnz"] for r in leaves)
    rows = []
    for level in levels:
        keys = LEVELS[level]
        groups: dict[tuple[str, ...], dict[str, int]] = {}
        for r in leaves:
            g = groups.setdefault(
                tuple(r[k] for k in keys), {"size": 0, "nnz": 0, "nonzero": 0}
            )
            for c in ("size", "nnz", "nonzero"):
                g[c] += r[c]

        def order(key, keys=keys):
            out = []
            for k, v in zip(keys, key, strict=True):
                if k == "layer":
                    out.append(layer_sort_key(v))
                elif k == "kind":
                    out.append(kind_sort_key(v))
                else:
                    out.append((0, v))
            return out

        for key in sorted(groups, key=order):
            g = groups[key]
            named = dict(zip(keys, key, strict=True))
            density = g["nnz"] / g["size"] if g["size"] else math.nan
            rows.append(
                {
                    "run": run,
                    "diff": diff.name,
                    "level": level,
                    "layer": named.get("layer", ALL),
                    "kind": named.get("kind", ALL),
                    "param": named.get("param", ALL),
                    "size": g["size"],
                    "nnz": g["nnz"],
                    "nonzero": g["nonzero"],
                    "density": density,
                    "percent": 100.0 * density,
                    "share": g["nnz"] / total_nnz if total_nnz else math.nan,
                }
            )
    return rows


def density_grid(
    diff: SparseDiff,
) -> tuple[list[str], list[str], np.ndarray]:
    """Kept percentage per (layer, kind): the heatmap's data.

    Args:
      diff: the sparse diff.

    Returns:
      ``(layers, kinds, grid)``: the layers and kinds present in the diff (in
      display order) and a float64 ``[len(layers), len(kinds)]`` array of
      percentages, NaN where the diff selects no leaf of that layer and kind.
    """
    rows = sparsity_rows(diff, levels=("layer_kind",))
    layers = sorted({r["layer"] for r in rows}, key=layer_sort_key)
    kinds = sorted({r["kind"] for r in rows}, key=kind_sort_key)
    grid = np.full((len(layers), len(kinds)), np.nan)
    for r in rows:
        grid[layers.index(r["layer"]), kinds.index(r["kind"])] = r["percent"]
    return layers, kinds, grid


def _annotation(value: float) -> str:
    if value == 0:
        return "0"
    if value >= 10:
        return f"{value:.0f}"
    if value >= 1:
        return f"{value:.1f}"
    return f"{value:.2g}"


def plot_sparsity_heatmap(
    diffs: SparseDiff | Sequence[SparseDiff] | Mapping[str, SparseDiff],
    path: str | os.PathLike,
    *,
    run: str = "",
    cmap: str = "viridis",
    dpi: int = 120,
    max_cols: int = 2,
) -> Path:
    """Heatmaps of kept percentage, layers x matrix kinds, one panel per diff.

    Cells are annotated with the percentage; (layer, kind) pairs the diff does
    not select are blank. Each panel has its own colour scale and is titled
    with the run and the diff name. Uses matplotlib's Agg backend (no
    display needed); the global backend is not changed.

    Args:
      diffs: one diff, a sequence of diffs or ``{label: diff}``.
      path: destination PNG file (parent directories are created).
      run: run label for the titles.
      cmap: matplotlib colormap name.
      dpi: resolution of the PNG.
      max_cols: panels per row of the figure.

    Returns:
      ``path`` as a :class:`~pathlib.Path`.

    Raises:
      ValueError: if no diff is given.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if isinstance(diffs, SparseDiff):
        items = [(diffs.name, diffs)]
    elif isinstance(diffs, Mapping):
        items = list(diffs.items())
    else:
        items = [(d.name, d) for d in diffs]
    if not items:
        raise ValueError("plot_sparsity_heatmap needs at least one diff.")
    grids = [(label, *density_grid(d)) for label, d in items]
    ncols = min(len(grids), max(1, max_cols))
    nrows = math.ceil(len(grids) / ncols)
    max_rows = max(len(g[1]) for g in grids)
    max_kinds = max(len(g[2]) for g in grids)
    panel_w = 1.5 + 0.75 * max_kinds
    panel_h = 1.5 + 0.4 * max_rows
    fig = Figure(
        figsize=(panel_w * ncols, panel_h * nrows + 0.6), dpi=dpi, layout="constrained"
    )
    FigureCanvasAgg(fig)
    for i, (label, layers, kinds, grid) in enumerate(grids):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        masked = np.ma.masked_invalid(grid)
        finite = grid[np.isfinite(grid)]
        vmax = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
        im = ax.imshow(masked, cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto")
        ax.set_xticks(range(len(kinds)))
        ax.set_xticklabels(kinds, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(len(layers)))
        ax.set_yticklabels(layers, fontsize=8)
        for r in range(grid.shape[0]):
            for c in range(grid.shape[1]):
                v = grid[r, c]
                if np.isfinite(v):
                    dark = v < 0.6 * vmax
                    ax.text(
                        c,
                        r,
                        _annotation(v),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if dark else "black",
                    )
        title = f"{run}: diff {label!r}" if run else f"diff {label!r}"
        ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax, label="kept entries (%)", shrink=0.8)
    head = (
        f"Kept entries per layer and matrix kind (%) - run {run}"
        if run
        else ("Kept entries per layer and matrix kind (%)")
    )
    fig.suptitle(head, fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
