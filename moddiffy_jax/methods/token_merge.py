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
split), taken in groups of counterparts, one token per class
(:func:`counterpart_groups`: she / he, so that the merged row is neither a
marker of one class, as two merged male names would be, nor of the part a
word plays), or reordered by :func:`merge_order`; :func:`choose_count`
takes the longest prefix whose task cost on a held-out split stays within
a budget. Merging all of an
attribute's markers removes what the core's head read from them too; where
the attribute predicts the task beyond the text, the budget is what keeps
the task (a partial merge removes the attribute from the examples holding
the merged words only).

Applies to word-level evidence only: an attribute carried by syntax, by
sub-word spelling spread over common pieces, or by non-text inputs needs
the trained diffs of :mod:`~moddiffy_jax.methods.moddiffy`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
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


def paired_drop(before: np.ndarray, after: np.ndarray) -> tuple[float, float]:
    """Accuracy points lost from ``before`` to ``after`` (per-example
    correctness of the same examples) and the standard error of that paired
    difference: the mean of ``d_i = before_i - after_i`` in {-1, 0, 1} and
    ``sqrt(var(d) / n)``, in points."""
    d = np.asarray(before, np.float64) - np.asarray(after, np.float64)
    if d.size == 0:
        raise ValueError("No examples to read a task cost on.")
    return 100.0 * float(d.mean()), 100.0 * float(np.sqrt(d.var() / d.size))


def stop_level(
    floor: float, tolerance: float, start: float | None, target: float
) -> float:
    """The leakage at which merging more stops: within ``tolerance`` of
    ``floor``, or (given the leakage before merging, ``start``) once
    ``target`` of the gap from ``start`` to ``floor`` is closed."""
    level = floor + tolerance
    if start is not None:
        level = max(level, start - target * (start - floor))
    return float(level)


