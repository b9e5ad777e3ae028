"""Method families: each builds :class:`Method` values; all share one step factory."""

from moddiffy_jax.methods.common import MethodDef, SubStep, TrainState
from moddiffy_jax.methods.interface import Method
from moddiffy_jax.methods.registry import METHODS, get_method

__all__ = [
    "METHODS",
    "Method",
    "MethodDef",
    "SubStep",
    "TrainState",
    "get_method",
]
