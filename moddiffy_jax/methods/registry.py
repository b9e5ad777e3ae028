"""Named methods: the ``METHODS`` of every module of ``moddiffy_jax.methods``.

A module of this package that defines ``METHODS`` (a tuple of
:class:`~moddiffy_jax.methods.interface.Method` values) is a method family;
adding one needs no change here. The modules are found by name and
imported when this module is, in name order.
"""

from __future__ import annotations

import importlib
import pkgutil

from moddiffy_jax.methods.interface import Method

_PACKAGE = "moddiffy_jax.methods"


def _families() -> tuple:
    package = importlib.import_module(_PACKAGE)
    names = sorted(m.name for m in pkgutil.iter_modules(package.__path__))
    modules = [
        importlib.import_module(f"{_PACKAGE}.{n}") for n in names if n != "registry"
    ]
    return tuple(m for m in modules if hasattr(m, "METHODS"))


def _collect(families) -> dict[str, Method]:
    out: dict[str, Method] = {}
    for family in families:
        for method in family.METHODS:
            if method.name in out:
                raise ValueError(
                    f"Method {method.name!r} is defined twice "
                    f"(again in {family.__name__})."
                )
            out[method.name] = method
    return out


FAMILIES = _families()
METHODS: dict[str, Method] = _collect(FAMILIES)


def get_method(name: str) -> Method:
    """The method called ``name``; an unknown name lists the valid ones."""
    if name not in METHODS:
        valid = sorted(METHODS)
        raise ValueError(
            f"Unknown method {name!r}; valid methods are: {', '.join(valid)}."
        )
    return METHODS[name]