def choose_count(
    ranked: Sequence[int],
    task_drop: Callable[[np.ndarray], float | tuple[float, float]],
    max_drop: float,
    counts: Sequence[int] | None = None,
    *,
    leakage: Callable[[np.ndarray], float] | None = None,
    floor: float | None = None,
    tolerance: float = 0.0,
    cost_z: float = 0.0,
    start: float | None = None,
    target: float = 1.0,
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

    ``task_drop`` may also return ``(cost, standard error)``; then a size
    is within budget when its fitted cost plus ``cost_z`` standard errors
    is (the read's own noise counted against the budget: on README command
    1's runs a cost read on 2,500 examples missed the 3,000-example test
    cost by up to 1.5 points, docs/efficacy.md "Stop 30").

    With ``leakage`` (the attribute's leakage after merging ``ids``, read by
    a probe on a held-out split) and ``floor`` (what the task label alone
    gives there), the scan stops at the first size within budget whose
    leakage is at or below ``floor + tolerance``: merging past it removes no
    more than the task label implies and only costs the task (main job,
    seed 0: all 8 age tokens took age 0.4 past its gap for 2.1 points).
    ``tolerance`` is the probe's own noise at the floor (a multiple of
    :func:`balanced_accuracy_se`): a leakage within it cannot be told from
    the floor on that split. With ``start`` (the leakage before merging,
    read the same way) the scan also stops once the leakage has closed
    ``target`` of the gap from ``start`` to ``floor`` (1: only at the
    floor): past the removal asked for, more tokens only cost the task.

    Returns the chosen size (0 when none is within budget) and one record
    per size read: ``{"size", "cost", "fitted"}`` (with a standard error,
    ``"se"`` and ``"bound"`` = fitted + ``cost_z`` se) plus ``"leakage"``
    where it was probed.
    """
    if (leakage is None) != (floor is None):
        raise ValueError("Pass leakage and floor together, or neither.")
    n = len(ranked)
    sizes = list(range(1, n + 1)) if counts is None else [int(c) for c in counts]
    if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
        raise ValueError(f"counts must be strictly ascending; got {sizes}.")
    if sizes and (sizes[0] < 1 or sizes[-1] > n):
        raise ValueError(f"counts must lie in [1, {n}]; got {sizes}.")
    if not cost_z >= 0:
        raise ValueError(f"cost_z must be >= 0 standard errors; got {cost_z}.")
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be a share of the gap in (0, 1]; got {target}.")
    stop_at = None
    if leakage is not None:
        stop_at = stop_level(floor, tolerance, start, target)
    ranked = np.asarray(ranked, np.int64)
    reads = [task_drop(ranked[:k]) for k in sizes]
    costs = [float(r[0]) if isinstance(r, tuple) else float(r) for r in reads]
    fitted = monotone_fit(costs) if sizes else np.zeros(0)
    read = []
    for k, r, c, f in zip(sizes, reads, costs, fitted, strict=True):
        rec = {"size": k, "cost": c, "fitted": float(f)}
        if isinstance(r, tuple):
            rec["se"] = float(r[1])
            rec["bound"] = float(f) + cost_z * float(r[1])
        read.append(rec)
    chosen = 0
    for rec in read:
        if rec.get("bound", rec["fitted"]) > max_drop + 1e-9:
            break
        chosen = rec["size"]
        if leakage is not None:
            rec["leakage"] = float(leakage(ranked[:chosen]))
            if rec["leakage"] <= stop_at:
                break
    return chosen, read


def _information(present: np.ndarray, task: np.ndarray, attribute: np.ndarray) -> float:
    """``I(x; attribute | task label)`` in nats for a boolean per-example
    feature ``x`` (plug-in, from counts)."""
    n_y, n_a = int(task.max()) + 1, int(attribute.max()) + 1
    cell = (task * 2 + present.astype(np.int64)) * n_a + attribute
    joint = np.bincount(cell, minlength=n_y * 2 * n_a).reshape(n_y, 2, n_a)
    total = joint.sum()
    p_yx = joint.sum(2, keepdims=True)
    p_ya = joint.sum(1, keepdims=True)
    p_y = joint.sum((1, 2), keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        term = np.where(joint > 0, joint * np.log(joint * p_y / (p_yx * p_ya)), 0.0)
    return max(float(term.sum() / total), 0.0)


def _presence(split: Any, ranked: np.ndarray) -> np.ndarray:
    """``[examples, len(ranked)]``: whether each example holds each token."""
    from moddiffy_jax.methods.word_rows import _present

    vocab = int(max(np.max(split.input_ids), ranked.max())) + 1
    rows, tokens = _present(split.input_ids, split.attention_mask, vocab)
    keep = np.isin(tokens, ranked)
    column = {int(t): i for i, t in enumerate(ranked)}
    present = np.zeros((len(split.task), ranked.size), bool)
    present[rows[keep], [column[int(t)] for t in tokens[keep]]] = True
    return present


def _classes(present: np.ndarray, attr: np.ndarray) -> np.ndarray:
    """Each candidate's class: the one whose rate it raises most,
    ``P(a = c | token) / P(a = c)`` (``present``: [N, candidates])."""
    n_classes = int(attr.max()) + 1
    share = np.bincount(attr, minlength=n_classes) / attr.size
    lift = np.stack(
        [
            np.bincount(attr[present[:, i]], minlength=n_classes)
            / max(int(present[:, i].sum()), 1)
            for i in range(present.shape[1])
        ]
    ) / np.maximum(share, 1e-12)
    return lift.argmax(1)


def counterpart_groups(
    split: Any, attribute: str, ranked: Sequence[int], table: np.ndarray
) -> list[np.ndarray]:
    """The candidates in groups of counterparts, one token per class.

    Merging all candidates into one row leaves the merged row telling where
    the tokens play different parts: with "she" and "his" merged (and "he",
    "her" not), the shared row in a subject's place is "she" and in a
    possessive's "his" (README command 1 with data.seed 4: the four tokens
    she, his, sister, father moved gender's dev leakage from 0.971 to 0.968;
    docs/efficacy.md, "Stop 33"). A group takes the best-ranked token left
    and, for each other class of the attribute, the token of that class left
    whose word row (in ``table``, the core's) is the most similar to it by
    cosine, which pairs a word with its counterpart (she / he, sister /
    brother, his / her; names with names), so a prefix of whole groups
    merges both sides of every part it touches. Groups come in the order of
    their first token's rank; a token left without a counterpart of another
    class (nothing to be merged with) is dropped. Classes are as in
    :func:`merge_order`; counts are on ``split``.
    """
    ranked = np.asarray(ranked, np.int64).reshape(-1)
    if ranked.size == 0:
        return []
    attr = np.asarray(split.attrs[attribute], np.int64)
    klass = _classes(_presence(split, ranked), attr)
    rows = np.asarray(table, np.float64)[ranked]
    unit = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    similar = unit @ unit.T
    left, groups = list(range(ranked.size)), []
    while left:
        first = left[0]
        group = [first]
        for c in sorted(set(klass[left].tolist()) - {int(klass[first])}):
            # max keeps the first of equals: the better-ranked counterpart.
            group.append(
                max((j for j in left if klass[j] == c), key=lambda j: similar[first, j])
            )
        for j in group:
            left.remove(j)
        if len(group) > 1:
            groups.append(ranked[group])
    return groups


def merge_order(
    split: Any, attribute: str, ranked: Sequence[int], how: str = "balanced"
) -> np.ndarray:
    """``ranked`` reordered so that merged prefixes do not stay telling.

    Merging tokens gives them one shared row, so what the merge removes is
    what telling them apart said about the attribute; whether the shared row
    is present still says as much as a single token would. Two male names
    merged remain a male marker (README command 1 with data.seed 1: merging
    "peter" and then "brother" left gender's dev leakage at the core's,
    0.974; adding "emma" took it to 0.940). Counts are on ``split``.

    ``how="balanced"`` (the default) keeps the ranking within each class of
    the attribute and interleaves the classes: each token is assigned the
    class it raises most (``P(a = c | token) / P(a = c)``), and the next
    token is the best-ranked one of the class least represented among the
    examples the prefix merges, relative to that class's share of the
    split (ties to the better rank).

    ``how="greedy"`` maximises a count estimate of what a prefix S removes,
    with ``x_t`` "example holds token t" and ``x_S`` "holds any token of S",
    conditioned on the task label as the ranking is:

        R(S) = sum_{t in S} I(x_t; a | y) - I(x_S; a | y)

    (the best-ranked token first, then the largest R at each step). It
    trades the ranking for the counts' balance, and on README command 1's
    three training seeds it put "sister" where the ranking has "she" and
    removed less gender at a larger cost (docs/efficacy.md, "Stop 32").
    """
    if how not in ("balanced", "greedy"):
        raise ValueError(f"how must be 'balanced' or 'greedy'; got {how!r}.")
    ranked = np.asarray(ranked, np.int64).reshape(-1)
    if ranked.size <= 2:
        return ranked
    task = np.asarray(split.task, np.int64)
    attr = np.asarray(split.attrs[attribute], np.int64)
    present = _presence(split, ranked)
    if how == "greedy":
        return ranked[_greedy_removal(present, task, attr)]
    n_classes = int(attr.max()) + 1
    share = np.bincount(attr, minlength=n_classes) / attr.size
    klass = _classes(present, attr)
    order, union, left = [], np.zeros(attr.size, bool), list(range(ranked.size))
    while left:
        held = np.bincount(attr[union], minlength=n_classes) / np.maximum(share, 1e-12)
        wanted = [
            c for c in np.argsort(held, kind="stable") if (klass[left] == c).any()
        ]
        low = [c for c in wanted if held[c] == held[wanted[0]]]
        pick = min(i for i in left if klass[i] in low)  # best-ranked
        left.remove(pick)
        order.append(pick)
        union |= present[:, pick]
    return ranked[order]


def _greedy_removal(present: np.ndarray, task: np.ndarray, attr: np.ndarray) -> list:
    """Column order greedy in R(S) (see :func:`merge_order`)."""
    single = np.array(
        [_information(present[:, i], task, attr) for i in range(present.shape[1])]
    )
    order, union, gathered = [0], present[:, 0].copy(), single[0]
    left = list(range(1, present.shape[1]))
    while left:
        scores = [
            gathered + single[i] - _information(union | present[:, i], task, attr)
            for i in left
        ]
        pick = left.pop(int(np.argmax(scores)))
        order.append(pick)
        union |= present[:, pick]
        gathered += single[pick]
    return order


#: How :func:`build_merges` orders the candidates: ``counterparts``
#: (whole groups of counterpart tokens: :func:`counterpart_groups`),
#: ``balanced`` or ``greedy`` (:func:`merge_order`), or ``information`` (the
#: ranking alone). Every merged token takes the candidates' mean row.
ORDERS = ("counterparts", "balanced", "greedy", "information")

# Prefix sizes read by :func:`build_merges` (then the whole candidate list).
COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclasses.dataclass(frozen=True)
class MergeChoice:
    """What :func:`build_merges` chose for one attribute.

    Attributes:
      attribute: the attribute's name.
      ranked: the candidate token ids, best first.
      merged: how many of them the diff merges (0: none within budget).
      floor: the attribute's leakage floor on the dev split.
      tolerance: the stop's margin above the floor: ``floor_z`` standard
        errors of the dev probe at the floor.
      read: one record per prefix size read (see :func:`choose_count`).
      diff: the merge diff (None when ``merged`` is 0).
      start: the core's leakage read by the dev probe (None without the
        floor stop).
      stop_at: the dev leakage at which the scan stopped merging more.
      groups: the sizes of the counterpart groups ``ranked`` is made of
        (empty for the other orders).
    """

    attribute: str
    ranked: tuple[int, ...]
    merged: int
    floor: float
    tolerance: float
    read: list[dict]
    diff: sparse_lib.SparseDiff | None
    start: float | None = None
    stop_at: float | None = None
    groups: tuple[int, ...] = ()

    def summary(self, tokenizer=None) -> dict[str, Any]:
        """A JSON-ready record (tokens as text with ``tokenizer``)."""
        ids = list(self.ranked[: self.merged])
        tokens = tokenizer.convert_ids_to_tokens(ids) if tokenizer else ids
        out = {
            "candidates": len(self.ranked),
            "merged": self.merged,
            "tokens": tokens,
            "dev_floor": self.floor,
            "tolerance": self.tolerance,
            "dev_start": self.start,
            "stop_at": self.stop_at,
            "read": self.read,
        }
        if self.groups:
            ends = np.cumsum(self.groups)
            out["groups"] = [
                tokens[end - size : end]
                for size, end in zip(self.groups, ends, strict=True)
                if end <= self.merged
            ]
        return out


def changed_rows(split: Any, token_ids: Sequence[int]) -> np.ndarray:
    """Indices of the examples of ``split`` that hold any of ``token_ids``
    among their real tokens: the only ones a merge of those tokens changes."""
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    hit = np.isin(split.input_ids, ids) & (np.asarray(split.attention_mask) > 0)
    return np.flatnonzero(hit.any(1))


def represent_merged(
    represent: Callable[[Any, Any], np.ndarray],
    params: Any,
    split: Any,
    base: np.ndarray,
    token_ids: Sequence[int],
) -> np.ndarray:
    """``represent(params, split)`` for params that differ from those giving
    ``base`` (the split's representations) only in the word rows of
    ``token_ids``: the examples without those tokens keep their ``base``
    rows, and only the others are encoded again."""
    from moddiffy_jax.data import subset_split

    rows = changed_rows(split, token_ids)
    out = np.array(base, copy=True)
    if rows.size:
        out[rows] = represent(params, subset_split(split, rows))
    return out


def dev_floor(
    train_split: Any, dev_split: Any, attribute: str, num_classes: int, floor_z: float
) -> tuple[float, float]:
    """The attribute's leakage floor on dev (the task-label rule fit on
    ``train_split``) and ``floor_z`` standard errors of a balanced accuracy
    read there: how close to the floor a dev probe must come to stop."""
    from moddiffy_jax.eval import removal

    task_tr, task_dev = np.asarray(train_split.task), np.asarray(dev_split.task)
    y_dev = np.asarray(dev_split.attrs[attribute])
    floor = removal.leakage_floor(
        task_tr,
        np.asarray(train_split.attrs[attribute]),
        task_dev,
        y_dev,
        num_task_classes=int(max(task_tr.max(), task_dev.max())) + 1,
        num_attr_classes=int(num_classes),
    )
    return floor, floor_z * balanced_accuracy_se(floor, y_dev)


def _default_leakage(h_train, y_train, h_dev, y_dev, num_classes: int) -> float:
    from moddiffy_jax.eval import removal

    return removal.fresh_linear_leakage(
        {"train": h_train, "dev": h_dev},
        {"train": np.asarray(y_train), "dev": np.asarray(y_dev)},
        num_classes=num_classes,
    )


def build_merges(
    core: Any,
    train_split: Any,
    dev_split: Any,
    attributes: Mapping[str, int],
    represent: Callable[[Any, Any], np.ndarray],
    predict: Callable[[np.ndarray], np.ndarray],
    *,
    max_drop: float = 1.5,
    candidates: int = 64,
    share: float = 0.1,
    select_train: int = 2000,
    floor_stop: bool = True,
    cost_z: float = 1.0,
    floor_z: float = 1.0,
    target: float = 0.75,
    leakage_probe: Callable[..., float] | None = None,
    order: str = "counterparts",
    every_size: bool = True,
    info: Mapping[str, Any] | None = None,
) -> dict[str, MergeChoice]:
    """Per attribute, the token-merge diff a task budget allows.

    Ranks the tokens by ``I(token present; attribute | task label)`` on
    ``train_split`` (:func:`~moddiffy_jax.methods.word_rows.attribute_tokens`,
    at most ``candidates``, each at least ``share`` of the best), orders them
    (``order``: ``counterparts``, the default, whole groups of one token per
    class, :func:`counterpart_groups`; ``balanced`` or ``greedy``,
    :func:`merge_order`, or ``information``, the ranking as it is; every
    merged token takes the candidates' mean row), reads the task cost of
    merging each prefix (every whole group; otherwise every size, or with
    ``every_size=False`` the sizes in :data:`COUNTS`; a prefix re-encodes
    only the examples holding the tokens it adds, so all prefixes cost one
    encoding of the examples the candidates touch) (the
    run's own head through ``predict``; accuracy points lost on the first
    ``select_train`` training examples and the dev split, pooled, with the
    standard error of that paired difference) and chooses the prefix with
    :func:`choose_count`: the longest whose fitted cost plus ``cost_z``
    standard errors is within ``max_drop`` points, stopping
    (``floor_stop``) at the first whose dev leakage
    (``leakage_probe(h_train, y_train, h_dev, y_dev, num_classes)``,
    default a fresh class-balanced logistic regression on the standardized
    representations, fit on the same training examples) is within
    ``floor_z`` standard errors of the attribute's dev floor or has closed
    ``target`` of the gap between the core's dev leakage and that floor
    (default 0.75: a margin over half the gap for the dev probe's noise,
    without paying task points for removal past it; 1 merges on to the
    floor; docs/efficacy.md, "Stop 32").

    Args:
      core: the encoder params the diffs are built on.
      train_split, dev_split: tokenized splits (``input_ids``, ``task``,
        ``attrs``).
      attributes: ``{name: number of classes}``.
      represent: ``represent(params, split)`` -> [N, H] representations.
      predict: the task head's predicted class for [N, H] representations.
      max_drop, candidates, share, select_train, floor_stop, cost_z,
        floor_z, target, order, every_size: as above.
      leakage_probe: the dev probe (see above).
      info: extra fields stored in each diff's info.

    Returns:
      ``{attribute: MergeChoice}``, in the order of ``attributes``.
    """
    from moddiffy_jax.data import subset_split
    from moddiffy_jax.methods import word_rows

    if max_drop < 0:
        raise ValueError(f"max_drop must be >= 0 task points; got {max_drop}.")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}; got {order!r}.")
    if not cost_z >= 0:
        raise ValueError(f"cost_z must be >= 0 standard errors; got {cost_z}.")
    if select_train < 1:
        raise ValueError(f"select_train must be >= 1; got {select_train}.")
    if not floor_z >= 0:
        raise ValueError(f"floor_z must be >= 0 standard errors; got {floor_z}.")
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be a share of the gap in (0, 1]; got {target}.")
    probe = leakage_probe or _default_leakage
    table = _table(core)
    flat_core = dict(selection.flatten(core))
    n = min(select_train, len(train_split.task))
    select = subset_split(train_split, np.arange(n))
    pooled_task = np.concatenate([np.asarray(select.task), np.asarray(dev_split.task)])

    core_h = represent(core, select), represent(core, dev_split)

    def measure(params, ids, bases=core_h):
        """Which selection examples (train and dev, pooled) the task head
        gets right, and their train and dev representations, for ``params``
        that differ from those giving ``bases`` only in the word rows of
        ``ids`` (only the examples holding them are encoded again)."""
        h_tr, h_dev = (
            represent_merged(represent, params, split, base, ids)
            for split, base in zip((select, dev_split), bases, strict=True)
        )
        pred = np.concatenate([predict(h_tr), predict(h_dev)])
        return pred == pooled_task, h_tr, h_dev

    core_right = measure(core, [])[0]
    out = {}
    for attr, num_classes in attributes.items():
        ranked = word_rows.attribute_tokens(
            train_split, [attr], candidates, share, table.shape[0]
        )[attr]
        parts = []
        if order == "counterparts":
            parts = counterpart_groups(train_split, attr, ranked, table)
            ranked = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        elif order != "information":
            ranked = merge_order(train_split, attr, ranked, order)
        groups = tuple(len(g) for g in parts)
        y_tr, y_dev = np.asarray(select.attrs[attr]), np.asarray(dev_split.attrs[attr])
        floor, tolerance = dev_floor(select, dev_split, attr, num_classes, floor_z)
        if len(ranked) == 0:
            out[attr] = MergeChoice(attr, (), 0, floor, tolerance, [], None)
            continue
        # Every merged candidate takes the candidates' mean row (with the
        # counterparts' order too: their own groups' rows cost more on three
        # of four data samples; docs/efficacy.md, "Stop 33").
        shared_row = merge_target(core, ranked)
        cache: dict[int, tuple] = {}

        def reading(ids, shared_row=shared_row, cache=cache):
            # The longest shorter prefix read already gives every example
            # that holds none of the tokens this one adds.
            k = len(ids)
            if k not in cache:
                done = max((j for j in cache if j < k), default=0)
                bases = cache[done][1:] if done else core_h
                t = table.copy()
                t[ids] = shared_row
                params = selection.unflatten({**flat_core, WORD_TABLE: t})
                right, h_tr, h_dev = measure(params, ids[done:], bases)
                cache[k] = (paired_drop(core_right, right), h_tr, h_dev)
            return cache[k]

        def leak(ids, reading=reading, y_tr=y_tr, y_dev=y_dev, c=num_classes):
            _, h_tr, h_dev = reading(ids)
            return probe(h_tr, y_tr, h_dev, y_dev, int(c))

        if parts:  # whole groups only: half a pair is still a marker
            counts = [int(c) for c in np.cumsum(groups)]
        elif every_size:
            counts = list(range(1, len(ranked) + 1))
        else:
            counts = [c for c in COUNTS if c < len(ranked)] + [len(ranked)]
        start = stop_at = None
        stop = {}
        if floor_stop:
            start = float(probe(core_h[0], y_tr, core_h[1], y_dev, int(num_classes)))
            stop = {"leakage": leak, "floor": floor, "tolerance": tolerance}
            stop.update(start=start, target=target)
            stop_at = stop_level(floor, tolerance, start, target)
        k, read = choose_count(
            ranked,
            lambda ids, reading=reading: reading(ids)[0],
            max_drop,
            counts,
            cost_z=cost_z,
            **stop,
        )
        diff = None
        if k:
            diff = merge_diff(
                core,
                ranked[:k],
                shared_row,
                name=attr,
                info={"max_drop": max_drop, **dict(info or {})},
            )
        ranked_ids = tuple(int(t) for t in ranked)
        out[attr] = MergeChoice(
            attr, ranked_ids, k, floor, tolerance, read, diff, start, stop_at, groups
        )
    return out
