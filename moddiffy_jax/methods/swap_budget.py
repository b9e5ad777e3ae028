"""Which counterpart groups to swap: a bag-of-tokens read of each prefix.

A diff that is invariant to swapping an attribute's counterpart tokens
(objectives/counterfactual.py) removes what those words tell about the
attribute, and with it what they tell the task through the attribute
(where the attribute and the task label correlate). Swapping every group
reaches the floor and past it, and costs the task all the words are worth
(docs/efficacy.md, "Stop 39": the trained swap diffs landed within 0.3
points of a bag-of-tokens model's accuracy with every group merged).

So the groups are chosen as token merges are (methods/token_merge.py), by
reading what each prefix of the ranked groups would cost and remove, but
without a trained core: a logistic regression on which tokens an example
holds (its bag of tokens), fit on the training split and read on the dev
split, once with every token as it is and once per prefix of groups with
each group's tokens made one token. The task read gives the cost (accuracy
points lost), the attribute read (class-balanced) the removal (share of
the gap between the all-words read and the attribute's floor, the leakage
the gold task label alone gives). :func:`choose_groups` takes the fewest
groups that close ``target`` of that gap within ``max_drop`` points, or
else the most groups within ``max_drop``.

The read is a proxy for the encoder: it sees words, not their order or
their sub-word pieces; on the main job's synthetic data its all-groups
closure matched the trained swap diffs' (gender 1.82 read, 1.82 / 1.98
probed; age 1.22 read, 1.10 / 1.11 probed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.optimize
import scipy.sparse

from moddiffy_jax.eval import metrics
from moddiffy_jax.eval.removal import leakage_floor


@dataclasses.dataclass(frozen=True)
class PrefixRead:
    """The bag-of-tokens read of swapping the first ``groups`` groups."""

    groups: int
    task_accuracy: float  # dev accuracy of the task read
    leakage: float  # dev balanced accuracy of the attribute read
    cost: float  # task points lost against no group merged
    closed: float  # share of the gap to the floor closed


@dataclasses.dataclass(frozen=True)
class GroupChoice:
    """The groups chosen for one attribute, and the reads behind the choice."""

    attribute: str
    chosen: int
    floor: float
    target: float
    max_drop: float
    reads: tuple[PrefixRead, ...]
    reason: str
    # The groups' order the prefixes follow, as indices into the ranked
    # groups (empty: the rank order; :func:`efficient_order`).
    order: tuple[int, ...] = ()
    # With fillers (config.method.swap_one_sided): the one-sided steps read
    # and the one chosen after the ``chosen`` groups, if any
    # (methods/one_sided.py).
    half_reads: tuple[Any, ...] = ()
    one_sided: Any = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def final(self) -> Any:
        """The read of what is swapped: the chosen groups and the
        one-sided step, if any."""
        return self.one_sided or self.reads[self.chosen]


def bag_of_tokens(
    split: Any, groups: Sequence[Sequence[int]], columns: np.ndarray
) -> scipy.sparse.csr_matrix:
    """[N, len(columns)] 0/1: which of ``columns`` (sorted token ids) each
    example holds, every token of a group counted as the group's first."""
    ids = np.asarray(split.input_ids, np.int64)
    mask = np.asarray(split.attention_mask) > 0
    ids = ids.copy()
    for group in groups:
        group = np.asarray(group, np.int64)
        ids[np.isin(ids, group)] = group[0]
    rows = np.broadcast_to(np.arange(ids.shape[0])[:, None], ids.shape)[mask]
    tokens = ids[mask]
    col = np.searchsorted(columns, tokens)
    known = (col < columns.size) & (
        columns[np.minimum(col, columns.size - 1)] == tokens
    )
    x = scipy.sparse.csr_matrix(
        (np.ones(int(known.sum()), np.float64), (rows[known], col[known])),
        shape=(ids.shape[0], columns.size),
    )
    x.data[:] = 1.0  # presence, not counts
    return x


