"""Dropout whose mask XLA can fuse: ``flax.linen.Dropout``'s masks, bit for bit.

``flax.linen.Dropout`` draws its keep mask with ``jax.random.bernoulli``,
which on CPU lowers JAX's Threefry hash as a rolled loop of five iterations
over full uint32 arrays: every dropout site of a BERT layer becomes a
``while`` loop of about 75 small kernels (its counters, copies and
rotations) that XLA cannot fuse into the ``select`` that applies the mask.
A MiniLM training step has 20 such sites per forward pass
(docs/speed.md, "Dropout through the fusible hash").

:class:`Dropout` is the same module (same fields, the same ``make_rng``
stream under the same auto-generated name ``Dropout_<i>``, the same scaling)
with the keep mask drawn through :func:`moddiffy_jax.subnets.noise.uniform`,
the straight-line Threefry that gives ``jax.random.uniform``'s numbers bit
for bit: ``uniform(key, shape) < keep_prob`` is ``bernoulli(key, keep_prob,
shape)``, so a model built with it trains on exactly the masks it had
(``tests/test_bert.py`` checks outputs and gradients against
``flax.linen.Dropout``).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from moddiffy_jax.subnets import noise


class Dropout(nn.Module):
    """``flax.linen.Dropout`` with a fusible mask (see the module doc).

    Attributes:
      rate: the probability of dropping an element.
      broadcast_dims: dimensions along which one mask value is shared.
      deterministic: if true, the inputs are returned unchanged.
      rng_collection: the rng stream the mask's key comes from.
    """

    rate: float
    broadcast_dims: Sequence[int] = ()
    deterministic: bool | None = None
    rng_collection: str = "dropout"

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        deterministic: bool | None = None,
        rng: jax.Array | None = None,
        full: tuple[int, int] | None = None,
    ) -> jax.Array:
        """``full`` (``(axis, length)``): ``inputs`` are the leading positions
        along ``axis`` of a tensor with ``length`` there, and get that
        tensor's mask, cut (a layer that computes only its [CLS] outputs
        drops what the whole layer would)."""
        deterministic = nn.merge_param(
            "deterministic", self.deterministic, deterministic
        )
        if self.rate == 0.0 or deterministic:
            return inputs
        if self.rate == 1.0:
            return jnp.zeros_like(inputs)
        keep_prob = 1.0 - self.rate
        if rng is None:
            rng = self.make_rng(self.rng_collection)
        shape = list(inputs.shape)
        if full is not None:
            shape[full[0]] = full[1]
        for dim in self.broadcast_dims:
            shape[dim] = 1
        # jax.random.bernoulli(rng, keep_prob, shape) is uniform(...) < keep_prob.
        mask = noise.uniform(rng, shape) < keep_prob
        if full is not None and full[0] not in self.broadcast_dims:
            mask = jax.lax.slice_in_dim(mask, 0, inputs.shape[full[0]], axis=full[0])
        mask = jnp.broadcast_to(mask, inputs.shape)
        return jax.lax.select(mask, inputs / keep_prob, jnp.zeros_like(inputs))
