"""Named methods: the Method values of every family (methods.interface)."""

from __future__ import annotations

from moddiffy_jax.methods import ffw, finetune, moddiffy, srnets
from moddiffy_jax.methods.interface import Method

FAMILIES = (finetune, moddiffy, srnets, ffw)
METHODS: dict[str, Method] = {m.name: m for f in FAMILIES for m in f.METHODS}


def get_method(name: str) -> Method:
    """The method called ``name``; an unknown name lists the valid ones."""
    if name not in METHODS:
        valid = sorted(METHODS)
        raise ValueError(
            f"Unknown method {name!r}; valid methods are: {', '.join(valid)}."
        )
    return METHODS[name]
