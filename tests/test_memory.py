"""The MMD's memory of previous batches (config.method.removal_memory)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from moddiffy_jax import objectives
from moddiffy_jax.methods import removal
from moddiffy_jax.methods.terms import STATE_KEY


def _settings(memory, **kw):
    fields = dict(
        objective="mmd",
        adv_lambda=1.0,
        mmd_weight=1.0,
        attr_classes={"g": 2},
        num_task_classes=2,
        mmd_kernel="both",
        mmd_conditional="stratify",
        removal_memory=memory,
    )
    fields.update(kw)
    return removal.DebiasSettings(**fields)


def _term(settings, memory, h, attr, task):
    trainable = {removal.REMOVAL_MEMORY: {"g": memory}}
    out = removal.debias_term(
        None,
        trainable,
        h,
        attr,
        "g",
        settings=settings,
        rng=jax.random.PRNGKey(0),
        train=True,
        task=task,
    )
    new = out.get(STATE_KEY, {}).get((removal.REMOVAL_MEMORY, "g"))
    return out["mmd/g"], new


def test_the_memory_keeps_the_latest_batches_and_scales_the_term():
    settings = _settings(2)
    memory = removal.init_memory(settings, 2, ["g"], batch_size=3)["g"]
    batches = [jnp.full((3, 2), float(i + 1)) for i in range(3)]
    factors = []
    for i, h in enumerate(batches):
        attr = jnp.array([0, 1, i % 2])
        rows, memory, factor = removal.remembered(memory, h, attr, None)
        factors.append(float(factor))
        assert rows["h"].shape == (9, 2)
    # Three pushes into a two-batch memory: the last two, newest first.
    np.testing.assert_array_equal(memory["h"][:3], batches[2])
    np.testing.assert_array_equal(memory["h"][3:], batches[1])
    np.testing.assert_array_equal(memory["attr"], [0, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(memory["valid"], np.ones(6))
    assert factors == [1.0, 2.0, 3.0]


def test_a_full_memory_gives_the_larger_batch_value_with_gradient_only_to_the_batch():
    key = jax.random.PRNGKey(3)
    h = jax.random.normal(key, (16, 4))
    attr = jnp.array([0, 1] * 8)
    task = jnp.array([0, 0, 1, 1] * 4)
    settings = _settings(1)
    memory = removal.init_memory(settings, 4, ["g"], batch_size=8)["g"]
    _, memory = _term(settings, memory, h[8:], attr[8:], task[8:])

    def with_memory(cur, mem_h):
        mem = dict(memory, h=mem_h)
        return _term(settings, mem, cur, attr[:8], task[:8])[0]

    def whole(rows):
        return objectives.mmd_loss(
            rows, attr, num_classes=2, task=task, num_task_classes=2, kernel="both"
        )

    value = with_memory(h[:8], memory["h"])
    np.testing.assert_allclose(value, 2.0 * whole(h), rtol=1e-5)
    g_cur, g_mem = jax.grad(with_memory, argnums=(0, 1))(h[:8], memory["h"])
    np.testing.assert_array_equal(g_mem, 0.0)
    expected = 2.0 * jax.grad(whole)(h)[:8]
    np.testing.assert_allclose(g_cur, expected, rtol=1e-4, atol=1e-7)


def test_groups_too_small_in_a_batch_are_compared_with_the_memory():
    # One member per (task class, attribute value) cell: a batch alone has no
    # group of two in any task class, so the term is 0 and moves nothing.
    h = jnp.array([[0.0, 0.0], [2.0, 0.0], [0.0, 1.0], [2.0, 1.0]])
    attr = jnp.array([0, 1, 0, 1])
    task = jnp.array([0, 0, 1, 1])
    alone, _ = _term(_settings(0), None, h, attr, task)
    assert float(alone) == 0.0
    settings = _settings(1)
    memory = removal.init_memory(settings, 2, ["g"], batch_size=4)["g"]
    first, memory = _term(settings, memory, h + 0.1, attr, task)
    assert float(first) == 0.0  # the memory is still empty.
    second, _ = _term(settings, memory, h, attr, task)
    assert float(second) > 0.1
    grad = jax.grad(lambda x: _term(settings, memory, x, attr, task)[0])(h)
    # Descent pulls the attribute's groups together along the shifted axis.
    assert float(grad[1, 0] - grad[0, 0]) > 0.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"removal_memory": -1}, "whole number >= 0"),
        ({"removal_memory": 1.5}, "whole number >= 0"),
        (
            {"removal_memory": 1, "objective": "adversarial", "fisher_weight": 0.0},
            "objective='mmd'",
        ),
    ],
)
def test_bad_memory_settings_name_the_field(overrides, message):
    method = removal.config_fields().to_dict()
    method.update(overrides)
    with pytest.raises(ValueError, match=message) as err:
        removal.settings_from_config(
            ml_collections.ConfigDict(method),
            attr_classes={"g": 2},
            attr_prior={},
            attr_joint={},
            num_task_classes=2,
            batch_size=8,
        )
    assert "config.method.removal_memory" in str(err.value)