def fit_logistic(
    x: scipy.sparse.csr_matrix,
    y: np.ndarray,
    num_classes: int,
    *,
    balanced: bool = False,
    l2: float = 1.0,
    max_iter: int = 500,
) -> np.ndarray:
    """Multinomial logistic regression (L-BFGS; ``l2`` on the weights, not
    the intercepts; ``balanced``: each class weighs as much in total).
    Returns ``[features + 1, num_classes]`` (intercepts last)."""
    y = np.asarray(y, np.int64)
    n, d = x.shape
    weight = np.ones(n)
    if balanced:
        counts = np.bincount(y, minlength=num_classes).astype(np.float64)
        weight = n / (num_classes * np.maximum(counts, 1.0))[y]
    onehot = np.eye(num_classes)[y]
    xb = scipy.sparse.hstack([x, np.ones((n, 1))], format="csr")
    penalty = np.ones((d + 1, 1))
    penalty[-1] = 0.0

    def loss(flat):
        w = flat.reshape(d + 1, num_classes)
        logits = xb @ w
        logits -= logits.max(1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        value = (
            -(weight * (onehot * log_p).sum(1)).sum()
            + 0.5 * l2 * (penalty * w**2).sum()
        )
        grad = xb.T @ (weight[:, None] * (np.exp(log_p) - onehot)) + l2 * penalty * w
        return value, np.asarray(grad).ravel()

    start = np.zeros((d + 1) * num_classes)
    result = scipy.optimize.minimize(
        loss, start, jac=True, method="L-BFGS-B", options={"maxiter": max_iter}
    )
    return result.x.reshape(d + 1, num_classes)


def _predict(w: np.ndarray, x: scipy.sparse.csr_matrix) -> np.ndarray:
    return np.asarray(x @ w[:-1] + w[-1]).argmax(1)


def reader(
    train: Any,
    dev: Any,
    attribute: str,
    *,
    num_task_classes: int,
    num_attr_classes: int,
) -> tuple[Any, float]:
    """``(read, floor)``: ``read(merged)`` fits the task and the attribute
    reads with each group of ``merged`` made one token and returns their dev
    task accuracy and attribute balanced accuracy; ``floor`` is the
    attribute's floor on dev."""
    columns = np.unique(
        np.asarray(train.input_ids)[np.asarray(train.attention_mask) > 0]
    )
    task_tr, task_dev = np.asarray(train.task), np.asarray(dev.task)
    attr_tr = np.asarray(train.attrs[attribute])
    attr_dev = np.asarray(dev.attrs[attribute])
    floor = leakage_floor(
        task_tr,
        attr_tr,
        task_dev,
        attr_dev,
        num_task_classes=num_task_classes,
        num_attr_classes=num_attr_classes,
    )

    def read(merged: Sequence[Sequence[int]]) -> tuple[float, float]:
        x_tr, x_dev = (bag_of_tokens(s, merged, columns) for s in (train, dev))
        task_w = fit_logistic(x_tr, task_tr, num_task_classes)
        attr_w = fit_logistic(x_tr, attr_tr, num_attr_classes, balanced=True)
        accuracy = float((_predict(task_w, x_dev) == task_dev).mean())
        leak = metrics.balanced_accuracy(
            attr_dev, _predict(attr_w, x_dev), num_attr_classes
        )
        return accuracy, float(leak)

    return read, float(floor)


def read_prefixes(
    train: Any,
    dev: Any,
    attribute: str,
    groups: Sequence[Sequence[int]],
    *,
    counts: Sequence[int] | None = None,
    **kw: Any,
) -> tuple[list[PrefixRead], float]:
    """The read of every prefix of ``groups`` (0 .. all; ``counts``: only
    those numbers of groups, 0 first), and the floor (``num_task_classes``
    and ``num_attr_classes`` in ``kw``, as :func:`reader`'s)."""
    read, floor = reader(train, dev, attribute, **kw)
    raw = [
        (k, *read(groups[:k]))
        for k in (range(len(groups) + 1) if counts is None else counts)
    ]
    return _scaled(raw, floor), floor


def _scaled(raw: Sequence[tuple[int, float, float]], floor: float) -> list[PrefixRead]:
    """``(groups, accuracy, leakage)`` triples, the first with no group
    merged, as reads against the first."""
    _, base_acc, base_leak = raw[0]
    gap = base_leak - floor
    return [
        PrefixRead(
            groups=k,
            task_accuracy=round(acc, 4),
            leakage=round(leak, 4),
            cost=round(100.0 * (base_acc - acc), 2),
            closed=round((base_leak - leak) / gap, 3) if gap > 0 else 0.0,
        )
        for k, acc, leak in raw
    ]


#: The smallest cost (task points) :func:`efficient_order` divides a
#: group's removal by: a read's cost is noisy at a few dev examples, and a
#: group that costs nothing would otherwise win on noise alone.
MIN_COST = 0.25


def efficient_order(
    train: Any,
    dev: Any,
    attribute: str,
    groups: Sequence[Sequence[int]],
    *,
    target: float,
    max_drop: float,
    **kw: Any,
) -> tuple[list[PrefixRead], float, tuple[int, ...]]:
    """The groups in the order of their removal per task point, greedily:
    from no group merged, each step reads every group left added to those
    taken and takes the one whose read closes the most of the gap per point
    of task accuracy lost (the cost at least :data:`MIN_COST`) among those
    whose read costs at most ``max_drop`` points, until a read closes
    ``target`` of the gap or none is within ``max_drop`` (where none is from
    the start, the first ranked group, as the rank order's choice takes it);
    the groups not taken follow in rank order, unread. The reads are the
    taken prefixes' (as :func:`read_prefixes`'s are the ranked ones');
    returns them, the floor and the order (indices into ``groups``).

    About ``k * len(groups)`` reads for ``k`` groups taken instead of
    ``len(groups) + 1``. The rank order (:func:`read_prefixes`) takes the
    groups by how well their words tell the attribute; on the main job's
    data a group that tells it well can cost the task as much as it removes
    (docs/efficacy.md, "Stop 49")."""

    read, floor = reader(train, dev, attribute, **kw)
    raw, taken = [(0, *read([]))], []
    left = list(range(len(groups)))
    while left:
        here = _scaled(raw, floor)[-1]
        reads = []
        for i in left:
            acc, leak = read([groups[j] for j in [*taken, i]])
            r = _scaled([raw[0], (len(taken) + 1, acc, leak)], floor)[-1]
            gain = (r.closed - here.closed) / max(r.cost - here.cost, MIN_COST)
            reads.append((gain, i, acc, leak, r))
        fits = [c for c in reads if c[4].cost <= max_drop]
        if not fits and taken:
            break
        # None fits from the start: the first ranked group, as the rank
        # order's choice would take it (over budget).
        _, i, acc, leak, r = max(fits, key=lambda c: c[0]) if fits else reads[0]
        taken.append(i)
        left.remove(i)
        raw.append((len(taken), acc, leak))
        if r.closed >= target or not fits:
            break
    return _scaled(raw, floor), floor, (*taken, *left)


def choose_count(
    reads: Sequence[PrefixRead], target: float, max_drop: float
) -> tuple[int, str]:
    """The fewest groups (at least one) closing ``target`` of the gap within
    ``max_drop`` points; else the most within ``max_drop``; the first group
    alone when even it costs more. Returns the count and why."""
    at, why = pick_step(reads[1:], target, max_drop)
    return (1, why) if at is None else (reads[1:][at].groups, why)


def pick_step(
    steps: Sequence[Any], target: float, max_drop: float
) -> tuple[int | None, str]:
    """The rule every swap choice applies to its steps, in order (reads
    with ``cost`` and ``closed``): the index of the first that closes
    ``target`` of the gap within ``max_drop`` points ("target"), else of
    the last within ``max_drop`` ("budget"), else ``None`` ("over
    budget")."""
    within = [i for i, r in enumerate(steps) if r.cost <= max_drop]
    reached = [i for i in within if steps[i].closed >= target]
    if reached:
        return reached[0], "target"
    if within:
        return within[-1], "budget"
    return None, "over budget"


def choose_steps(
    reads: Sequence[PrefixRead],
    halves: Sequence[Any],
    chosen: int,
    reason: str,
    target: float,
    max_drop: float,
) -> tuple[int, Any, str]:
    """The whole-group choice ``(chosen, reason)`` over ``reads`` (indexed
    by group count) revisited with the one-sided steps ``halves``
    (one_sided.HalfRead) between the whole counts: :func:`pick_step` over
    the steps in order, ``k`` groups before ``k`` and a half before
    ``k + 1``. Returns ``(groups, half or None, reason)``; the whole
    choice as it was where no step is within ``max_drop``."""
    steps = [(r.groups, 0, r) for r in reads[1:]]
    steps += [(h.groups, 1, h) for h in halves]
    steps.sort(key=lambda s: (s[0], s[1]))
    at, why = pick_step([s[2] for s in steps], target, max_drop)
    if at is None:
        return chosen, None, reason
    groups, half, read = steps[at]
    return (groups, read, why + " (one-sided)") if half else (groups, None, why)


def choose_groups(
    train: Any, dev: Any, attribute: str, groups: Sequence[Sequence[int]], **kw: Any
) -> GroupChoice:
    """Reads every prefix of ``groups`` (:func:`read_prefixes`, whose
    ``num_task_classes`` and ``num_attr_classes`` go in ``kw``) and chooses
    how many to swap (:func:`choose_count`, ``target`` and ``max_drop`` in
    ``kw``); ``efficient=True`` in ``kw``: also reads
    :func:`efficient_order`'s order and takes its choice where it is better
    (reaches the target at less cost, or closes more within the budget;
    the choice's ``order`` then names it and its reads are that order's).
    ``fillers`` (token ids) in ``kw``: also reads the one-sided steps on
    either side of the choice (methods/one_sided.py) and takes one where
    the rule prefers it (the choice's ``one_sided``)."""
    target, max_drop = kw.pop("target"), kw.pop("max_drop")
    efficient = kw.pop("efficient", False)
    fillers = kw.pop("fillers", None)
    if fillers is not None and kw.get("counts") is not None:
        raise ValueError(
            "fillers (one-sided steps) are read beside a choice of groups; "
            "counts reads only some prefixes and makes none: give one or the other."
        )
    reads, floor = read_prefixes(train, dev, attribute, groups, **kw)
    chosen, reason = choose_count(reads, target, max_drop)
    order = ()
    if efficient:
        kw.pop("counts", None)
        greedy, _, greedy_order = efficient_order(
            train, dev, attribute, groups, target=target, max_drop=max_drop, **kw
        )
        count, why = choose_count(greedy, target, max_drop)
        if _better(greedy[count], why, reads[chosen], reason):
            reads, chosen, reason, order = greedy, count, why, greedy_order
    halves, half = (), None
    if fillers is not None and len(fillers):
        kw.pop("counts", None)
        from moddiffy_jax.methods import one_sided

        ordered = [groups[i] for i in order] if order else list(groups)
        read, floor = reader(train, dev, attribute, **kw)
        base = (0, *read([]))

        def scaled(merged):
            return _scaled([base, (len(merged), *read(merged))], floor)[-1]

        halves = tuple(
            one_sided.half_reads(
                scaled, ordered, fillers, (chosen - 1, chosen), target, max_drop
            )
        )
        chosen, half, reason = choose_steps(
            reads, halves, chosen, reason, target, max_drop
        )
    return GroupChoice(
        attribute=attribute,
        chosen=chosen,
        floor=round(floor, 4),
        target=target,
        max_drop=max_drop,
        reads=tuple(reads),
        reason=reason,
        order=tuple(int(i) for i in order),
        half_reads=halves,
        one_sided=half,
    )


def _better(a: PrefixRead, why_a: str, b: PrefixRead, why_b: str) -> bool:
    """Whether choice ``a`` beats ``b``: reaching the target beats not;
    between two that reach it the cheaper wins, between two that do not the
    one within budget that closes more (ties: ``b``)."""
    reach_a, reach_b = why_a == "target", why_b == "target"
    if reach_a != reach_b:
        return reach_a
    if reach_a:
        return a.cost < b.cost
    if (why_a == "budget") != (why_b == "budget"):
        return why_a == "budget"
    return a.closed > b.closed


def calibrated(
    reads: Sequence[PrefixRead], chosen: int, closed: float, cost: float
) -> list[PrefixRead]:
    """The prefix reads scaled to what a trained diff on the first
    ``chosen`` groups was measured to remove (``closed``, share of the gap)
    and cost (``cost``, task points): every read's closure times the ratio
    of the measured closure to the read's at ``chosen``, every cost plus
    their difference (methods/swap_reread.py). A read at ``chosen`` that
    closes nothing keeps the closures as they are."""
    at = reads[chosen]
    ratio = closed / at.closed if at.closed > 0.05 else 1.0
    shift = cost - at.cost
    return [
        dataclasses.replace(
            r,
            closed=round(r.closed * ratio, 3),
            cost=round(r.cost + shift, 2) if r.groups else 0.0,
        )
        for r in reads
    ]


#: The range :func:`gap_weight` keeps an attribute's scale of the swap
#: weight in (a read gap near 0 or far past the reference is a poor guide).
GAP_SCALE_RANGE = (0.25, 4.0)


def read_gap(choice: GroupChoice) -> float:
    """The gap the swaps are to close, as the read sees it: the all-words
    read's leakage (no group merged) minus the attribute's floor."""
    return float(choice.reads[0].leakage) - float(choice.floor)


def gap_weight(weight: float, gap: float, reference: float) -> float:
    """``config.method.swap_gap_reference``: the swap weight of an attribute
    whose read gap is ``gap``, for a recipe whose weight ``weight`` suits a
    gap of ``reference`` (both in balanced accuracy): ``weight`` times
    ``gap / reference``, the ratio kept within :data:`GAP_SCALE_RANGE`.

    Why in proportion: the twin distance is in units of the batch's spread
    and is driven near 0 within the first tens of steps for every attribute
    (docs/efficacy.md, "Stop 49"); what is left for the probes is what the
    unswapped words and the context carry, and the task term's pull that
    keeps it grows with the gap. Measured on the main job's generator
    (stop 48): gender (read gap 0.07-0.09) at the recipe's 10, age (0.20-
    0.23) wanted 30."""
    low, high = GAP_SCALE_RANGE
    return float(weight) * min(max(gap / float(reference), low), high)
