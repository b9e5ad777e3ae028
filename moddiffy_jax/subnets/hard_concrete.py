"""Hard-concrete gates (Louizos, Welling and Kingma, 2018).

A hard-concrete gate ``z`` in ``[0, 1]`` is a stretched and clipped binary
concrete sample with learnable location ``log_alpha``:

    u ~ Uniform(eps, 1 - eps)
    s = sigmoid((log u - log(1 - u) + log_alpha) / beta)
    z = clip(s * (right - left) + left, 0, 1)

Because the stretched interval ``(left, right)`` extends past ``[0, 1]``, ``z``
is exactly 0 or exactly 1 with positive probability, and the probability that
``z != 0`` has the closed form

    P(z > 0) = sigmoid(log_alpha - beta * log(-left / right)),

which is the differentiable expected-L0 penalty. At evaluation the gate is
deterministic: ``clip(sigmoid(log_alpha) * (right - left) + left, 0, 1)``.

Worked numbers for the defaults (``left=-1.5``, ``right=1.5``, ``beta=1``):
the deterministic gate is 1 iff ``log_alpha >= ln 5 ~ 1.609`` and 0 iff
``log_alpha <= 0``; at ``log_alpha=5`` a sample is 1 with probability 0.967
and 0 with probability 0.0067.

All functions are pure and jit-able; hyperparameters are keyword-only and
travel in a frozen, hashable :class:`HardConcrete` (usable as a static jit
argument). Trees are any pytrees of float arrays (typically subtrees from
:mod:`moddiffy_jax.subnets.selection`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from moddiffy_jax.subnets import noise

PyTree = Any


@dataclasses.dataclass(frozen=True)
class HardConcrete:
    """Hyperparameters of the hard-concrete distribution.

    Defaults are those of the MoDDiffy ([M] ``cfg.yml``) and DiffPruning ([G])
    references.

    Attributes:
      left: lower end of the stretched interval (gamma, < 0).
      right: upper end of the stretched interval (zeta, > 1).
      temperature: concrete temperature beta (> 0).
      init_log_alpha: initial location of new gates; 5.0 makes gates open
        (sampled z == 1 with probability ~0.967).
      eps: uniform noise is clamped to ``[eps, 1 - eps]``.
    """

    left: float = -1.5
    right: float = 1.5
    temperature: float = 1.0
    init_log_alpha: float = 5.0
    eps: float = 1e-4

    def __post_init__(self):
        if not self.left < 0.0:
            raise ValueError(f"HardConcrete.left must be < 0, got {self.left}.")
        if not self.right > 1.0:
            raise ValueError(f"HardConcrete.right must be > 1, got {self.right}.")
        if not self.temperature > 0.0:
            raise ValueError(
                f"HardConcrete.temperature must be > 0, got {self.temperature}."
            )
        if not 0.0 < self.eps < 0.5:
            raise ValueError(f"HardConcrete.eps must be in (0, 0.5), got {self.eps}.")

    @property
    def log_ratio(self) -> float:
        """``log(-left / right)``; 0 for the symmetric defaults."""
        return math.log(-self.left / self.right)


def _float_dtype(x: jax.Array) -> jnp.dtype:
    dtype = jnp.result_type(x)
    return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32


def sample_gate(
    log_alpha: jax.Array, rng: jax.Array, *, hc: HardConcrete = HardConcrete()
) -> jax.Array:
    """Draws one hard-concrete sample per entry of ``log_alpha``.

    Differentiable with respect to ``log_alpha`` (reparametrised; zero gradient
    where the sample is clipped to 0 or 1).

    Args:
      log_alpha: float array of any shape, the gate locations.
      rng: a PRNG key.
      hc: hyperparameters.

    Returns:
      ``z``, same shape and dtype as ``log_alpha``, values in ``[0, 1]``.
    """
    log_alpha = jnp.asarray(log_alpha)
    # jax.random.uniform's numbers, computed where XLA can fuse them (noise.py).
    return gate_from_uniform(
        log_alpha, noise.uniform(rng, log_alpha.shape, jnp.float32), hc=hc
    )


def gate_from_uniform(
    log_alpha: jax.Array, u: jax.Array, *, hc: HardConcrete = HardConcrete()
) -> jax.Array:
    """The hard-concrete sample of gate locations ``log_alpha`` for uniform
    noise ``u`` (same shape): the formula of :func:`sample_gate`."""
    dtype = _float_dtype(log_alpha)
    u = jnp.clip(u, hc.eps, 1.0 - hc.eps)
    logits = (jnp.log(u) - jnp.log1p(-u) + log_alpha.astype(jnp.float32)) / (
        hc.temperature
    )
    s = jax.nn.sigmoid(logits)
    z = jnp.clip(s * (hc.right - hc.left) + hc.left, 0.0, 1.0)
    return z.astype(dtype)


def deterministic_gate(
    log_alpha: jax.Array, *, hc: HardConcrete = HardConcrete()
) -> jax.Array:
    """The evaluation-time gate ``clip(sigmoid(log_alpha) * (r - l) + l, 0, 1)``.

    Used for evaluation, attacks, magnitude pruning and merging (spec §13.2).

    Args:
      log_alpha: float array of any shape.
      hc: hyperparameters (``temperature`` is not used, as in the references).

    Returns:
      ``z``, same shape and dtype as ``log_alpha``, values in ``[0, 1]``.
    """
    log_alpha = jnp.asarray(log_alpha)
    dtype = _float_dtype(log_alpha)
    s = jax.nn.sigmoid(log_alpha.astype(jnp.float32))
    z = jnp.clip(s * (hc.right - hc.left) + hc.left, 0.0, 1.0)
    return z.astype(dtype)


def prob_nonzero(
    log_alpha: jax.Array, *, hc: HardConcrete = HardConcrete()
) -> jax.Array:
    """Elementwise ``P(z > 0) = sigmoid(log_alpha - beta * log(-l / r))``.

    This is the expected L0 norm of one gate (the differentiable penalty).

    Args:
      log_alpha: float array of any shape.
      hc: hyperparameters.

    Returns:
      Probabilities, same shape as ``log_alpha``, float32 or wider.
    """
    log_alpha = jnp.asarray(log_alpha)
    dtype = jnp.promote_types(_float_dtype(log_alpha), jnp.float32)
    return jax.nn.sigmoid(log_alpha.astype(dtype) - hc.temperature * hc.log_ratio)


def sample_gates(
    log_alpha_tree: PyTree, rng: jax.Array, *, hc: HardConcrete = HardConcrete()
) -> PyTree:
    """Samples every leaf of a tree of gate locations with its own key.

    Leaf ``i`` (in ``jax.tree.leaves`` order) uses ``jax.random.split(rng,
    num_leaves)[i]``, so the result is deterministic given ``rng`` and the tree
    structure, and no two leaves share noise.

    Args:
      log_alpha_tree: pytree of float arrays.
      rng: a PRNG key.
      hc: hyperparameters.

    Returns:
      A pytree with the structure, shapes and dtypes of ``log_alpha_tree``
      holding samples ``z`` in ``[0, 1]``.
    """
    leaves, treedef = jax.tree.flatten(log_alpha_tree)
    if not leaves:
        return log_alpha_tree
    keys = jax.random.split(rng, len(leaves))
    return jax.tree.unflatten(treedef, sample_gate_list(leaves, list(keys), hc=hc))


def sample_gate_list(
    log_alphas: Sequence[jax.Array],
    keys: Sequence[jax.Array],
    *,
    hc: HardConcrete = HardConcrete(),
) -> list[jax.Array]:
    """``[sample_gate(la, k, hc=hc) for la, k in zip(log_alphas, keys)]``, the
    same numbers, with the noise of small leaves of one shape drawn as one
    hash (:func:`moddiffy_jax.subnets.noise.uniform_many`): a smaller program."""
    log_alphas = [jnp.asarray(la) for la in log_alphas]
    us = noise.uniform_many(keys, [la.shape for la in log_alphas])
    return [
        gate_from_uniform(la, u, hc=hc) for la, u in zip(log_alphas, us, strict=True)
    ]


def deterministic_gates(
    log_alpha_tree: PyTree, *, hc: HardConcrete = HardConcrete()
) -> PyTree:
    """:func:`deterministic_gate` on every leaf of a tree."""
    return jax.tree.map(lambda la: deterministic_gate(la, hc=hc), log_alpha_tree)


def sample_gates_n(
    log_alpha_tree: PyTree,
    rng: jax.Array,
    *,
    hc: HardConcrete = HardConcrete(),
    n: int,
) -> PyTree:
    """Draws ``n`` independent samples of a tree of gates (``jax.vmap`` over keys).

    Args:
      log_alpha_tree: pytree of float arrays.
      rng: a PRNG key, split into ``n`` keys.
      hc: hyperparameters.
      n: number of samples (a static Python int).

    Returns:
      The tree of :func:`sample_gates`, each leaf with a leading axis of size
      ``n``: shape ``(n, *leaf.shape)``.
    """
    keys = jax.random.split(rng, n)
    return jax.vmap(lambda k: sample_gates(log_alpha_tree, k, hc=hc))(keys)


def expected_l0(
    log_alpha_tree: PyTree, *, hc: HardConcrete = HardConcrete()
) -> jax.Array:
    """Sum of :func:`prob_nonzero` over all entries of all leaves.

    Args:
      log_alpha_tree: pytree of float arrays (may be empty).
      hc: hyperparameters.

    Returns:
      A float32 scalar, the expected number of non-zero gates.
    """
    leaves = jax.tree.leaves(log_alpha_tree)
    total = jnp.zeros((), jnp.float32)
    for la in leaves:
        total = total + jnp.sum(prob_nonzero(la, hc=hc), dtype=jnp.float32)
    return total
