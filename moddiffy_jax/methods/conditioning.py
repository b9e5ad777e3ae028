"""The task classes a removal term conditions on (``method.condition_on``)."""

from __future__ import annotations

import functools
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


def teacher_passes(
    predict: Callable[..., jax.Array],
    batch: Mapping[str, Any],
    twin_ids: jax.Array | None = None,
) -> tuple[Callable[[], jax.Array], Callable[[], jax.Array] | None]:
    """Lazy, once-per-trace reads of the teacher's log-probabilities
    (``predict(batch=...)``: an eval-mode pass, rows independent) on the
    batch and, with ``twin_ids`` ([B, T] token ids), on the batch's twin.

    With a twin the two reads are one pass over the batch stacked on its
    twin (2B rows): the same rows' numbers as two passes, one encoder in
    the traced program instead of two (a shorter compile)."""
    if twin_ids is None:
        return functools.cache(lambda: predict(batch=batch)), None
    n = twin_ids.shape[0]

    def stacked(x):
        if not hasattr(x, "shape") or not x.shape or x.shape[0] != n:
            return x
        return jnp.concatenate([x, x], axis=0)

    both = {k: jax.tree_util.tree_map(stacked, v) for k, v in batch.items()}
    both["input_ids"] = jnp.concatenate([batch["input_ids"], twin_ids], axis=0)
    pair = functools.cache(lambda: predict(batch=both))
    return (lambda: pair()[:n]), (lambda: pair()[n:])
