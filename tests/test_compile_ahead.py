"""The next phase's step compiled beside this phase's steps
(``train.compile_ahead``): used at the phase change only when it is the
program the phase would compile, and then it computes what that program
computes. A two-phase toy method (no model: the programs compile in well
under a second) stands in for MoDDiffy, whose trigger is checked alone."""

import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from moddiffy_jax import parallel, train
from moddiffy_jax.methods import common, moddiffy
from tests.helpers import tiny


def _loss(trainable, frozen, batch, rng):
    w = trainable["w"]
    noise = jax.random.normal(rng, w.shape)
    return jnp.sum((w * batch["x"][: w.shape[0]] - frozen["t"] + noise) ** 2), {}


class _Toy:
    """Phase "a" trains a vector; the transition into "b" keeps its first
    ``config.keep`` entries (the shapes of "b" depend on it)."""

    @staticmethod
    def transition(ctx, trainable, frozen, next_phase):
        return {"w": np.asarray(trainable["w"])[: ctx.config.keep]}, frozen

    @staticmethod
    def substeps(ctx, phase, trainable):
        return [common.SubStep("task", (("w",),), _loss, optax.adam(0.1))]

    @staticmethod
    def phase_steps(config, phase):
        return 3


def _ctx(keep, ahead="on", step_jit="step"):
    config = ml_collections.ConfigDict(
        {
            "keep": keep,
            "train": {"compile_ahead": ahead, "step_jit": step_jit},
            "optim": {"schedule": "constant"},
        }
    )
    return types.SimpleNamespace(config=config, mesh=parallel.make_mesh())


def _phase_a():
    state, _ = train._phase_state(
        _ctx(4), _Toy, "a", {"w": jnp.arange(1.0, 9.0)}, global_step=7
    )
    return state, {"t": jnp.float32(0.5)}, {"x": jnp.linspace(-1.0, 1.0, 8)}


def _phase_b(ctx, state, frozen):
    """What the loop does at the phase change, up to compiling the step."""
    trainable, frozen = _Toy.transition(
        ctx, jax.device_get(state.trainable), frozen, "b"
    )
    new, substeps = train._phase_state(ctx, _Toy, "b", trainable, int(state.step))
    new, frozen = parallel.replicate((new, frozen), ctx.mesh)
    return new, frozen, train.compile_step(ctx.config, substeps)


@pytest.mark.parametrize("keep_then, keep_now", [(4, 4), (5, 4)])
def test_the_program_compiled_ahead_is_used_only_if_it_is_the_phases(
    keep_then, keep_now
):
    state, frozen, batch = _phase_a()
    rng = jax.random.PRNGKey(3)
    ahead = train._Ahead.start(_ctx(keep_then), _Toy, state, frozen, batch, rng, "b")
    assert ahead is not None and ahead.at_step == 7
    ctx = _ctx(keep_now)  # the shapes at the phase change
    new, frozen_b, step_fn = _phase_b(ctx, state, frozen)
    fn, record = ahead.step_fn(step_fn, new, frozen_b, rng)
    assert record["phase"] == "b" and record["compile_ahead/from_step"] == 7
    assert record["compile_ahead/used"] == int(keep_then == keep_now), record
    assert "compile_ahead/error" not in record
    # Either way the step is the phase's own: two steps equal the plain jit's.
    plain = jax.jit(common.make_train_step(_Toy.substeps(ctx, "b", None)))
    a, b = new, jax.tree.map(jnp.copy, new)
    for _ in range(2):
        a, metrics_a = fn(a, frozen_b, batch, rng)
        b, metrics_b = plain(b, frozen_b, batch, rng)
    assert a.trainable["w"].shape == (keep_now,)
    np.testing.assert_array_equal(a.trainable["w"], b.trainable["w"])
    np.testing.assert_array_equal(metrics_a["task/loss"], metrics_b["task/loss"])


def test_a_failed_compile_ahead_is_reported_and_the_phase_compiles():
    state, frozen, batch = _phase_a()
    rng = jax.random.PRNGKey(0)
    ahead = train._Ahead.start(_ctx("bad"), _Toy, state, frozen, batch, rng, "b")
    new, frozen_b, step_fn = _phase_b(_ctx(4), state, frozen)
    fn, record = ahead.step_fn(step_fn, new, frozen_b, rng)
    assert record["compile_ahead/used"] == 0
    assert "TypeError" in record["compile_ahead/error"]  # slicing by a string
    assert fn(new, frozen_b, batch, rng)[0].trainable["w"].shape == (4,)


@pytest.mark.parametrize(
    "ahead, step_jit", [("auto", "step"), ("off", "step"), ("on", "substeps")]
)
def test_no_compile_ahead_where_it_is_off(ahead, step_jit):
    # "auto" is on for accelerators only; the tests run on the CPU.
    assert jax.default_backend() == "cpu"
    state, frozen, batch = _phase_a()
    ctx = _ctx(4, ahead=ahead, step_jit=step_jit)
    rng = jax.random.PRNGKey(0)
    assert train._Ahead.start(ctx, _Toy, state, frozen, batch, rng, "b") is None


def test_moddiffy_settles_fixmask_shapes_at_the_last_gradual_cut():
    # The dense fixmask state runs the L0 phase's program: nothing to settle.
    dense = tiny("moddiffy_par", **{"diff.prune_every": 1})
    assert not any(moddiffy.next_shapes_settled(dense, "l0", s, 4) for s in range(5))
    config = tiny(
        "moddiffy_par", **{"diff.prune_every": 1, "diff.fixmask_state": "sparse"}
    )
    # l0_steps 4: cuts after steps 1 and 2, so the shapes are settled from 2.
    settled = [
        s for s in range(1, 5) if moddiffy.next_shapes_settled(config, "l0", s, 4)
    ]
    assert settled == [2, 3, 4]
    assert not moddiffy.next_shapes_settled(config, "fixmask", 1, 3)
    with config.unlocked():
        config.diff.prune_schedule = "final"  # one cut, at the phase's end
    assert not moddiffy.next_shapes_settled(config, "l0", 4, 4)


def test_a_bad_compile_ahead_value_is_named(tmp_path):
    with pytest.raises(ValueError, match="compile_ahead"):
        train.train_and_evaluate(
            tiny("moddiffy_par", **{"train.compile_ahead": "yes"}), tmp_path / "run"
        )
    assert not (tmp_path / "run").exists()
