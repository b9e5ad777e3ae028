"""The task classes a removal term conditions on (``method.condition_on``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp


def conditioning_labels(
    debias: Any,
    batch: Mapping[str, Any],
    logits: jax.Array,
    *,
    core: Callable[[], jax.Array] | None,
) -> jax.Array:
    """The task classes the removal terms condition on (``condition_on``):
    the gold labels, the predicted classes of ``logits`` or those of the
    core (``core()``: its log-probabilities; None where there is no
    separate core), never differentiated."""
    if debias.condition_on == "label":
        return batch["task"]
    if debias.condition_on == "core_prediction":
        if core is None:
            raise ValueError(
                "config.method.condition_on='core_prediction' needs a core "
                "without the diff (modular methods: moddiffy_par, moddiffy_post, "
                "lora_debias); use condition_on='prediction' or 'label'."
            )
        logits = core()
    return jnp.argmax(jax.lax.stop_gradient(logits), -1).astype(batch["task"].dtype)
