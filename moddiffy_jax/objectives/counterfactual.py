"""Counterfactual token-swap invariance (``config.method.swap_weight``).

An attribute that words carry (she / he, sister / brother, names) is removed
from a representation when the representation no longer changes as those
words are swapped for their counterparts of another class. The swap is a
permutation of the vocabulary (:func:`swap_table`: within each counterpart
group, each token maps to the next class's token; every other token to
itself), so the swapped batch is ``table[input_ids]`` and costs one more
encoder pass. :func:`swap_invariance_loss` is the squared distance between
each example's representation and its swapped twin's, over the examples the
swap changes, in units of the batch's spread; the modular debias step adds
it for its attribute (methods/common.py). It is the training-time form of
counterfactual data substitution (Zmigrod et al. 2019; Webster et al. 2020)
and of the token merges (methods/token_merge.py), which give the swapped
words one shared row in closed form; here the diff learns the invariance
and the task term keeps what the task needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def swap_table(groups: Sequence[Sequence[int]], vocab: int) -> np.ndarray:
    """The [vocab] int32 permutation that swaps each group's tokens cyclically.

    Args:
      groups: token ids, one group per counterpart set (one token per class
        of the attribute, e.g. ``[she, he]``); a group's ``i``-th token maps
        to its ``(i + 1)``-th, the last to the first. Groups must not share
        a token.
      vocab: the vocabulary size.

    Returns:
      ``table`` with ``table[t]`` the token ``t`` is swapped for (``t``
      itself outside every group).

    Raises:
      ValueError: on a token outside ``[0, vocab)`` or in two groups.
    """
    table = np.arange(vocab, dtype=np.int32)
    seen: set[int] = set()
    for group in groups:
        ids = [int(t) for t in np.asarray(group).reshape(-1)]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"Token ids {bad} are outside the vocabulary [0, {vocab})."
            )
        again = sorted(seen.intersection(ids)) or sorted(
            {t for t in ids if ids.count(t) > 1}
        )
        if again:
            raise ValueError(
                f"Tokens {again} are in more than one counterpart group (or twice "
                "in one); a swap must be a permutation."
            )
        seen.update(ids)
        for i, t in enumerate(ids):
            table[t] = ids[(i + 1) % len(ids)]
    return table


def outside(delta: jax.Array, keep: jax.Array) -> jax.Array:
    """Each row of ``delta`` [B, H] without its component in the span of
    that row's ``keep`` directions [B, K, H] (a least-squares projection, so
    the directions need not be orthogonal; a zero direction is ignored)."""
    gram = jnp.einsum("bkh,bjh->bkj", keep, keep)
    coef = jnp.einsum(
        "bkj,bj->bk", jnp.linalg.pinv(gram), jnp.einsum("bkh,bh->bk", keep, delta)
    )
    return delta - jnp.einsum("bk,bkh->bh", coef, keep)


def decision_moved(core: jax.Array, core_twin: jax.Array) -> jax.Array:
    """[B] float32: 1 where the core's decision (argmax of its task
    log-probabilities ``core`` [B, C]) differs from its decision on the
    swapped twin ``core_twin`` [B, C], else 0 (``swap_keep_pivotal``: only
    there may the twins differ along the decision directions)."""
    moved = jnp.argmax(core, -1) != jnp.argmax(core_twin, -1)
    return jax.lax.stop_gradient(moved.astype(jnp.float32))


def kl_where(teacher: jax.Array, logits: jax.Array, rows: jax.Array) -> jax.Array:
    """Mean KL divergence from ``teacher`` (log-probabilities [B, C], no
    gradient) to ``softmax(logits)`` [B, C] over the rows where ``rows`` [B]
    (bool) is set; 0 for a batch without such rows (``swap_distill``: the
    core's prediction kept where the swap changes no word)."""
    student = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    teacher = jax.lax.stop_gradient(teacher)
    kl = jnp.sum(jnp.exp(teacher) * (teacher - student), -1)
    w = rows.astype(jnp.float32)
    return jnp.sum(w * kl) / jnp.maximum(jnp.sum(w), 1.0)


def swap_invariance_loss(
    h: jax.Array,
    h_swapped: jax.Array,
    changed: jax.Array,
    keep: jax.Array | None = None,
) -> jax.Array:
    """Mean squared distance between ``h`` [B, H] and ``h_swapped`` [B, H]
    over the rows where ``changed`` [B] (bool) is set, divided by the
    batch's total variance of ``h``, so the term is 1 when a twin is as far
    as a random other example and 0 when the swap leaves the representation
    unchanged; 0 for a batch the swap does not touch.

    The gradient flows through the scale too, so the term does not change
    when the whole batch shrinks or grows. With the scale held fixed
    (before stop 41) shrinking every representation lowered it as much as
    removing the attribute did, and on some training seeds a dense diff
    took that way in its first ten steps: the representation collapsed,
    the twins met, and the diff's task loss sat at chance through the L0
    phase (docs/efficacy.md, "Stop 41").

    With ``keep`` [B, K, H] (``swap_keep_task``: the directions that move
    the task head's decision) the distance leaves those directions out: the
    twins may differ in what the head reads, as long as they differ nowhere
    else, so the words keep what they tell the task through the attribute
    and a probe can read the attribute only as far as the decision tells
    it."""
    h = h.astype(jnp.float32)
    delta = h - h_swapped.astype(jnp.float32)
    if keep is not None:
        delta = outside(delta, keep.astype(jnp.float32))
    d = jnp.sum(jnp.square(delta), axis=-1)
    w = changed.astype(jnp.float32)
    spread = jnp.maximum(2.0 * jnp.sum(jnp.var(h, axis=0)), 1e-12)
    return jnp.sum(w * d) / jnp.maximum(jnp.sum(w), 1.0) / spread
