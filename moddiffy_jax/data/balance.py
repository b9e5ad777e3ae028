"""Upsampling the train split so that an attribute is balanced within each task label.

Like the paper's balanced training sets (e.g. PAN16 with as many female as male
authors), but done in code: within every task label, every value of the chosen
attribute is upsampled to the count of the most frequent value for that label.
Only train is changed; dev and test keep their natural distribution.
"""

from __future__ import annotations

import numpy as np

from moddiffy_jax.data.dataset import TextDataset


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
    return dataset.replace(splits=splits)
