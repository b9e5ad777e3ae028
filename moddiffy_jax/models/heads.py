"""Classifier heads: a single MLP head and a vmapped ensemble of them.

Convention: ``num_outputs`` is the number of classes and every head is
trained with softmax cross-entropy, binary tasks included (2 logits, not one
sigmoid logit). One loss for everything keeps objectives and metrics simple.

Dense layers use the PyTorch ``nn.Linear`` default init (kaiming_uniform with
``a=sqrt(5)`` for the weight, which is ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``,
and the same bound for the bias), as in the reference implementation.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from moddiffy_jax.models.dropout import Dropout
from moddiffy_jax.models.mixed_dot import dense_dot_general

Dtype = Any


def torch_linear_kernel_init() -> nn.initializers.Initializer:
    """Kernel init of torch ``nn.Linear``: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``.

    Flax kernels are ``(..., in, out)``; ``fan_in`` is the ``in`` axis.
    """
    # variance_scaling uniform draws U(-sqrt(3 * scale / fan_in), ...).
    return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def torch_linear_bias_init(fan_in: int) -> nn.initializers.Initializer:
    """Bias init of torch ``nn.Linear``: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def torch_dense(features: int, *, fan_in: int, name: str | None = None, **kwargs):
    """An ``nn.Dense`` with torch ``nn.Linear`` default init.

    Args:
      features: Output width.
      fan_in: Input width (the bias bound needs it up front).
      name: Module name.
      **kwargs: Passed to ``nn.Dense`` (e.g. ``dtype``).

    Returns:
      The ``nn.Dense`` module (kernel ``[fan_in, features]``, bias
      ``[features]``).
    """
    return nn.Dense(
        features,
        kernel_init=torch_linear_kernel_init(),
        bias_init=torch_linear_bias_init(fan_in),
        dot_general=dense_dot_general,
        name=name,
        **kwargs,
    )


class ClassifierHead(nn.Module):
    """MLP head: ``[Dropout, Dense, Tanh] * num_hidden, Dropout, Dense``.

    Params: ``hidden_{i}/{kernel,bias}`` for each hidden layer and
    ``output/{kernel,bias}``.

    Attributes:
      num_outputs: Number of classes ``C`` (use cross-entropy, also for
        binary tasks with ``C=2``).
      num_hidden: Number of hidden ``Dense+Tanh`` layers.
      hidden_size: Width of hidden layers; defaults to the input width.
      dropout: Dropout rate before every Dense.
      dtype: Compute dtype.
      activation: ``"tanh"`` (the paper's) or ``"relu"`` after each hidden
        Dense.
    """

    num_outputs: int
    num_hidden: int = 0
    hidden_size: int | None = None
    dropout: float = 0.3
    dtype: Dtype = jnp.float32
    activation: str = "tanh"

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Maps features ``x`` [B, H] to logits [B, C].

        Args:
          x: ``[B, H]`` features (e.g. a pooled encoder output).
          deterministic: If False, dropout is on (needs the ``"dropout"`` rng).

        Returns:
          ``[B, num_outputs]`` logits.
        """
        if self.activation not in ("tanh", "relu"):
            raise ValueError(
                f"ClassifierHead.activation must be 'tanh' or 'relu', got "
                f"{self.activation!r}."
            )
        width = self.hidden_size or x.shape[-1]
        for i in range(self.num_hidden):
            x = Dropout(self.dropout)(x, deterministic=deterministic)
            x = torch_dense(
                width, fan_in=x.shape[-1], name=f"hidden_{i}", dtype=self.dtype
            )(x)
            x = jax.nn.relu(x) if self.activation == "relu" else jnp.tanh(x)
        x = Dropout(self.dropout)(x, deterministic=deterministic)
        return torch_dense(
            self.num_outputs, fan_in=x.shape[-1], name="output", dtype=self.dtype
        )(x)


class _PositionalHead(ClassifierHead):
    """ClassifierHead taking ``deterministic`` positionally (``nn.vmap`` drops
    keyword arguments)."""

    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        return super().__call__(x, deterministic=deterministic)


class HeadEnsemble(nn.Module):
    """``K`` independent :class:`ClassifierHead` s, vectorised with ``nn.vmap``.

    Every param of the single head gets a leading member axis ``K``, under
    ``members/`` (e.g. ``members/hidden_0/kernel`` is ``[K, H, hidden]``).
    Members get different init and, in training, different dropout masks.
    All members see the same input.

    Attributes:
      num_outputs: Number of classes ``C`` per member (cross-entropy).
      num_members: Ensemble size ``K``.
      num_hidden: Hidden layers per member.
      hidden_size: Hidden width; defaults to the input width.
      dropout: Dropout rate.
      dtype: Compute dtype.
    """

    num_outputs: int
    num_members: int = 5
    num_hidden: int = 1
    hidden_size: int | None = None
    dropout: float = 0.3
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, deterministic: bool = True) -> jax.Array:
        """Maps features ``x`` [B, H] to logits [K, B, C].

        Args:
          x: ``[B, H]`` features, shared by all members.
          deterministic: If False, dropout is on (needs the ``"dropout"`` rng).

        Returns:
          ``[num_members, B, num_outputs]`` logits.
        """
        members = nn.vmap(
            _PositionalHead,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(None, None),
            out_axes=0,
            axis_size=self.num_members,
        )
        return members(
            num_outputs=self.num_outputs,
            num_hidden=self.num_hidden,
            hidden_size=self.hidden_size,
            dropout=self.dropout,
            dtype=self.dtype,
            name="members",
        )(x, deterministic)
