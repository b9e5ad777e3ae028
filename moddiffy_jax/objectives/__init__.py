"""Losses as pure functions with named outputs."""

from moddiffy_jax.objectives.adversarial import adversarial_loss, gradient_reversal
from moddiffy_jax.objectives.classification import (
    accuracy,
    cross_entropy,
    majority_vote,
)
from moddiffy_jax.objectives.mmd import mmd_loss, multi_kernel_matrix

__all__ = [
    "accuracy",
    "adversarial_loss",
    "cross_entropy",
    "gradient_reversal",
    "majority_vote",
    "mmd_loss",
    "multi_kernel_matrix",
]
