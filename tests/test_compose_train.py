"""Debias steps that see the other attributes' diffs (config.diff.compose_prob)."""

import jax
import numpy as np
import pytest

from moddiffy_jax import train
from moddiffy_jax.methods import common, moddiffy
from moddiffy_jax.subnets import diffs as diffs_lib
from tests.helpers import set_fields, tiny
from tests.test_substeps import _first_step


def _shifted(state, attr, by):
    part = state.trainable["diffs"][attr]
    part = part.replace(delta=jax.tree.map(lambda d: d + by, part.delta))
    diffs = {**state.trainable["diffs"], attr: part}
    return state.replace(trainable={**state.trainable, "diffs": diffs})


def test_other_diffs_are_added_with_their_probability():
    ctx, _, state, frozen, _ = _first_step("moddiffy_par")
    state = _shifted(state, "age", 0.25)
    core = state.trainable["core"]
    want = common.apply_diff_part(
        core,
        state.trainable["diffs"]["age"],
        None,
        phase="l0",
        settings=ctx.diff_settings,
        rng=None,
        train=False,
    )
    kw = {"phase": "l0", "settings": ctx.diff_settings}
    rng = jax.random.PRNGKey(3)
    seen, _ = common.with_other_diffs(
        ctx.method, state.trainable, frozen, ("age",), 1.0, rng, **kw
    )
    jax.tree.map(np.testing.assert_array_equal, seen["core"], want)
    unseen, _ = common.with_other_diffs(
        ctx.method, state.trainable, frozen, ("age",), 0.0, rng, **kw
    )
    jax.tree.map(np.testing.assert_array_equal, unseen["core"], core)
    # In fixmask the other diff's kept values are scattered at its indices;
    # its dense form (fixed gates) adds exactly the same.
    seen = {}
    for form in ("sparse", "dense"):
        set_fields(ctx.config, {"diff.fixmask_state": form})
        trainable, frozen_fm = moddiffy.to_fixmask(ctx, dict(state.trainable), frozen)
        seen[form], _ = common.with_other_diffs(
            ctx.method,
            trainable,
            frozen_fm,
            ("age",),
            1.0,
            rng,
            phase="fixmask",
            settings=ctx.diff_settings,
        )
        if form == "sparse":
            want = common.add_sparse(
                core, frozen_fm["indices"]["diffs"]["age"], trainable["diffs"]["age"]
            )
    for form in seen:
        jax.tree.map(np.testing.assert_array_equal, seen[form]["core"], want)
    seen = seen["dense"]
    changed = jax.tree.leaves(
        jax.tree.map(lambda a, b: bool(np.any(a != b)), seen["core"], core)
    )
    assert any(changed)


def test_a_composing_debias_step_trains_only_its_own_diff():
    _, substeps, state, frozen, batch = _first_step(
        "moddiffy_par", **{"diff.compose_prob": 1.0}
    )
    state = _shifted(state, "age", 0.1)
    gender = [s for s in substeps if s.name == "debias/gender"]
    assert gender[0].attribute is None  # its loss reads the age diff by name
    new, metrics = jax.jit(common.make_train_step(gender))(
        state, frozen, batch, jax.random.PRNGKey(0)
    )
    assert all(np.isfinite(float(v)) for v in metrics.values())
    for a, b in zip(
        jax.tree.leaves(state.trainable["diffs"]["age"]),
        jax.tree.leaves(new.trainable["diffs"]["age"]),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(
                diffs_lib.dense_diff_values(state.trainable["diffs"]["gender"])
            ),
            jax.tree.leaves(
                diffs_lib.dense_diff_values(new.trainable["diffs"]["gender"])
            ),
            strict=True,
        )
    ]
    assert any(moved)


@pytest.mark.parametrize(
    ("method", "value", "message"),
    [
        ("moddiffy_par", 1.5, "in \\[0, 1\\]"),
        ("diffprun_debias", 0.5, "set it to 0"),
    ],
)
def test_bad_compose_prob_names_the_fix(method, value, message):
    with pytest.raises(ValueError, match=message):
        train.build_context(tiny(method, **{"diff.compose_prob": value}))
