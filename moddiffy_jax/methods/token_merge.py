"""Token-merge diffs: an attribute's words made indistinguishable, exactly.

Where text carries an attribute through words (names, pronouns, dialect
spellings), a representation holds the attribute as long as those words'
embedding rows differ at all: a probe of standardized features reads a
shrunk difference as well as the original (docs/efficacy.md, "Stop 28":
moving MiniLM's gender marker rows 75% of the way to their mean left the
probes at the core's leakage; the whole way took them past the floor). A
gradient-trained diff moves each entry by about its learning rate per step
in the direction of a noisy removal gradient, so it shrinks those
differences and rarely closes them.

A token-merge diff closes them by construction: it sets the word-embedding
rows of chosen tokens to one shared row, the mean of the candidates' rows
(so ``core + diff`` cannot tell those tokens apart anywhere in the network),
and stores that as an ordinary :class:`~moddiffy_jax.subnets.sparse_diff.SparseDiff`
on the word table (``tokens x hidden`` entries, about 0.03% of MiniLM for 16
tokens). Two attributes' merge diffs touch disjoint rows when their tokens
differ, so they add exactly.

Which tokens: the candidates are :mod:`~moddiffy_jax.methods.word_rows`'s
ranking (``I(token present; attribute | task label)`` on the training
split), best first; :func:`choose_count` takes the longest prefix whose task
cost on a held-out split stays within a budget. Merging all of an
attribute's markers removes what the core's head read from them too; where
the attribute predicts the task beyond the text, the budget is what keeps
the task (a partial merge removes the attribute from the examples holding
the merged words only).

Applies to word-level evidence only: an attribute carried by syntax, by
sub-word spelling spread over common pieces, or by non-text inputs needs
the trained diffs of :mod:`~moddiffy_jax.methods.moddiffy`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from moddiffy_jax.methods.word_rows import WORD_TABLE
from moddiffy_jax.subnets import selection
from moddiffy_jax.subnets import sparse_diff as sparse_lib


def _table(encoder_params: Any) -> np.ndarray:
    flat = selection.flatten(encoder_params)
    if WORD_TABLE not in flat:
        raise ValueError(
            f"Token merging needs a word-embedding table at {WORD_TABLE!r}; these "
            f"params have none (leaves: {sorted(flat)[:3]} ...). It applies to "
            "BERT-family text encoders only."
        )
    return np.asarray(flat[WORD_TABLE])


def _ids(token_ids: Sequence[int], vocab: int) -> np.ndarray:
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(
            f"Token ids must lie in [0, {vocab}); got {ids.min()}..{ids.max()}."
        )
    if np.unique(ids).size != ids.size:
        raise ValueError("Token ids to merge must be distinct.")
    return ids


def merge_target(encoder_params: Any, candidates: Sequence[int]) -> np.ndarray:
    """The shared row merged tokens take: the mean of the candidates' rows
    (fixed for every prefix of the ranking, so merging more tokens only adds
    rows)."""
    table = _table(encoder_params)
    ids = _ids(candidates, table.shape[0])
    if ids.size == 0:
        raise ValueError("No candidate tokens to merge.")
    return table[ids].astype(np.float64).mean(0).astype(table.dtype)


def merge_diff(
    encoder_params: Any,
    token_ids: Sequence[int],
    target: np.ndarray,
    *,
    name: str,
    info: dict | None = None,
) -> sparse_lib.SparseDiff:
    """The diff that sets each of ``token_ids``' word rows to ``target``.

    Stored entries are ``target - row`` at the merged rows (an entry already
    equal to the target is not stored); ``core + diff`` holds ``target`` in
    every merged row, up to one rounding of the addition.
    """
    table = _table(encoder_params)
    ids = _ids(token_ids, table.shape[0])
    target = np.asarray(target, table.dtype)
    if target.shape != table.shape[1:]:
        raise ValueError(
            f"The target row has shape {target.shape}; the word table's rows "
            f"have {table.shape[1:]}."
        )
    delta = np.zeros_like(table)
    delta[ids] = target[None, :] - table[ids]
    return sparse_lib.SparseDiff.from_dense(
        selection.unflatten({WORD_TABLE: delta}),
        name=name,
        base_fingerprint=sparse_lib.fingerprint(encoder_params),
        rules=((WORD_TABLE,), ()),
        info={
            "method": "token_merge",
            "tokens": [int(t) for t in ids],
            **dict(info or {}),
        },
    )


def monotone_fit(values: Sequence[float]) -> np.ndarray:
    """The non-decreasing sequence closest to ``values`` in squared error
    (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and (
            blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]
        ):
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return np.concatenate([np.full(int(n), total / n) for total, n in blocks])


