"""The removal gradient's task-conflicting part projected out
(config.method.task_projection)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax import objectives, train
from tests.helpers import tiny
from tests.test_attribute_weights import _debias_metrics


def test_the_projection_drops_only_the_part_against_the_task():
    h = jnp.arange(12.0).reshape(4, 3)
    toward = jnp.array(
        [[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    )
    g = jnp.array(
        [[-3.0, 1.0, 0.0], [0.0, 5.0, 1.0], [1.0, 1.0, 1.0], [-1.0, -1.0, 2.0]]
    )
    value, vjp = jax.vjp(objectives.task_projected, h, toward)
    np.testing.assert_array_equal(value, h)
    g_h, g_toward = vjp(g)
    expected = np.array(
        [
            [0.0, 1.0, 0.0],  # against the task: the (-3, 0, 0) part goes
            [0.0, 5.0, 1.0],  # with the task: kept
            [1.0, 1.0, 1.0],  # no task gradient on this row: kept
            [0.0, 0.0, 2.0],
        ]
    )
    np.testing.assert_allclose(g_h, expected, atol=1e-6)
    np.testing.assert_array_equal(g_toward, 0.0)
    # A descent step along the projected gradient never raises the task loss
    # to first order: <g', toward> >= 0 on every row.
    assert np.all(np.sum(np.asarray(g_h) * np.asarray(toward), -1) >= -1e-6)


def test_debias_steps_read_the_same_losses_and_move_the_diff_otherwise():
    _, plain_state, plain = _debias_metrics()
    _, state, projected = _debias_metrics(**{"method.task_projection": True})
    assert sorted(projected) == sorted(plain)
    for k in plain:  # the forward pass is unchanged; the gradients are not
        if not k.endswith("grad_norm"):
            np.testing.assert_allclose(projected[k], plain[k], rtol=1e-5, atol=1e-7)
    moved = [
        not np.allclose(x, y, rtol=1e-6, atol=1e-9)
        for x, y in zip(
            jax.tree.leaves(state.trainable["diffs"]["gender"]),
            jax.tree.leaves(plain_state.trainable["diffs"]["gender"]),
            strict=True,
        )
    ]
    assert any(moved)
    with pytest.raises(ValueError, match="trains its removal jointly"):
        train.build_context(tiny("finetune_debias", **{"method.task_projection": True}))
