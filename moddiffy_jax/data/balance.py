"""Upsampling the train split so that an attribute is balanced within each task label.

Like the paper's balanced training sets (e.g. PAN16 with as many female as male
authors), but done in code: within every task label, every value of the chosen
attribute is upsampled to the count of the most frequent value for that label.
Only train is changed; dev and test keep their natural distribution. The
copies follow the original rows, and :func:`original_train` gives train as
read back for what is measured there (probes, INLP, the leakage floor).
"""

from __future__ import annotations

import numpy as np

from moddiffy_jax.data.dataset import DatasetT, RawSplit, TextDataset, subset_split


def balance_train_split(
    dataset: TextDataset, *, attribute: str, seed: int
) -> TextDataset:
    """Upsamples train so every (task label, attribute value) cell is equal.

    For each task label ``t`` present in train, let ``m_t`` be the largest
    count over attribute values; each cell ``(t, a)`` with ``n < m_t``
    examples gets ``m_t - n`` extra copies: whole repeats of the cell, then a
    seeded sample without replacement for the remainder. The originals keep
    their order and the copies follow, grouped by cell.

    Args:
      dataset: the dataset; only ``dataset.splits["train"]`` is changed.
      attribute: attribute name to balance.
      seed: seed for the remainder sample (deterministic).

    Returns:
      A new :class:`TextDataset` with the balanced train split.

    Raises:
      ValueError: unknown attribute, or an empty cell (a value of the attribute
        never occurs with some task label in train, so nothing can be
        upsampled).
    """
    if attribute not in dataset.attr_classes:
        raise ValueError(
            f"Cannot balance on unknown attribute {attribute!r}; valid: "
            f"{list(dataset.attr_classes)}."
        )
    train = dataset.splits["train"]
    attr = train.attrs[attribute]
    rng = np.random.default_rng([seed, 0xBA1])
    extra = []
    for t in np.unique(train.task):
        cells = [
            np.flatnonzero((train.task == t) & (attr == a))
            for a in range(len(dataset.attr_classes[attribute]))
        ]
        empty = [
            dataset.attr_classes[attribute][a]
            for a, c in enumerate(cells)
            if not len(c)
        ]
        if empty:
            raise ValueError(
                f"Cannot balance {attribute!r} within task label "
                f"{dataset.task_classes[t]!r}: no train example with value(s) {empty}."
            )
        target = max(len(c) for c in cells)
        for cell in cells:
            short = target - len(cell)
            repeats, rest = divmod(short, len(cell))
            extra.extend([cell] * repeats)
            extra.append(np.sort(rng.choice(cell, size=rest, replace=False)))
    indices = np.concatenate([np.arange(len(train))] + extra).astype(np.int64)
    splits = dict(dataset.splits)
    splits["train"] = train.take(indices)
    originals = dataset.train_originals or len(train)
    return dataset.replace(splits=splits, train_originals=originals)


def original_train(dataset: DatasetT) -> DatasetT:
    """``dataset`` with train as read: the upsampled copies of
    :func:`balance_train_split` dropped (they follow the originals).

    What is measured on train reads the data as it is: the leakage probes
    and INLP fit there, and the floor's rule (the attribute value each task
    label makes likeliest) is estimated there; on a train split balanced
    within each task label that rule has nothing to go on, and probes fit on
    duplicated minority rows read the attribute differently from the rest
    of the table. A dataset that was not upsampled (or a kind without
    balancing, e.g. an image dataset) is returned as it is.
    """
    n = getattr(dataset, "train_originals", None)
    if n is None:
        return dataset
    train = dataset.splits["train"]
    rows = np.arange(n)
    kept = (
        train.take(rows) if isinstance(train, RawSplit) else subset_split(train, rows)
    )
    return dataset.replace(
        splits={**dataset.splits, "train": kept}, train_originals=None
    )
