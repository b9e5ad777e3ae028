"""Method families: each defines what is trained; all share one step factory."""

from moddiffy_jax.methods.common import MethodDef, SubStep, TrainState
from moddiffy_jax.methods.registry import METHODS, build_substeps, get_method

__all__ = [
    "METHODS",
    "MethodDef",
    "SubStep",
    "TrainState",
    "build_substeps",
    "get_method",
]
