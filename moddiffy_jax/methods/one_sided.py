"""One-sided swap groups: a marker word hidden among its attribute's fillers.

A counterpart swap (objectives/counterfactual.py) hides a pair of words,
one of each class (retired / classmates): a diff invariant to the swap
reads both alike. So a swap diff's removal moves in steps of whole pairs,
and where the attribute also predicts the task every pair costs the task
what its words told it. On README command 1's data an age pair is a fifth
of the markers; at the Bayes optimum two pairs close 0.49 of the gap to
the floor at 1.43 points and three 0.73 at 2.15 (docs/efficacy.md,
"Stop 73"), so the bar (half the gap within 2 points) lies between two
steps.

The step between: one word of the next pair swapped, cyclically, with the
attribute's *filler* tokens, the words that stand where no marker of the
attribute is (``today`` or ``lately`` in a sentence with no age word). A
diff invariant to that swap reads the word as it reads an example with no
marker. The word's counterpart stays readable, so the pair's removal is
only part-done; what the task read from the word stays largely too (the
merged state still leans to the word's class): at the optimum, two pairs
and one old word so hidden close 0.58 of age's gap at the same 1.43
points as two pairs.

:func:`filler_tokens` finds the fillers on the training split, with no
list of words: tokens that appear almost only in examples that hold none
of the attribute's marker tokens (the groups' tokens), often enough to
matter, and whose examples' attribute classes do not differ from those
of the examples with no marker (a chi-square test). Data where an
attribute's words have no such stand-ins (a dialect spread over many
words, say) get no fillers and so no one-sided step.
:func:`attribute_fillers` applies it to a run's data, leaving out every
other attribute's telling tokens. :func:`half_reads` reads the one-sided
steps beside a choice of whole groups; methods/swap_budget.py
(``choose_steps``) takes one where its rule for whole groups prefers it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.stats

#: A filler is present in at least this share of the training examples
#: (and at least :data:`MIN_COUNT` of them).
MIN_SHARE = 0.005
MIN_COUNT = 10
#: At most this share of the examples a filler is in hold a marker, as a
#: share of the split's own marker rate (a token independent of the
#: markers has 1).
MAX_OVERLAP = 0.1
#: A filler's examples' attribute classes against those of the examples
#: with no marker: the chi-square test's p-value must be at least this.
MIN_P = 0.05
#: At most this many fillers (the most frequent) share the hidden word's
#: cycle.
MAX_FILLERS = 8


def filler_tokens(
    split: Any,
    attribute: str,
    markers: Sequence[int],
    vocab: int,
    exclude: Sequence[int] = (),
) -> np.ndarray:
    """The attribute's filler tokens on ``split``, most frequent first.

    ``markers``: the attribute's marker tokens (its counterpart groups'
    tokens); ``exclude``: tokens never to take (another attribute's
    markers, which a filler swap would hide from that attribute's diff's
    view). A filler is in at least :data:`MIN_SHARE` (and
    :data:`MIN_COUNT`) of the examples, appears with a marker in at most
    :data:`MAX_OVERLAP` times the split's marker rate of its examples (so
    never is one), and its examples' attribute classes pass a chi-square
    test against those of the examples with no marker (p >=
    :data:`MIN_P`): a filler tells what a marker's absence tells, no more.
    At most :data:`MAX_FILLERS`; empty where none qualifies."""
    from moddiffy_jax.methods.word_rows import _present

    attr = np.asarray(split.attrs[attribute], np.int64)
    n, n_classes = attr.size, int(attr.max()) + 1 if attr.size else 0
    markers = np.unique(np.asarray(markers, np.int64).reshape(-1))
    if n == 0 or markers.size == 0:
        return np.zeros(0, np.int64)
    rows, tokens = _present(split.input_ids, split.attention_mask, vocab)
    marked = np.zeros(n, bool)
    marked[rows[np.isin(tokens, markers)]] = True
    rate = marked.mean()
    count = np.bincount(tokens, minlength=vocab)
    with_marker = np.bincount(tokens[marked[rows]], minlength=vocab)
    unmarked = np.bincount(attr[~marked], minlength=n_classes)
    share = unmarked / max(int(unmarked.sum()), 1)
    ok = count >= max(MIN_COUNT, MIN_SHARE * n)
    ok &= with_marker <= MAX_OVERLAP * rate * count
    ok &= ~np.isin(np.arange(vocab), np.asarray(exclude, np.int64))
    out = []
    for t in np.flatnonzero(ok):
        observed = np.bincount(attr[rows[tokens == t]], minlength=n_classes)
        expected = share * observed.sum()
        seen = expected > 0
        if seen.sum() < 2:
            continue
        p = scipy.stats.chisquare(observed[seen], expected[seen]).pvalue
        if p >= MIN_P:
            out.append(int(t))
    out.sort(key=lambda t: (-count[t], t))
    return np.asarray(out[:MAX_FILLERS], np.int64)


def attribute_fillers(
    split: Any,
    attribute: str,
    groups: Sequence[Sequence[int]],
    attributes: Sequence[str],
    candidates: int,
    share: float,
) -> np.ndarray:
    """:func:`filler_tokens` of ``attribute`` on ``split``: its groups'
    tokens are the markers, and every other attribute's telling tokens
    (word_rows.attribute_tokens, with the swap groups' ``candidates`` and
    ``share``) are excluded, so a filler swap never hides another
    attribute's word from that attribute's diff."""
    from moddiffy_jax.methods import word_rows

    vocab = int(np.asarray(split.input_ids).max()) + 1
    others = word_rows.attribute_tokens(
        split, [a for a in attributes if a != attribute], candidates, share, vocab
    )
    return filler_tokens(
        split,
        attribute,
        np.concatenate([np.zeros(0, np.int64), *(np.ravel(g) for g in groups)]),
        vocab,
        exclude=np.concatenate([np.zeros(0, np.int64), *others.values()]),
    )


@dataclasses.dataclass(frozen=True)
class HalfRead:
    """The read of the first ``groups`` groups and one word of the next
    hidden one-sidedly (``word``, among ``fillers``)."""

    groups: int
    word: int
    fillers: tuple[int, ...]
    task_accuracy: float
    leakage: float
    cost: float
    closed: float

    @property
    def group(self) -> np.ndarray:
        """The one-sided swap group: the word first, then its fillers."""
        return np.asarray([self.word, *self.fillers], np.int64)


def half_reads(
    read: Callable[[Sequence[Sequence[int]]], Any],
    groups: Sequence[Sequence[int]],
    fillers: Sequence[int],
    at: Sequence[int],
    target: float,
    max_drop: float,
) -> list[HalfRead]:
    """For each ``k`` in ``at`` (``k < len(groups)``): the first ``k`` groups
    and one word of group ``k`` hidden with ``fillers``, whichever of the
    group's words reads better (within ``max_drop`` before over it; then
    one that closes ``target`` of the gap, the cheaper of two that do;
    else the more of the gap closed). ``read(merged)`` is a
    scaled read (a :class:`~moddiffy_jax.methods.swap_budget.PrefixRead`,
    or anything with ``task_accuracy``, ``leakage``, ``cost`` and
    ``closed``)."""
    fillers = tuple(int(f) for f in fillers)
    out = []
    for k in sorted(set(at)):
        if not 0 <= k < len(groups) or not fillers:
            continue
        best = None
        for word in np.asarray(groups[k]).reshape(-1):
            r = read([*groups[:k], [int(word), *fillers]])
            half = HalfRead(
                groups=k,
                word=int(word),
                fillers=fillers,
                task_accuracy=r.task_accuracy,
                leakage=r.leakage,
                cost=r.cost,
                closed=r.closed,
            )
            reaches = half.closed >= target
            key = (
                half.cost <= max_drop,
                reaches,
                -half.cost if reaches else half.closed,
                half.closed,
            )
            if best is None or key > best[0]:
                best = (key, half)
        out.append(best[1])
    return out
