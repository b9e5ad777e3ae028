"""The Pfeiffer bottleneck adapter of a BERT layer (models/bert_model.py)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from moddiffy_jax.models.mixed_dot import dense_dot_general

Dtype = Any


class BottleneckAdapter(nn.Module):
    """Pfeiffer bottleneck adapter ``h + up(relu(down(h)))``.

    ``up`` is zero-initialised, so a fresh adapter is the identity.

    Attributes:
      hidden_size: Input/output width ``H``.
      bottleneck_size: Width of the bottleneck.
    """

    hidden_size: int
    bottleneck_size: int
    initializer_range: float = 0.02
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, h):
        """Maps ``h`` [..., H] to [..., H]."""
        down = nn.Dense(
            self.bottleneck_size,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nn.initializers.normal(self.initializer_range),
            dot_general=dense_dot_general,
            name="down",
        )
        up = nn.Dense(
            self.hidden_size,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nn.initializers.zeros,
            dot_general=dense_dot_general,
            name="up",
        )
        return h + up(nn.relu(down(h)))
