"""Splitting one table with no split column (``data.split_shares``).

Many datasets come as one file with no train / dev / test column. Splitting
it by hand before every run invites two mistakes a debiasing study cannot
afford: a split that differs between runs (so the leakages of two runs are
read on different test rows) and a dev or test split that misses the small
cells of the task x attribute table (so a floor or a TPR gap is read on a
handful of rows, or on none).

:func:`split_rows` makes the split deterministic and stratified: rows are
grouped by their stratum (the task label and every attribute value, as read
from the file), each stratum is shuffled by a generator seeded with
``data.seed``, and its rows are dealt to the splits in proportion to the
shares. A stratum's rows rarely divide exactly; each leftover row goes to
the split that is furthest below its share of all the rows dealt so far, so
the splits' sizes stay within a row or two of their shares overall however
many small strata there are. Within a split the rows keep the file's order.
The same file and seed give the same split on every machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def check_shares(shares: Sequence, splits: Sequence[str]) -> tuple[float, ...]:
    """``shares`` as floats, one per split, each > 0, summing to 1.

    Raises:
      ValueError: naming the fix, on a wrong count, a share that is not a
        positive number or a sum away from 1.
    """
    splits = tuple(splits)
    example = "(0.8, 0.1, 0.1)" if len(splits) == 3 else "(0.8, 0.2)"
    if len(shares) != len(splits):
        raise ValueError(
            f"data.split_shares has {len(shares)} value(s) {tuple(shares)} for the "
            f"{len(splits)} splits {list(splits)}: give one share per split, in "
            f"that order, e.g. --config.data.split_shares='{example}'."
        )
    out = []
    for s, v in zip(splits, shares, strict=True):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(
                f"data.split_shares gives split {s!r} the share {v!r}; every share "
                f"must be a number above 0 (e.g. {example})."
            )
        out.append(float(v))
    if abs(sum(out) - 1.0) > 1e-6:
        raise ValueError(
            f"data.split_shares {tuple(shares)} sums to {sum(out):g}; the shares "
            f"must sum to 1 (e.g. {example})."
        )
    return tuple(out)


def split_rows(
    strata: Sequence[Sequence],
    shares: Sequence[float],
    *,
    seed: int,
) -> list[np.ndarray]:
    """Row indices of each split: stratified, seeded, in file order.

    Args:
      strata: one sequence per stratifying column, each with a value per row
        (compared as ``str``); rows with equal values in every column form a
        stratum (the rows are counted from the first column; none: no rows).
      shares: each split's share of the rows (:func:`check_shares`).
      seed: the shuffling generator's seed.

    Returns:
      One sorted int64 array per split; together they hold every row once.
    """
    shares = np.asarray(shares, np.float64)
    n = len(strata[0]) if strata else 0
    keys = list(zip(*([str(v) for v in col] for col in strata), strict=True))
    cells: dict[tuple, list[int]] = {}
    for i in range(n):
        cells.setdefault(keys[i], []).append(i)
    rng = np.random.default_rng(seed)
    dealt = np.zeros(len(shares), np.int64)
    parts: list[list[np.ndarray]] = [[] for _ in shares]
    for key in sorted(cells):
        rows = rng.permutation(np.asarray(cells[key], np.int64))
        counts = np.floor(len(rows) * shares).astype(np.int64)
        total = dealt.sum() + len(rows)
        for _ in range(len(rows) - int(counts.sum())):
            # The split furthest below its share of every row dealt so far
            # (ties to the earlier split: train first).
            counts[int(np.argmax(shares * total - (dealt + counts)))] += 1
        start = 0
        for j, c in enumerate(counts):
            parts[j].append(rows[start : start + c])
            start += c
        dealt += counts
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def split_table(
    table: Mapping[str, list],
    *,
    path: str,
    splits: Sequence[str],
    shares: Sequence[float],
    strata: Sequence[str],
    seed: int,
) -> dict[str, tuple[str, dict[str, list]]]:
    """``{split: (where, table rows)}`` for the splits :func:`split_rows`
    deals from ``table``, stratified by the columns ``strata``."""
    index = split_rows([table[c] for c in strata], shares, seed=seed)
    return {
        s: (
            f"{path} [data.split_shares: {share:g} of the rows, data.seed={seed}]",
            {k: [col[i] for i in idx] for k, col in table.items()},
        )
        for s, share, idx in zip(splits, shares, index, strict=True)
    }
