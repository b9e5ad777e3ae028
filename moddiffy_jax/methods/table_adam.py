"""AdamW with one step normalizer per table: rows move in proportion to their evidence.

AdamW divides every entry's first moment by that entry's own root second
moment, so an entry whose gradient is consistent moves about ``lr`` per
step however weak that gradient is. On a diff's word-embedding table this
moves every row the batches use by the same amount: the rows of the words
that carry an attribute and the rows of the task's words alike
(docs/efficacy.md, "Stop 25": at 20 times ``lr_diff`` every used row is
rewritten by two to three times its norm).

``scale_by_table_adam`` keeps Adam's per-entry first moment and second
moment but divides the whole table by one number: the root mean second
moment over the entries that have had any gradient. An entry with the
table's typical gradient moves about ``lr``; an entry with a tenth of it
moves about a tenth as far. Rows no batch has used keep a zero update.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class TableAdamState(NamedTuple):
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def _table_rms(nu: jax.Array) -> jax.Array:
    """Root mean of ``nu`` over its non-zero entries (0 when all are zero)."""
    seen = nu > 0
    n = jnp.maximum(jnp.sum(seen), 1)
    return jnp.sqrt(jnp.sum(jnp.where(seen, nu, 0.0)) / n)


def scale_by_table_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> optax.GradientTransformation:
    """Adam's bias-corrected moments, the update divided per leaf by
    ``sqrt(mean of the non-zero second moments) + eps``."""

    def init(params):
        # Two trees, not one twice: a jitted step donates every state buffer.
        mu = jax.tree.map(jnp.zeros_like, params)
        nu = jax.tree.map(jnp.zeros_like, params)
        return TableAdamState(jnp.zeros([], jnp.int32), mu, nu)

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
        c1 = 1 - b1 ** count.astype(jnp.float32)
        c2 = 1 - b2 ** count.astype(jnp.float32)

        def step(m, v):
            return (m / c1) / (_table_rms(v / c2) + eps)

        return jax.tree.map(step, mu, nu), TableAdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def table_adamw(
    learning_rate: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """:func:`scale_by_table_adam`, decoupled weight decay, then ``-lr``
    (the order of ``optax.adamw``)."""
    return optax.chain(
        scale_by_table_adam(b1, b2, eps),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
