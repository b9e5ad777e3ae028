"""Gradual pruning of diffs inside the L0 phase."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax import context, train
from moddiffy_jax.config_lib import experiment_config
from moddiffy_jax.methods import common, moddiffy
from moddiffy_jax.subnets import diffs, hard_concrete


def test_close_gates_shuts_entries_exactly():
    params = {"w": jnp.ones((4, 5)), "b": jnp.ones(3)}
    state = diffs.init_diff(params, r".*")
    state = state.replace(delta=jax.tree.map(lambda d: d + 0.5, state.delta))
    keep = {
        "w": np.arange(20).reshape(4, 5) % 3 == 0,
        "b": np.array([True, False, True]),
    }
    closed = diffs.close_gates(state, keep)
    hc = hard_concrete.HardConcrete()
    for rng in range(5):
        z = diffs.diff_gates(closed, jax.random.PRNGKey(rng), hc=hc, train=True)
        for p in ("w", "b"):
            assert np.all(np.asarray(z[p])[~keep[p]] == 0.0)
    values = diffs.dense_diff_values(closed, hc=hc)
    for p in ("w", "b"):
        assert np.all(np.asarray(values[p])[~keep[p]] == 0.0)
        np.testing.assert_array_equal(
            np.asarray(closed.delta[p])[keep[p]], np.asarray(state.delta[p])[keep[p]]
        )
    # No gradient reaches a closed gate, so it stays closed (delta still gets
    # the straight-through gradient, but z * delta stays 0).
    grad = jax.grad(
        lambda s: sum(
            jnp.sum(v)
            for v in jax.tree.leaves(
                diffs.apply_dense_diff(
                    params, s, rng=jax.random.PRNGKey(0), hc=hc, train=True
                )
            )
        )
    )(closed)
    assert np.all(np.asarray(grad.log_alpha["w"])[~keep["w"]] == 0.0)


def test_magnitude_keep_mask_matches_prune_to_sparsity():
    rng = np.random.default_rng(0)
    values = {"a": rng.normal(size=(10, 10)), "b": rng.normal(size=7)}
    mask = diffs.magnitude_keep_mask(values, keep=0.1)
    assert sum(int(m.sum()) for m in mask.values()) == round(0.1 * 107)
    kept = np.concatenate([np.abs(values[p])[mask[p]] for p in mask])
    dropped = np.concatenate([np.abs(values[p])[~mask[p]] for p in mask])
    assert kept.min() >= dropped.max()
    # Ties (many equal magnitudes, as after a cut), closed entries and both
    # scopes: the very entries of prune_to_sparsity's indices.
    values = {
        "a": rng.choice([0.0, 0.5, -0.5, 1.0], size=(12, 9)),
        "b": rng.choice([0.0, 0.5, 2.0], size=31),
    }
    eligible = {p: rng.random(np.shape(v)) < 0.7 for p, v in values.items()}
    for keep, scope in ((0.3, "global"), (17, "global"), (0.25, "per_leaf")):
        for ok in (None, eligible):
            mask = diffs.magnitude_keep_mask(
                values, keep=keep, scope=scope, eligible=ok
            )
            sd = diffs.prune_to_sparsity(values, keep=keep, scope=scope, eligible=ok)
            for p in values:
                np.testing.assert_array_equal(
                    np.flatnonzero(mask[p]), np.asarray(sd.indices[p])
                )


def test_gradual_schedule_reaches_the_budget():
    c = experiment_config("moddiffy_par", "model=tiny")
    n = 100
    keeps = {t: moddiffy.gradual_keep(c, t, n) for t in range(1, n + 1)}
    events = {t: k for t, k in keeps.items() if k is not None}
    assert min(events) > c.diff.prune_start * n
    assert all(t % c.diff.prune_every == 0 for t in events)
    values = [events[t] for t in sorted(events)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert values[-1] == pytest.approx(c.diff.keep)
    with c.unlocked():
        c.diff.keep = 5.0
    with pytest.raises(ValueError, match="share of entries kept, in"):
        context.check_prune_config(c.diff)  # before any run starts


def test_taylor_scores_read_adams_second_moment():
    c = experiment_config("moddiffy_par", "model=tiny")
    tx = common.make_optimizer(c.optim)
    state = diffs.init_diff({"w": jnp.ones(3)}, r".*")
    params = {"diffs": {"g": state}, "task_head": {"k": jnp.ones(2)}}
    opt = tx.init(params)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 2.0), params)
    _, opt = tx.update(grads, opt, params)
    nu = moddiffy.adam_second_moment(opt, ("diffs", "g"))
    assert np.all(np.asarray(nu["w"]) > 0)
    # Under a schedule the chain holds a second (stateless) role partition,
    # and with accumulation optax.MultiSteps wraps both.
    with c.unlocked():
        c.optim.schedule, c.optim.warmup_steps, c.optim.accumulate = "linear", 1, 2
    sub = common.SubStep(name="s", updates=(), loss=None, optimizer=tx)
    (sub,) = common.schedule_substeps([sub], c.optim, phase_steps=8)
    opt = sub.optimizer.init(params)
    for _ in range(2):
        _, opt = sub.optimizer.update(grads, opt, params)
    nu = moddiffy.adam_second_moment(opt, ("diffs", "g"))
    assert np.all(np.asarray(nu["w"]) > 0)


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("prune_schedule", "gradul", "prune_schedule"),
        ("prune_score", "tylor", "prune_score"),
        ("structured", True, "structured"),
    ],
)
def test_bad_prune_config_fails_at_start(key, value, match):
    c = experiment_config("moddiffy_par", "model=tiny")
    with c.unlocked():
        c.diff[key] = value
    with pytest.raises(ValueError, match=match):
        train.build_context(c)


def test_runs_from_before_the_removal_fields_still_load():
    """A config.json written before this session's fields builds a context
    with the behaviour it was trained with (evaluate reads old runs)."""
    import json

    import ml_collections

    c = experiment_config("moddiffy_par", "model=tiny")
    d = json.loads(c.to_json())
    for k in ("adv_loss", "mmd_kernel", "mmd_conditional"):
        d["method"].pop(k)
    for k in (
        "prune_schedule",
        "prune_score",
        "prune_every",
        "prune_start",
        "prune_end",
    ):
        d["diff"].pop(k)
    ctx = train.build_context(ml_collections.ConfigDict(d))
    assert (ctx.debias.adv_loss, ctx.debias.mmd_conditional) == ("grl", "none")
