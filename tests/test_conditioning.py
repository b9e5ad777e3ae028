"""What the removal terms condition on (config.method.condition_on)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from moddiffy_jax.methods import common, removal
from tests.helpers import core_prediction
from tests.test_substeps import _first_step


def _settings(**overrides):
    method = removal.config_fields().to_dict()
    method.update(overrides)
    return removal.settings_from_config(
        ml_collections.ConfigDict(method),
        attr_classes={"gender": 2},
        attr_prior={},
        attr_joint={"gender": ((0.4, 0.1), (0.1, 0.4))},
        num_task_classes=2,
        batch_size=8,
    )


def test_the_labels_each_choice_gives():
    batch = {"task": jnp.array([0, 1, 1, 0], jnp.int32)}
    logits = jnp.array([[2.0, 0.0], [3.0, 1.0], [0.0, 1.0], [0.0, 5.0]])
    core = jnp.array([[0.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    got = {
        on: common.conditioning_labels(
            _settings(condition_on=on), batch, logits, core=lambda: core
        )
        for on in removal.CONDITION_ON
    }
    np.testing.assert_array_equal(got["label"], [0, 1, 1, 0])
    np.testing.assert_array_equal(got["prediction"], [0, 0, 1, 1])
    np.testing.assert_array_equal(got["core_prediction"], [1, 1, 0, 0])
    assert all(v.dtype == jnp.int32 for v in got.values())
    with pytest.raises(ValueError, match="needs a core without the diff"):
        common.conditioning_labels(
            _settings(condition_on="core_prediction"), batch, logits, core=None
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"condition_on": "guess"}, "condition_on='guess' is not one of"),
        (
            {"condition_on": "prediction", "mmd_conditional": "reweight"},
            "set mmd_conditional='stratify', or condition_on='label'",
        ),
    ],
)
def test_bad_choices_name_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        _settings(**overrides)


def _captured(condition_on, monkeypatch):
    """The task labels the gender debias step's removal terms receive, the
    diff's logits in that step, the batch and the core's prediction."""
    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.condition_on": condition_on}
    )
    seen = {}
    debias_term, task_loss_value = removal.debias_term, common.task_loss_value

    def keep(name, value):
        jax.debug.callback(lambda v: seen.__setitem__(name, np.asarray(v)), value)

    def spy_removal(*args, **kwargs):
        keep("task", kwargs["task"])
        return debias_term(*args, **kwargs)

    def spy_task(loss, logits, b):
        keep("logits", logits)
        return task_loss_value(loss, logits, b)

    monkeypatch.setattr(removal, "debias_term", spy_removal)
    monkeypatch.setattr(common, "task_loss_value", spy_task)
    (gender,) = [s for s in substeps if s.name == "debias/gender"]
    # The loss forward alone (what the removal terms are given), jitted
    # without the backward pass and the optimizer: a third of the compile.
    loss = common.stored_loss(gender)
    jax.jit(loss)(state.trainable, frozen, batch, jax.random.PRNGKey(3))
    core = core_prediction(ctx, state.trainable, frozen, batch)
    return seen, batch, np.argmax(np.asarray(core), -1)


@pytest.mark.parametrize("condition_on", removal.CONDITION_ON)
def test_the_debias_step_conditions_on_what_was_asked(condition_on, monkeypatch):
    seen, batch, core = _captured(condition_on, monkeypatch)
    expected = {
        "label": np.asarray(batch["task"]),
        "prediction": np.argmax(seen["logits"], -1),
        "core_prediction": core,
    }[condition_on]
    np.testing.assert_array_equal(seen["task"], expected)
    if condition_on != "label":  # the check can tell the choices apart
        assert not np.array_equal(expected, batch["task"])
