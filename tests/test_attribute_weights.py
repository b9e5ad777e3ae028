"""Per-attribute removal weights (config.method.attribute_weights)."""

import jax
import ml_collections
import numpy as np
import pytest

from moddiffy_jax.methods import attribute_weights, common, removal
from tests.test_substeps import _first_step


def _settings(**overrides):
    method = removal.config_fields().to_dict()
    method.update(overrides)
    return removal.settings_from_config(
        ml_collections.ConfigDict(method),
        attr_classes={"gender": 2, "age": 2},
        attr_prior={},
        attr_joint={},
        num_task_classes=2,
        batch_size=8,
    )


def test_the_table_is_read_per_attribute_and_resolved_for_each():
    settings = _settings(
        mmd_weight=10.0,
        fisher_weight=10.0,
        attribute_weights=" age: fisher_weight=100, mmd_weight=5 ;gender:mmd_weight=.5",
    )
    assert settings.attribute_weights == {
        "age": {"fisher_weight": 100.0, "mmd_weight": 5.0},
        "gender": {"mmd_weight": 0.5},
    }
    age = attribute_weights.for_attribute(settings, "age")
    gender = attribute_weights.for_attribute(settings, "gender")
    assert (age.fisher_weight, age.mmd_weight) == (100.0, 5.0)
    assert (gender.fisher_weight, gender.mmd_weight) == (10.0, 0.5)
    assert age.attribute_weights == {} == gender.attribute_weights
    # The shared program's settings carry the attribute's own weights.
    shared = removal.attribute_settings(settings, "age", "shared")
    assert (shared.fisher_weight, shared.mmd_weight) == (100.0, 5.0)
    assert _settings().attribute_weights == {}


def test_the_table_written_as_text_reads_back_the_same():
    table = {
        "age": {"swap_weight": 0.0, "fisher_weight": 10.0, "mmd_weight": 1 / 3},
        "gender": {"mmd_weight": 0.0, "swap_keep_task": True, "task_distill": 3},
        "dialect": {},
    }
    text = attribute_weights.format_attribute_weights(table)
    assert "dialect" not in text and "swap_keep_task=true" in text
    got = attribute_weights.parse_attribute_weights(text, list(table))
    assert got == {a: own for a, own in table.items() if own}
    assert attribute_weights.format_attribute_weights({}) == ""


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("height: mmd_weight=1", "'height' is not an attribute this run debiases"),
        ("age: mmd_kernel=1", "'mmd_kernel' cannot be set per attribute"),
        ("age: mmd_weight=lots", "is not a number"),
        ("age: mmd_weight=-1", "must be >= 0"),
        ("age: mmd_weight=nan", "must be >= 0"),
        ("age mmd_weight=1", "is not of the form"),
        ("age: mmd_weight", "is not field=value"),
        ("age: mmd_weight=1; age: fisher_weight=2", "given twice"),
        ("age: swap_keep_task=maybe", "swap_keep_task='maybe' must be true or false"),
    ],
)
def test_a_bad_table_names_the_entry(text, message):
    with pytest.raises(ValueError, match=message) as err:
        _settings(attribute_weights=text)
    assert "config.method.attribute_weights" in str(err.value)


def test_a_per_attribute_erasure_weight_needs_the_whitened_mmd():
    with pytest.raises(ValueError, match="reads the whitened MMD"):
        _settings(
            mmd_whiten=False,
            fisher_weight=0.0,
            attribute_weights="age: fisher_weight=1",
        )


def _debias_metrics(**overrides):
    ctx, substeps, state, frozen, batch = _first_step("moddiffy_par", **overrides)
    debias = [s for s in substeps if s.name.startswith("debias/")]
    state = state.replace(opt_states={s.name: state.opt_states[s.name] for s in debias})
    # One program per distinct sub-step (the attributes' shared one compiles
    # once): the same arithmetic as the whole step, less to compile.
    new, metrics = common.compile_train_step(debias, donate=False)(
        state, frozen, batch, jax.random.PRNGKey(5)
    )
    return debias, new, metrics


def test_each_attribute_trains_with_its_own_weights():
    """The age diff with ``age: fisher_weight=3`` steps exactly as under a
    shared weight of 3; the gender diff keeps the shared weight 0 (no erasure
    term, the same MMD and task terms on the same first batch); the two
    attributes no longer share one debias loss."""
    debias, new, mixed = _debias_metrics(
        **{
            "method.fisher_weight": 0.0,
            "method.attribute_weights": "age: fisher_weight=3",
        }
    )
    assert debias[0].loss is not debias[1].loss
    _, new_on, on = _debias_metrics(**{"method.fisher_weight": 3.0})
    age = [k for k in on if k.startswith("debias/age/")]
    assert "debias/age/fisher/age" in age
    assert sorted(k for k in mixed if k.startswith("debias/age/")) == sorted(age)
    for k in age:
        np.testing.assert_allclose(mixed[k], on[k], rtol=1e-5, atol=1e-7)
    for x, y in zip(
        jax.tree.leaves(new.trainable["diffs"]["age"]),
        jax.tree.leaves(new_on.trainable["diffs"]["age"]),
        strict=True,
    ):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    assert "debias/gender/fisher/gender" not in mixed
    for k in ("debias/gender/mmd/gender", "debias/gender/task"):
        np.testing.assert_allclose(mixed[k], on[k], rtol=1e-5, atol=1e-7)
    assert "debias/gender/fisher/gender" in on
    assert np.any(np.asarray(new.trainable[removal.FISHER_STATS]["age"]["diff"]))
    assert not np.any(np.asarray(new.trainable[removal.FISHER_STATS]["gender"]["diff"]))


def test_the_swap_term_and_the_task_distill_are_set_per_attribute():
    """``gender: swap_keep_task=true, task_distill=2``: gender's debias loss
    is the one of the shared switch and weight, age's the plain swaps' (no
    distillation, the whole twin distance)."""
    import dataclasses

    from tests.test_counterfactual import _debias_terms, _own_tables

    ctx, _, state, frozen, batch = _first_step(
        "moddiffy_par",
        **{
            "method.swap_weight": 1.0,
            "method.attribute_weights": "gender: swap_keep_task=true, task_distill=2",
        },
    )
    own = ctx.debias.attribute_weights
    assert own == {"gender": {"swap_keep_task": True, "task_distill": 2.0}}
    assert attribute_weights.for_attribute(ctx.debias, "gender").swap_keep_task
    assert not attribute_weights.for_attribute(ctx.debias, "age").swap_keep_task
    plain = dataclasses.replace(ctx.debias, attribute_weights={})
    shared = dataclasses.replace(plain, swap_keep_task=True, task_distill=2.0)

    def terms(attribute, debias):
        inputs = _own_tables(frozen)
        return _debias_terms(ctx, attribute, debias, state.trainable, inputs, batch)

    mixed_gender, shared_gender = terms("gender", ctx.debias), terms("gender", shared)
    assert mixed_gender.keys() == shared_gender.keys() and "distill" in mixed_gender
    for k in shared_gender:
        np.testing.assert_allclose(mixed_gender[k], shared_gender[k], rtol=1e-6)
    # Keeping the decision changes the gender twin distance (the switch is read).
    assert terms("gender", plain)["swap/gender"] > mixed_gender["swap/gender"]
    mixed_age, plain_age = terms("age", ctx.debias), terms("age", plain)
    assert "distill" not in mixed_age and mixed_age.keys() == plain_age.keys()
    for k in plain_age:
        np.testing.assert_allclose(mixed_age[k], plain_age[k], rtol=1e-6)
