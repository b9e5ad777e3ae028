"""Per-attribute removal weights (``config.method.attribute_weights``).

``"age: fisher_weight=100, mmd_weight=5; gender: mmd_weight=3"`` gives each
named attribute its own weights of the removal terms in place of the shared
ones of :class:`removal.DebiasSettings` (and ``"gender: swap_keep_task=true,
task_distill=3"`` its own form of the swap term): :func:`parse_attribute_weights`
reads the text (naming every bad entry), :func:`for_attribute` resolves the
settings one attribute's terms read, :func:`uses_weight` says whether any
attribute needs a term's running statistics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

#: The removal weights ``config.method.attribute_weights`` can set per
#: attribute.
ATTRIBUTE_WEIGHTS = (
    "mmd_weight",
    "fisher_weight",
    "target_weight",
    "adv_lambda",
    "swap_weight",
    "task_distill",
    "swap_distill",
    "swap_distill_pivotal",
)
#: The on/off settings it can set per attribute (true / false, or 1 / 0).
ATTRIBUTE_SWITCHES = ("swap_keep_task", "swap_keep_pivotal")
_SWITCH_VALUES = {"true": True, "1": True, "false": False, "0": False}


def for_attribute(settings: Any, attribute: str) -> Any:
    """``settings`` with ``attribute``'s own weights in place of the shared
    ones (and no per-attribute table left: what its removal terms read)."""
    if not settings.attribute_weights:
        return settings
    own = dict(settings.attribute_weights.get(attribute, {}))
    return dataclasses.replace(settings, attribute_weights={}, **own)


def uses_weight(settings: Any, field: str) -> bool:
    """Whether any attribute's removal reads ``field`` (> 0): its running
    statistics are then kept for every attribute."""
    if getattr(settings, field) > 0.0:
        return True
    return any(w.get(field, 0.0) > 0.0 for w in settings.attribute_weights.values())


def parse_attribute_weights(
    text: str, attributes: Sequence[str]
) -> dict[str, dict[str, float]]:
    """``"age: fisher_weight=100, mmd_weight=5; gender: mmd_weight=3"`` as
    ``{"age": {"fisher_weight": 100.0, "mmd_weight": 5.0}, "gender": ...}``.
    A malformed entry, an attribute the run does not debias, a field that is
    not a per-attribute weight, a negative weight or a switch that is not
    true / false raises a ``ValueError`` naming it."""
    out: dict[str, dict[str, float]] = {}
    where = "config.method.attribute_weights"
    form = "'attribute: field=value, field=value; attribute: ...'"
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        attribute, sep, rest = entry.partition(":")
        attribute = attribute.strip()
        if not sep or not attribute:
            raise ValueError(f"{where}: {entry!r} is not of the form {form}.")
        if attribute not in attributes:
            raise ValueError(
                f"{where}: {attribute!r} is not an attribute this run debiases "
                f"({list(attributes)})."
            )
        if attribute in out:
            raise ValueError(f"{where}: attribute {attribute!r} is given twice.")
        own = out[attribute] = {}
        for item in filter(None, (i.strip() for i in rest.split(","))):
            field, sep, value = (x.strip() for x in item.partition("="))
            if not sep:
                raise ValueError(f"{where}: {item!r} is not field=value ({form}).")
            if field in ATTRIBUTE_SWITCHES:
                switch = _SWITCH_VALUES.get(value.lower())
                if switch is None:
                    raise ValueError(
                        f"{where}: {attribute}'s {field}={value!r} must be true or "
                        "false."
                    )
                own[field] = switch
                continue
            if field not in ATTRIBUTE_WEIGHTS:
                raise ValueError(
                    f"{where}: {field!r} cannot be set per attribute; one of "
                    f"{ATTRIBUTE_WEIGHTS + ATTRIBUTE_SWITCHES}."
                )
            try:
                weight = float(value)
            except ValueError:
                raise ValueError(
                    f"{where}: {attribute}'s {field}={value!r} is not a number."
                ) from None
            if not weight >= 0.0:
                raise ValueError(
                    f"{where}: {attribute}'s {field} must be >= 0, got {weight}."
                )
            own[field] = weight
    return out


def format_attribute_weights(table: dict[str, dict[str, Any]]) -> str:
    """The text :func:`parse_attribute_weights` reads back as ``table``
    (switches as true / false; numbers in Python's shortest exact form)."""

    def value(v: Any) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else repr(float(v))

    return "; ".join(
        f"{attribute}: " + ", ".join(f"{k}={value(v)}" for k, v in own.items())
        for attribute, own in table.items()
        if own
    )
