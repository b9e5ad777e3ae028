"""Tests for moddiffy_jax.subnets.masks on tiny hand-made pytrees."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moddiffy_jax.subnets import masks as mk
from moddiffy_jax.subnets import selection

INCLUDE = r".*kernel"


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "layer_0": {
            "dense": {
                "kernel": jnp.asarray(rng.normal(size=(10, 10)), jnp.float32),
                "bias": jnp.asarray(rng.normal(size=(10,)), jnp.float32),
            }
        },
        "layer_1": {
            "conv": {
                "kernel": jnp.asarray(rng.normal(size=(2, 2, 5, 5)), jnp.float32),
                "bias": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
            }
        },
        "head": {"kernel": jnp.asarray(rng.normal(size=(10, 3)), jnp.float32)},
    }


def _lexicographic_pruned(scores, k):
    """The first k flat indices in (score, index) order."""
    flat = np.asarray(scores).ravel()
    order = sorted(range(flat.size), key=lambda i: (flat[i], i))
    return set(order[:k])


@pytest.mark.parametrize("sparsity", [0.0, 0.13, 0.5, 0.7, 0.9, 1.0])
def test_thresholds_exact_count_with_ties(sparsity):
    rng = np.random.default_rng(1)
    scores = {
        "a": {"kernel": jnp.asarray(rng.integers(0, 3, size=(10, 10)), jnp.float32)},
        "b": {"kernel": jnp.zeros((2, 2, 5, 5), jnp.float32)},  # all tied
        "c": {"kernel": jnp.asarray(rng.normal(size=(10, 3)), jnp.float32)},
    }
    ths = mk.thresholds_for_sparsity(scores, sparsity=sparsity)
    masks = mk.binary_masks(scores, ths)
    for path, m in selection.flatten(masks).items():
        s = selection.flatten(scores)[path]
        n = s.size
        keep = round((1 - sparsity) * n)
        assert m.dtype == jnp.bool_ and m.shape == s.shape
        assert int(m.sum()) == keep, path
        pruned = set(np.flatnonzero(~np.asarray(m)).tolist())
        assert pruned == _lexicographic_pruned(s, n - keep), path


def test_thresholds_traced_sparsity_matches_concrete():
    rng = np.random.default_rng(2)
    scores = {"k": jnp.asarray(rng.integers(0, 4, (10, 10)), jnp.float32)}

    @jax.jit
    def traced(s, sparsity):
        return mk.binary_masks(s, mk.thresholds_for_sparsity(s, sparsity=sparsity))

    for sparsity in (0.0, 0.25, 0.5, 0.9):
        want = mk.binary_masks(
            scores, mk.thresholds_for_sparsity(scores, sparsity=sparsity)
        )
        got = traced(scores, jnp.float32(sparsity))
        np.testing.assert_array_equal(got["k"], want["k"])


def test_sparsity_out_of_range_raises():
    with pytest.raises(ValueError, match="sparsity"):
        mk.thresholds_for_sparsity({"k": jnp.ones((2, 2))}, sparsity=1.5)


def test_init_magnitude_keeps_largest_weights_exactly_with_ties():
    kernel = jnp.asarray([[0.5, -0.1, 0.1, 2.0], [-0.5, 0.1, 0.0, -2.0]], jnp.float32)
    params = {"dense": {"kernel": kernel, "bias": jnp.ones(4)}}
    state = mk.init_scores(params, INCLUDE, init="magnitude", sparsity=0.5)
    assert set(selection.flatten(state.scores)) == {"dense/kernel"}
    s = state.scores["dense"]["kernel"]
    assert s.dtype == jnp.float32
    # (|w|, index) order: 0.0@6, 0.1@1, 0.1@2, 0.1@5, 0.5@0, 0.5@4, 2.0@3, 2.0@7.
    keep = np.zeros(8, bool)
    keep[[0, 3, 4, 7]] = True  # 0.5, 2.0, 0.5, 2.0
    np.testing.assert_array_equal(
        np.asarray(s).ravel(), np.where(keep, 0.02, 0.0).astype(np.float32)
    )
    th = state.thresholds["dense"]["kernel"]
    assert float(th.value) == pytest.approx(0.01) and int(th.index) == -1
    mask = mk.binary_masks(state.scores, state.thresholds)["dense"]["kernel"]
    np.testing.assert_array_equal(np.asarray(mask).ravel(), keep)

    # Sparsity 0.25 with three-way tie at |w| = 0.1: exactly 2 pruned.
    state = mk.init_scores(params, INCLUDE, init="magnitude", sparsity=0.25)
    mask = mk.binary_masks(state.scores, state.thresholds)["dense"]["kernel"]
    np.testing.assert_array_equal(np.flatnonzero(~np.asarray(mask).ravel()), [1, 6])


@pytest.mark.parametrize("init", ["magnitude", "magnitude_soft"])
def test_init_magnitude_variants_same_initial_mask(init):
    params = _params()
    state = mk.init_scores(params, INCLUDE, init=init, sparsity=0.7)
    masks = mk.binary_masks(state.scores, state.thresholds)
    for path, m in selection.flatten(masks).items():
        w = np.abs(np.asarray(selection.flatten(params)[path])).ravel()
        keep = round(0.3 * w.size)
        assert int(m.sum()) == keep
        np.testing.assert_array_equal(
            np.sort(np.flatnonzero(np.asarray(m).ravel())),
            np.sort(np.argsort(-w, kind="stable")[:keep]),
        )


def test_init_constant_and_unknown_init():
    params = _params()
    state = mk.init_scores(params, INCLUDE, init="constant", sparsity=0.0)
    masks = mk.binary_masks(state.scores, state.thresholds)
    assert all(bool(m.all()) for m in jax.tree.leaves(masks))
    state = mk.init_scores(params, INCLUDE, init="constant", sparsity=0.5)
    overall, _ = mk.mask_sparsity(mk.binary_masks(state.scores, state.thresholds))
    assert float(overall) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="magnitude_soft"):
        mk.init_scores(params, INCLUDE, init="uniform", sparsity=0.5)


def _loss(params, x):
    h = jnp.tanh(
        x @ params["layer_0"]["dense"]["kernel"] + params["layer_0"]["dense"]["bias"]
    )
    conv = params["layer_1"]["conv"]["kernel"].reshape(20, 5)
    out = h @ params["head"]["kernel"] + jnp.sum(conv) * 0.1
    return jnp.sum(jnp.sin(out)) + jnp.sum(conv**2)


def test_apply_masks_value_and_straight_through_gradient():
    params = _params()
    x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 10)), jnp.float32)
    state = mk.init_scores(params, INCLUDE, init="magnitude_soft", sparsity=0.6)
    masks = mk.binary_masks(state.scores, state.thresholds)

    eff = jax.jit(lambda b, s, t: mk.apply_masks(b, s, thresholds=t))(
        params, state.scores, state.thresholds
    )
    for path, w in selection.flatten(params).items():
        got = selection.flatten(eff)[path]
        if path.endswith("kernel"):
            want = np.asarray(w) * np.asarray(selection.flatten(masks)[path])
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_array_equal(got, w)
    eager = mk.apply_masks(params, state.scores, thresholds=state.thresholds)
    assert eager["layer_0"]["dense"]["bias"] is params["layer_0"]["dense"]["bias"]

    grad_scores = jax.jit(
        jax.grad(
            lambda s: _loss(mk.apply_masks(params, s, thresholds=state.thresholds), x)
        )
    )(state.scores)
    real_mask = jax.tree.map(lambda m: m.astype(jnp.float32), masks)
    grad_mask = jax.jit(
        jax.grad(
            lambda m: _loss(selection.map_subtree(lambda w, mm: w * mm, params, m), x)
        )
    )(real_mask)
    chex.assert_trees_all_close(grad_scores, grad_mask, rtol=1e-5, atol=1e-6)
    # dL/dS = dL/dW_eff * W: non-zero also at pruned entries.
    g = grad_scores["layer_0"]["dense"]["kernel"]
    pruned = ~masks["layer_0"]["dense"]["kernel"]
    assert bool(jnp.any(g[pruned] != 0))


def test_apply_masks_with_sparsity_and_argument_check():
    params = _params()
    state = mk.init_scores(params, INCLUDE, init="magnitude_soft", sparsity=0.3)
    eff = mk.apply_masks(params, state.scores, sparsity=0.3)
    want = mk.apply_masks(params, state.scores, thresholds=state.thresholds)
    chex.assert_trees_all_equal(eff, want)
    with pytest.raises(ValueError, match="exactly one"):
        mk.apply_masks(params, state.scores)
    with pytest.raises(ValueError, match="exactly one"):
        mk.apply_masks(params, state.scores, sparsity=0.3, thresholds=state.thresholds)


def test_frozen_base_bit_identical_after_jitted_optax_step():
    params = _params()
    base_copy = jax.tree.map(np.array, params)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(4, 10)), jnp.float32)
    state = mk.init_scores(params, INCLUDE, init="magnitude_soft", sparsity=0.5)
    opt = optax.adamw(1e-2, weight_decay=0.0)
    opt_state = opt.init(state.scores)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(scores, opt_state, base, thresholds, sparsity):
        loss, grads = jax.value_and_grad(
            lambda s: _loss(mk.apply_masks(base, s, thresholds=thresholds), x)
        )(scores)
        updates, opt_state = opt.update(grads, opt_state, scores)
        thresholds = mk.thresholds_for_sparsity(scores, sparsity=sparsity)
        return optax.apply_updates(scores, updates), opt_state, thresholds, loss

    scores, thresholds = state.scores, state.thresholds
    for i in range(3):
        sparsity = jnp.float32(0.5 + 0.1 * i)
        scores, opt_state, thresholds, _ = step(
            scores, opt_state, params, thresholds, sparsity
        )
    chex.assert_trees_all_equal(params, base_copy)
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), scores, state.scores)
    assert all(jax.tree.leaves(changed))


def test_reset_thresholds():
    params = _params()
    state = mk.init_scores(params, INCLUDE, init="magnitude", sparsity=0.5)
    state = mk.reset_thresholds(state, sparsity=0.8)
    _, per_leaf = mk.mask_sparsity(mk.binary_masks(state.scores, state.thresholds))
    assert per_leaf["layer_0/dense/kernel"] == pytest.approx(0.8)
    assert per_leaf["layer_1/conv/kernel"] == pytest.approx(0.8)
    assert per_leaf["head/kernel"] == pytest.approx(24 / 30)


def test_cubic_sparsity_schedule_values():
    sched = mk.cubic_sparsity_schedule(
        initial=0.7, final=0.9, begin_step=10, end_step=110
    )
    want = {
        0: 0.7,
        10: 0.7,
        35: 0.9 - 0.2 * 0.75**3,
        60: 0.9 - 0.2 * 0.5**3,
        85: 0.9 - 0.2 * 0.25**3,
        110: 0.9,
        1000: 0.9,
    }
    for t, s in want.items():
        assert float(sched(t)) == pytest.approx(s, abs=1e-6), t
    values = jax.jit(jax.vmap(sched))(jnp.arange(0, 130))
    assert bool(jnp.all(jnp.diff(values) >= 0))
    assert float(values.min()) >= 0.7 - 1e-7 and float(values.max()) <= 0.9 + 1e-7


def test_cubic_sparsity_schedule_frequency_and_fractional_steps():
    sched = mk.cubic_sparsity_schedule(
        initial=0.0, final=0.8, begin_step=0, end_step=1.0, frequency=0.25
    )
    assert float(sched(0.2)) == pytest.approx(0.0)
    assert float(sched(0.3)) == pytest.approx(0.8 - 0.8 * 0.75**3)
    assert float(sched(0.5)) == pytest.approx(0.8 - 0.8 * 0.5**3)
    assert float(sched(0.99)) == pytest.approx(0.8 - 0.8 * 0.25**3)
    assert float(sched(1.0)) == pytest.approx(0.8)
    # end - begin not a multiple of the frequency: final reached at end_step.
    sched = mk.cubic_sparsity_schedule(
        initial=0.5, final=0.9, begin_step=0, end_step=10, frequency=4
    )
    assert float(sched(9)) == pytest.approx(0.9 - 0.4 * 0.2**3)
    assert float(sched(10)) == pytest.approx(0.9)
    step_fn = mk.cubic_sparsity_schedule(
        initial=0.5, final=0.9, begin_step=5, end_step=5
    )
    assert float(step_fn(4)) == pytest.approx(0.5)
    assert float(step_fn(5)) == pytest.approx(0.9)
    with pytest.raises(ValueError):
        mk.cubic_sparsity_schedule(initial=0.5, final=0.9, begin_step=5, end_step=1)


def _imp_params():
    rng = np.random.default_rng(5)
    return {
        "a": {"kernel": jnp.asarray(rng.normal(size=(10, 10)), jnp.float32)},
        "b": {"kernel": jnp.asarray(rng.normal(size=(2, 2, 5, 5)), jnp.float32)},
        "b_bias": jnp.ones(5),
    }


def test_imp_prunes_fraction_of_remaining_per_matrix():
    params = _imp_params()
    masks = mk.init_masks(params, INCLUDE)
    assert set(selection.flatten(masks)) == {"a/kernel", "b/kernel"}
    masks1 = mk.imp_prune(params, masks, fraction=0.2)
    masks2 = mk.imp_prune(params, masks1, fraction=0.2)
    for path in ("a/kernel", "b/kernel"):
        w = np.abs(np.asarray(selection.flatten(params)[path])).ravel()
        m1 = np.asarray(selection.flatten(masks1)[path]).ravel()
        m2 = np.asarray(selection.flatten(masks2)[path]).ravel()
        assert m1.dtype == bool and (~m1).sum() == 20 and (~m2).sum() == 36
        assert not np.any(m2 & ~m1)  # pruned entries stay pruned
        order = np.argsort(w, kind="stable")
        np.testing.assert_array_equal(np.sort(np.flatnonzero(~m2)), np.sort(order[:36]))
    overall, per_leaf = mk.mask_sparsity(masks2)
    assert float(overall) == pytest.approx(0.36)
    assert float(per_leaf["b/kernel"]) == pytest.approx(0.36)


def test_imp_reference_schedule_and_ties():
    params = {"k": {"kernel": jnp.ones((10, 10), jnp.float32)}}  # all tied
    masks = mk.init_masks(params, INCLUDE)
    for k in range(10):
        masks = mk.imp_prune(params, masks, fraction=mk.imp_round_fraction(k))
        m = np.asarray(masks["k"]["kernel"]).ravel()
        assert (~m).sum() == 10 * (k + 1)
        np.testing.assert_array_equal(np.flatnonzero(~m), np.arange(10 * (k + 1)))
    # uint8 masks are accepted; weights are measured only where remaining.
    masks = {"k": {"kernel": jnp.ones((10, 10), jnp.uint8).at[0, :5].set(0)}}
    out = mk.imp_prune(params, masks, fraction=0.5)
    assert int((~out["k"]["kernel"]).sum()) == 5 + round(0.5 * 95)


def test_rewind_restores_rewind_params_on_kept_entries():
    params = _imp_params()
    pretrained = jax.tree.map(lambda w: w * 3.0 + 1.0, params)
    rewind_to = selection.select(pretrained, r"a/kernel|b_bias")  # not b/kernel
    masks = mk.imp_prune(params, mk.init_masks(params, INCLUDE), fraction=0.3)
    out = jax.jit(mk.rewind)(params, masks, rewind_to)
    ma, mb = np.asarray(masks["a"]["kernel"]), np.asarray(masks["b"]["kernel"])
    a = np.asarray(out["a"]["kernel"])
    np.testing.assert_array_equal(a[ma], np.asarray(pretrained["a"]["kernel"])[ma])
    assert np.all(a[~ma] == 0)
    b = np.asarray(out["b"]["kernel"])
    np.testing.assert_array_equal(b[mb], np.asarray(params["b"]["kernel"])[mb])
    assert np.all(b[~mb] == 0)
    np.testing.assert_array_equal(out["b_bias"], pretrained["b_bias"])
    applied = mk.apply_binary_masks(params, masks)
    assert applied["b_bias"] is params["b_bias"]
    np.testing.assert_array_equal(
        applied["a"]["kernel"], np.where(ma, params["a"]["kernel"], 0.0)
    )
