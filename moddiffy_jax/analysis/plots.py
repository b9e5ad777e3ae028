"""Trade-off plot: task accuracy against leakage, one marker per configuration."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p")


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r}.")
    return float(value)


def _stds(point: Mapping[str, Any], where: str) -> tuple[float | None, dict]:
    """(task std, {attr: leakage std}) from ``task_std``/``leakage_std``/``std``."""
    task_std = point.get("task_std")
    leakage_std = dict(point.get("leakage_std") or {})
    std = point.get("std")
    if isinstance(std, Mapping):
        std = dict(std)
        if task_std is None:
            task_std = std.pop("task_acc", None)
        leak = std.pop("leakage", None)
        if isinstance(leak, Mapping):
            leakage_std = {**leak, **leakage_std}
        leakage_std = {**std, **leakage_std}
    elif std is not None and task_std is None:
        task_std = std
    if task_std is not None:
        task_std = _number(task_std, f"{where}: task std")
    return task_std, {
        a: _number(v, f"{where}: leakage std of {a!r}") for a, v in leakage_std.items()
    }


def plot_tradeoff(
    points: Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
    *,
    attrs: Sequence[str] | None = None,
    task_axis: str = "x",
    title: str = "",
    chance: float | Mapping[str, float] | None = None,
    dpi: int = 120,
) -> Path:
    """Task accuracy against leakage, one panel per protected attribute.

    Args:
      points: one dict per configuration (run, method, diff composition):
        ``label`` (str), ``task_acc`` (float), ``leakage`` (``{attr:
        probe balanced accuracy}``) and optionally ``task_std`` (float) and
        ``leakage_std`` (``{attr: float}``), or ``std``: a float (task std)
        or ``{"task_acc": .., attr: ..}``. Error bars are drawn where a std
        is given. A point is drawn in each panel whose attribute it has.
      path: destination PNG file (parent directories are created).
      attrs: attributes (panels) to draw; default every attribute of any
        point, sorted.
      task_axis: ``"x"`` (task accuracy horizontal, leakage vertical) or
        ``"y"``.
      title: figure title.
      chance: chance-level balanced accuracy, drawn as a dashed line: one
        value for all attributes or ``{attr: value}``.
      dpi: resolution of the PNG.

    Returns:
      ``path`` as a :class:`~pathlib.Path`.

    Raises:
      ValueError: if there are no points or attributes, for a malformed
        point, duplicate labels, or an invalid ``task_axis``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if task_axis not in ("x", "y"):
        raise ValueError(f"task_axis must be 'x' or 'y', got {task_axis!r}.")
    if not points:
        raise ValueError("plot_tradeoff needs at least one point.")
    parsed = []
    for i, p in enumerate(points):
        where = f"point {i} ({p.get('label', '?')!r})"
        if "label" not in p or "task_acc" not in p or "leakage" not in p:
            raise ValueError(f"{where} needs 'label', 'task_acc' and 'leakage'.")
        if not isinstance(p["leakage"], Mapping):
            raise ValueError(f"{where}: 'leakage' must be a dict {{attr: value}}.")
        leakage = {
            a: _number(v, f"{where}: leakage of {a!r}") for a, v in p["leakage"].items()
        }
        task_std, leakage_std = _stds(p, where)
        parsed.append(
            (
                str(p["label"]),
                _number(p["task_acc"], f"{where}: task_acc"),
                task_std,
                leakage,
                leakage_std,
            )
        )
    labels = [q[0] for q in parsed]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"Duplicate point labels {dupes}; labels must be unique.")
    if attrs is None:
        attrs = sorted({a for q in parsed for a in q[3]})
    attrs = list(attrs)
    if not attrs:
        raise ValueError("No leakage attribute to plot.")

    fig = Figure(figsize=(4.5 * len(attrs) + 2.5, 4.2), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    styles = {
        label: (marker, f"C{i % 10}")
        for i, (label, marker) in enumerate(
            zip(labels, itertools.cycle(_MARKERS), strict=False)
        )
    }
    handles = {}
    for j, attr in enumerate(attrs):
        ax = fig.add_subplot(1, len(attrs), j + 1)
        leak_label = f"leakage: probe balanced acc. ({attr})"
        for label, task, task_std, leakage, leakage_std in parsed:
            if attr not in leakage:
                continue
            marker, color = styles[label]
            leak, leak_std = leakage[attr], leakage_std.get(attr)
            if task_axis == "x":
                x, y, xerr, yerr = task, leak, task_std, leak_std
            else:
                x, y, xerr, yerr = leak, task, leak_std, task_std
            h = ax.errorbar(
                x,
                y,
                xerr=xerr,
                yerr=yerr,
                fmt=marker,
                color=color,
                markersize=7,
                capsize=3,
                label=label,
            )
            handles.setdefault(label, h)
        level = chance.get(attr) if isinstance(chance, Mapping) else chance
        if level is not None and math.isfinite(level):
            line = ax.axhline if task_axis == "x" else ax.axvline
            line(level, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("task accuracy" if task_axis == "x" else leak_label)
        ax.set_ylabel(leak_label if task_axis == "x" else "task accuracy")
        ax.set_title(attr)
        ax.grid(True, alpha=0.3)
    order = [label for label in labels if label in handles]
    fig.legend(
        [handles[label] for label in order],
        order,
        loc="outside right upper",
        fontsize=8,
    )
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
