"""The named terms every loss of a sub-step returns.

A loss returns ``(total, terms)``: ``terms`` maps names ("task", "mmd/age",
"l0/gender", ...) to scalars that are summed into the loss and logged, plus
two reserved keys whose values are dicts and are not summed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

#: ``{key: value}`` state that is not differentiated but replaced in the
#: trainable tree after the update (BatchNorm running statistics:
#: ``{("core", "batch_stats"): new_stats}``; the MMD's running covariance;
#: the task guard).
STATE_KEY = "_state"
#: Reserved key of the batch a sub-step's loss sees: the train step's global
#: step counter (the removal warm-up reads it).
STEP_KEY = "_step"
#: ``{name: value}`` that is logged, not added to the loss (the task
#: guard's running gap and weight).
INFO_KEY = "_info"


def merge_terms(terms: dict[str, Any], new: Mapping[str, Any]) -> None:
    """``terms.update(new)``, but :data:`STATE_KEY` and :data:`INFO_KEY`
    entries accumulate."""
    for key, value in new.items():
        if key in (STATE_KEY, INFO_KEY):
            terms.setdefault(key, {}).update(value)
        else:
            terms[key] = value


def total(terms: Mapping[str, Any]) -> jax.Array:
    """The loss: the sum of every term but the reserved ones."""
    return sum(v for k, v in terms.items() if k not in (STATE_KEY, INFO_KEY))
