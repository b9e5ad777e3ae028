"""Tail weight averaging: export the mean of the last phase's last steps.

``config.train.average_from`` (default ``-1``, off) is a share of the last
phase's steps, in ``[0, 1)``. From that point on the run keeps the running
mean of every floating-point trainable leaf after each step (the core and,
for the diff methods, the fixmask phase's diff values under their fixed
indices, so the exported diffs keep exactly the budget's entries), and the
export and the final evaluation use that mean instead of the last step's
parameters (Polyak-Ruppert / stochastic weight averaging; Izmailov et al.
2018). Non-floating leaves (counters, index arrays) keep their last value.

Why: under the main job's constant learning rate the diffs' dev task cost
swings by 1-3 points between readings 25 steps apart (docs/efficacy.md,
"Stop 43"), so the exported state is one draw from that swing; the mean of
the tail is not.

The mean lives in the train state (``opt_states[KEY]``), so Orbax saves it
with the step and a resumed run (also after SIGKILL) averages exactly the
steps an uninterrupted one does. ``train.select="best_dev"`` chooses one
state instead, and the two cannot be combined.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

#: The entry of ``TrainState.opt_states`` that holds the running mean.
KEY = "average"


def share(config: ml_collections.ConfigDict) -> float | None:
    """``train.average_from`` as a share, or None when averaging is off."""
    value = float(config.train.get("average_from", -1.0))
    return None if value < 0 else value


def check(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the field and the fix."""
    raw = config.train.get("average_from", -1.0)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not (value < 0 or 0.0 <= value < 1.0):
        raise ValueError(
            f"config.train.average_from={raw!r} is the share of the last phase's "
            "steps after which the exported parameters are the running mean; use "
            "a number in [0, 1) (e.g. 0.5), or -1 to export the last step."
        )
    if value >= 0 and config.train.get("select", "last") != "last":
        raise ValueError(
            "config.train.average_from exports the mean of the last steps and "
            f"config.train.select={config.train.select!r} exports one chosen "
            "state; set one of them: --config.train.average_from=-1 or "
            "--config.train.select=last."
        )


def first_step(config: ml_collections.ConfigDict, n_steps: int) -> int | None:
    """The last phase's first step (1-based) whose parameters enter the mean."""
    value = share(config)
    if value is None:
        return None
    return min(n_steps, int(math.floor(value * n_steps)) + 1)


def _floating(x) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def init(trainable: dict) -> dict:
    """An empty mean shaped like ``trainable`` (float32 for floating leaves)."""
    return jax.tree.map(
        lambda x: jnp.zeros(jnp.shape(x), jnp.float32) if _floating(x) else x,
        trainable,
    )


@functools.partial(jax.jit, donate_argnums=(0,))
def _update(mean: Any, trainable: Any, count: jax.Array) -> Any:
    def one(m, x):
        if not _floating(x):
            return x
        return m + (x.astype(jnp.float32) - m) / count

    return jax.tree.map(one, mean, trainable)


def update(state, count: int):
    """The state with ``count``-th parameters added to its running mean."""
    mean = _update(
        state.opt_states[KEY], state.trainable, jnp.asarray(count, jnp.float32)
    )
    return state.replace(opt_states={**state.opt_states, KEY: mean})


def result(state) -> dict:
    """The mean, in the trainable leaves' own dtypes."""
    return jax.tree.map(
        lambda m, x: m.astype(jnp.asarray(x).dtype) if _floating(x) else x,
        state.opt_states[KEY],
        state.trainable,
    )