def balanced_accuracy_se(accuracy: float, labels: Sequence[int]) -> float:
    """Standard error of a balanced accuracy of about ``accuracy`` read on
    examples with these class ``labels`` (each class's recall binomial, at
    that accuracy): ``sqrt(sum_c a (1 - a) / n_c) / C``."""
    counts = np.bincount(np.asarray(labels, np.int64))
    counts = counts[counts > 0]
    if counts.size == 0:
        raise ValueError("No labels to read a balanced accuracy on.")
    a = float(accuracy)
    return float(np.sqrt(np.sum(a * (1.0 - a) / counts)) / counts.size)


def choose_count(
    ranked: Sequence[int],
    task_drop: Callable[[np.ndarray], float],
    max_drop: float,
    counts: Sequence[int] | None = None,
    *,
    leakage: Callable[[np.ndarray], float] | None = None,
    floor: float | None = None,
    tolerance: float = 0.0,
) -> tuple[int, list[dict]]:
    """How long a prefix of ``ranked`` to merge within a task budget.

    ``task_drop(ids)`` is the task cost of merging ``ids`` (accuracy points
    lost on a held-out split, say), read at every prefix size in ``counts``
    (ascending; default 1, 2, ..., ``len(ranked)``). A cost read on a few
    hundred examples is noisy and need not grow with the size (main job,
    seed 0: 0.8 points at 4 age tokens, 0.2 at 6), while the true cost of
    merging more tokens cannot fall much; so the costs are replaced by their
    closest non-decreasing fit (:func:`monotone_fit`), and the longest prefix
    whose fitted cost is within ``max_drop`` (up to 1e-9, for costs summed
    in floating point) is chosen. Picking the largest raw cost within budget
    instead favours sizes whose cost was read low by chance.

    With ``leakage`` (the attribute's leakage after merging ``ids``, read by
    a probe on a held-out split) and ``floor`` (what the task label alone
    gives there), the scan stops at the first size within budget whose
    leakage is at or below ``floor + tolerance``: merging past it removes no
    more than the task label implies and only costs the task (main job,
    seed 0: all 8 age tokens took age 0.4 past its gap for 2.1 points).
    ``tolerance`` is the probe's own noise at the floor
    (:func:`balanced_accuracy_se`): a leakage within it cannot be told from
    the floor on that split.

    Returns the chosen size (0 when none is within budget) and one record
    per size read: ``{"size", "cost", "fitted"}`` plus ``"leakage"`` where
    it was probed.
    """
    if (leakage is None) != (floor is None):
        raise ValueError("Pass leakage and floor together, or neither.")
    n = len(ranked)
    sizes = list(range(1, n + 1)) if counts is None else [int(c) for c in counts]
    if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise ValueError(f"counts must be strictly ascending; got {sizes}.")
    if sizes and (sizes[0] < 1 or sizes[-1] > n):
        raise ValueError(f"counts must lie in [1, {n}]; got {sizes}.")
    ranked = np.asarray(ranked, np.int64)
    costs = [float(task_drop(ranked[:k])) for k in sizes]
    fitted = monotone_fit(costs) if sizes else np.zeros(0)
    read = [
        {"size": k, "cost": c, "fitted": float(f)}
        for k, c, f in zip(sizes, costs, fitted, strict=True)
    ]
    chosen = 0
    for rec in read:
        if rec["fitted"] > max_drop + 1e-9:
            break
        chosen = rec["size"]
        if leakage is not None:
            rec["leakage"] = float(leakage(ranked[:chosen]))
            if rec["leakage"] <= floor + tolerance:
                break
    return chosen, read
