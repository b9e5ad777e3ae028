"""Overlap of the supports of sparse diffs, and sign agreement where they meet.

For two diffs over the same leaves (same paths and shapes), per leaf and in
total:

* ``intersection``: entries kept by both; ``union``; ``jaccard`` =
  intersection / union;
* ``expected_intersection``: what two independent uniformly random supports
  with the same per-leaf counts would share, ``sum nnz_a * nnz_b / size``
  (and ``expected_jaccard`` from it): the chance level to compare against;
* ``same_sign`` / ``sign_agreement``: shared entries whose values have equal
  sign (``np.sign``, so two stored zeros agree), and their fraction of the
  intersection (NaN when nothing is shared).

Use it across the attributes of one run (do gender and age change the same
weights?) and across runs of one attribute (is the support stable over seeds?).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from moddiffy_jax.analysis.sparsity import (
    ALL,
    kind_of,
    kind_sort_key,
    layer_of,
    layer_sort_key,
)
from moddiffy_jax.subnets.diffs import SparseDiff

LEVELS = ("leaf", "layer", "kind", "total")
_COUNTS = (
    "size",
    "nnz_a",
    "nnz_b",
    "intersection",
    "expected_intersection",
    "same_sign",
)


def check_same_leaves(a: SparseDiff, b: SparseDiff, *, labels=("a", "b")) -> None:
    """Checks that two diffs select the same leaves with the same shapes.

    Leaf order does not matter.

    Args:
      a: a sparse diff.
      b: another sparse diff.
      labels: how to name ``a`` and ``b`` in the message.

    Raises:
      ValueError: naming the leaves only one diff has and the shape mismatches.
    """
    sa, sb = dict(a.shapes), dict(b.shapes)
    problems = []
    only_a = [p for p in sa if p not in sb]
    only_b = [p for p in sb if p not in sa]
    if only_a:
        problems.append(f"only {labels[0]!r} has {_preview(only_a)}")
    if only_b:
        problems.append(f"only {labels[1]!r} has {_preview(only_b)}")
    bad = [f"{p}: {sa[p]} vs {sb[p]}" for p in sa if p in sb and sa[p] != sb[p]]
    if bad:
        problems.append(f"shapes differ for {_preview(bad)}")
    if problems:
        na, nb = (
            repr(lab) + (f" (diff {d.name!r})" if d.name and d.name != lab else "")
            for lab, d in zip(labels, (a, b), strict=True)
        )
        raise ValueError(
            f"Cannot compare diffs {na} and {nb}: they do not cover the same "
            "leaves with the same "
            "shapes (different selection rules or model sizes?): "
            + "; ".join(problems)
            + "."
        )


def _preview(items: Sequence[str], n: int = 5) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def _support(diff: SparseDiff, path: str, nonzero_only: bool):
    idx = np.asarray(diff.indices[path]).astype(np.int64)
    vals = np.asarray(diff.values[path]).astype(np.float32)
    if nonzero_only:
        keep = vals != 0
        idx, vals = idx[keep], vals[keep]
    return idx, vals


def _finish(row: dict[str, Any]) -> dict[str, Any]:
    inter, na, nb = row["intersection"], row["nnz_a"], row["nnz_b"]
    union = na + nb - inter
    expected = row["expected_intersection"]
    row["union"] = union
    row["jaccard"] = inter / union if union else math.nan
    expected_union = na + nb - expected
    row["expected_jaccard"] = expected / expected_union if expected_union else math.nan
    row["sign_agreement"] = row["same_sign"] / inter if inter else math.nan
    return row


def overlap_rows(
    a: SparseDiff,
    b: SparseDiff,
    *,
    labels: tuple[str, str] | None = None,
    levels: Sequence[str] = LEVELS,
    nonzero_only: bool = False,
) -> list[dict[str, Any]]:
    """Overlap of two diffs per leaf, per layer, per kind and in total.

    Args:
      a: a sparse diff.
      b: a diff over the same leaf paths and shapes.
      labels: names for ``a`` and ``b`` in the rows; default their names.
      levels: which of :data:`LEVELS` to return, in that order.
      nonzero_only: count only stored entries whose value is not 0 (pruning
        to an exact budget can store zeros, which tie-breaking places at the
        lowest indices and so inflates the overlap of mostly-zero diffs).

    Returns:
      Tidy rows with ``a``, ``b``, ``level``, ``path``, ``layer``, ``kind``
      (:data:`~moddiffy_jax.analysis.sparsity.ALL` where aggregated),
      ``same_base`` (equal base fingerprints), ``size``, ``nnz_a``, ``nnz_b``,
      ``intersection``, ``union``, ``jaccard``, ``expected_intersection``,
      ``expected_jaccard``, ``same_sign`` and ``sign_agreement``. Leaf rows
      follow ``a``'s leaf order.

    Raises:
      ValueError: if the diffs do not cover the same leaves with the same
        shapes, or for an unknown level.
    """
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown:
        raise ValueError(f"Unknown levels {unknown}; valid: {', '.join(LEVELS)}.")
    la, lb = labels if labels is not None else (a.name, b.name)
    check_same_leaves(a, b, labels=(la, lb))
    same_base = a.base_fingerprint == b.base_fingerprint
    leaves = []
    for p, shape in a.shapes:
        ia, va = _support(a, p, nonzero_only)
        ib, vb = _support(b, p, nonzero_only)
        _, ka, kb = np.intersect1d(ia, ib, assume_unique=True, return_indices=True)
        size = math.prod(shape)
        leaves.append(
            {
                "path": p,
                "layer": layer_of(p),
                "kind": kind_of(p),
                "size": size,
                "nnz_a": int(ia.size),
                "nnz_b": int(ib.size),
                "intersection": int(ka.size),
                "same_sign": int(np.sum(np.sign(va[ka]) == np.sign(vb[kb]))),
                "expected_intersection": ia.size * ib.size / size if size else 0.0,
            }
        )
    rows = []
    for level in levels:
        if level == "leaf":
            groups = [
                (leaf["path"], leaf["layer"], leaf["kind"], [leaf]) for leaf in leaves
            ]
        elif level == "total":
            groups = [(ALL, ALL, ALL, leaves)]
        else:
            keyed: dict[str, list] = {}
            for leaf in leaves:
                keyed.setdefault(leaf[level], []).append(leaf)
            order = sorted(
                keyed,
                key=layer_sort_key if level == "layer" else kind_sort_key,
            )
            groups = [
                (
                    ALL,
                    k if level == "layer" else ALL,
                    k if level == "kind" else ALL,
                    keyed[k],
                )
                for k in order
            ]
        for path, layer, kind, members in groups:
            row: dict[str, Any] = {
                "a": la,
                "b": lb,
                "level": level,
                "path": path,
                "layer": layer,
                "kind": kind,
                "same_base": same_base,
            }
            for c in _COUNTS:
                row[c] = sum(m[c] for m in members)
            rows.append(_finish(row))
    return rows


def pairwise_overlap(
    diffs: Sequence[tuple[str, SparseDiff]],
    *,
    levels: Sequence[str] = ("total",),
    nonzero_only: bool = False,
) -> list[dict[str, Any]]:
    """The overlap table of every pair of labelled diffs.

    Args:
      diffs: ``[(label, diff), ...]``, e.g. the attribute diffs of one run
        (``[("gender", d1), ("age", d2)]``) or one attribute over seeds
        (``[("seed0", d1), ("seed1", d2)]``). All must cover the same leaves
        with the same shapes.
      levels: see :func:`overlap_rows`; default only the totals.
      nonzero_only: see :func:`overlap_rows`.

    Returns:
      The rows of :func:`overlap_rows` for each pair ``i < j`` in input
      order (``a`` is the earlier label).

    Raises:
      ValueError: for duplicate labels or diffs over different leaves/shapes.
    """
    labels = [label for label, _ in diffs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"Duplicate diff labels {dupes}; labels must be unique.")
    for (la, da), (lb, db) in zip(diffs, diffs[1:], strict=False):
        check_same_leaves(da, db, labels=(la, lb))
    rows = []
    for i, (la, da) in enumerate(diffs):
        for lb, db in diffs[i + 1 :]:
            rows += overlap_rows(
                da, db, labels=(la, lb), levels=levels, nonzero_only=nonzero_only
            )
    return rows
