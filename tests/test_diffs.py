"""Property tests for dense and sparse diffs, pruning and the diff file format."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import save_file

from moddiffy_jax.subnets import diffs as dm
from moddiffy_jax.subnets.hard_concrete import (
    HardConcrete,
    deterministic_gate,
    sample_gates,
)
from moddiffy_jax.subnets.selection import flatten

HC = HardConcrete()
INCLUDE = r"encoder/.*"
# Jitted once for the whole file: eager op-by-op dispatch dominates test time.
gates = jax.jit(dm.diff_gates, static_argnames=("hc", "train"))
sample = jax.jit(sample_gates, static_argnames=("hc",))


def make_base(seed=0):
    rng = np.random.default_rng(seed)

    def r(*shape):
        return jnp.asarray(rng.normal(size=shape).astype(np.float32))

    return {
        "encoder": {
            "layer_0": {"kernel": r(4, 3), "bias": r(3)},
            "layer_1": {"kernel": r(3, 2)},
        },
        "head": {"kernel": r(2, 1)},
    }


def random_state(base, seed=1, structured=False):
    """A state with non-zero delta and spread-out log_alpha."""
    state = dm.init_diff(base, INCLUDE, structured=structured)
    rng = np.random.default_rng(seed)

    def rand_like(x, scale):
        return jnp.asarray(rng.normal(scale=scale, size=x.shape).astype(np.float32))

    return state.replace(
        delta=jax.tree.map(lambda x: rand_like(x, 1.0), state.delta),
        log_alpha=jax.tree.map(lambda x: rand_like(x, 2.0), state.log_alpha),
    )


def assert_trees_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


# -----------------------------------------------------------------------------
# Dense diffs.
# -----------------------------------------------------------------------------


def test_init_diff_shapes_and_penalty():
    base = make_base()
    state = dm.init_diff(base, INCLUDE, exclude=r".*/bias")
    assert sorted(flatten(state.delta)) == [
        "encoder/layer_0/kernel",
        "encoder/layer_1/kernel",
    ]
    for path, d in flatten(state.delta).items():
        assert d.shape == flatten(base)[path].shape and d.dtype == jnp.float32
        assert not np.any(np.asarray(d))
    assert jax.tree.structure(state.log_alpha) == jax.tree.structure(state.delta)
    assert np.all(np.asarray(state.log_alpha["encoder"]["layer_0"]["kernel"]) == 5.0)
    assert state.group_log_alpha == {} and not state.structured
    np.testing.assert_allclose(
        dm.l0_penalty(state, hc=HC), 18 * jax.nn.sigmoid(5.0), rtol=1e-6
    )
    with pytest.raises(ValueError, match="matches no parameter"):
        dm.init_diff(base, r"decoder/.*")


def test_init_diff_keeps_base_dtype():
    base = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_base())
    state = dm.init_diff(base, INCLUDE)
    assert all(d.dtype == jnp.bfloat16 for d in jax.tree.leaves(state.delta))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state.log_alpha))
    out = jax.jit(lambda b, s, k: dm.apply_dense_diff(b, s, rng=k, train=True))(
        base, state, jax.random.key(0)
    )
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(out))


def test_structured_state_shapes_gates_and_penalty():
    base = make_base()
    state = random_state(base, structured=True)
    assert state.structured
    assert jax.tree.structure(state.group_log_alpha) == jax.tree.structure(state.delta)
    assert all(g.shape == () for g in jax.tree.leaves(state.group_log_alpha))
    state = state.replace(
        group_log_alpha=jax.tree.map(lambda g: g * 0 - 1.0, state.group_log_alpha)
    )
    # Additive form: sum_i P(z_i > 0) + one P(z_g > 0) per tensor.
    expected = sum(
        float(jnp.sum(jax.nn.sigmoid(a))) for a in jax.tree.leaves(state.log_alpha)
    ) + 3 * float(jax.nn.sigmoid(-1.0))
    np.testing.assert_allclose(dm.l0_penalty(state, hc=HC), expected, rtol=1e-5)
    # Group gate closed deterministically (log_alpha_g <= 0): all z are 0.
    z = gates(state, None, hc=HC, train=False)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(z))
    # Sampled: z = z_elem * z_group, a scalar gate shared by the whole tensor.
    rng = jax.random.key(4)
    zs = gates(state, rng, hc=HC, train=True)
    r_elem, r_group = jax.random.split(rng)
    ze = sample(state.log_alpha, r_elem, hc=HC)
    zg = sample(state.group_log_alpha, r_group, hc=HC)
    jax.tree.map(lambda a, b, c: np.testing.assert_allclose(a, b * c), zs, ze, zg)


def test_zero_delta_gives_base_bitwise():
    base = make_base()
    state = dm.init_diff(base, INCLUDE)
    state = state.replace(log_alpha=jax.tree.map(lambda a: a * 0.1, state.log_alpha))
    for train in (True, False):
        for st in (True, False):
            out = jax.jit(
                lambda b, s, k, t=train, st=st: dm.apply_dense_diff(
                    b, s, rng=k, hc=HC, train=t, straight_through=st
                )
            )(base, state, jax.random.key(0))
            assert_trees_bitwise_equal(out, base)


def test_apply_dense_diff_value_and_untouched_leaves():
    base = make_base()
    state = random_state(base)
    rng = jax.random.key(2)
    for st in (True, False):
        out = dm.apply_dense_diff(base, state, rng=rng, train=True, straight_through=st)
        z = dm.diff_gates(state, rng, hc=HC, train=True)  # eager, like `out`
        for path, d in flatten(state.delta).items():
            want = flatten(base)[path] + flatten(z)[path] * d
            np.testing.assert_array_equal(flatten(out)[path], want)
        assert out["head"]["kernel"] is base["head"]["kernel"]
    # Eval uses the deterministic gate.
    out = dm.apply_dense_diff(base, state, train=False)
    k = "encoder/layer_1/kernel"
    want = (
        flatten(base)[k]
        + deterministic_gate(flatten(state.log_alpha)[k]) * (flatten(state.delta)[k])
    )
    np.testing.assert_allclose(flatten(out)[k], want, rtol=1e-6)
    with pytest.raises(ValueError, match="rng"):
        dm.apply_dense_diff(base, state, train=True)


@pytest.mark.parametrize("straight_through", [True, False])
def test_delta_gradient_conventions(straight_through):
    base = make_base()
    state = random_state(base)
    rng = jax.random.key(5)
    cot = jax.tree.map(lambda x: jnp.cos(3.0 * x) + 0.1, base)  # arbitrary g

    def loss(s):
        out = dm.apply_dense_diff(
            base, s, rng=rng, hc=HC, train=True, straight_through=straight_through
        )
        return sum(
            jnp.sum(o * c)
            for o, c in zip(jax.tree.leaves(out), jax.tree.leaves(cot), strict=True)
        )

    grads = jax.jit(jax.grad(loss))(state)
    z = gates(state, rng, hc=HC, train=True)
    assert np.any(np.asarray(flatten(z)["encoder/layer_0/kernel"]) == 0.0)
    for path, gd in flatten(grads.delta).items():
        g, zp = flatten(cot)[path], flatten(z)[path]
        want = (1.0 + zp) * g if straight_through else zp * g
        np.testing.assert_allclose(gd, want, rtol=1e-6)

    # log_alpha gets g * delta * dz/dlog_alpha in both conventions.
    def gated(la):
        zz = gates(state.replace(log_alpha=la), rng, hc=HC, train=True)
        return sum(
            jnp.sum(flatten(zz)[p] * flatten(state.delta)[p] * flatten(cot)[p])
            for p in flatten(state.delta)
        )

    want_la = jax.jit(jax.grad(gated))(state.log_alpha)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        grads.log_alpha,
        want_la,
    )


def test_frozen_base_bit_identical_after_optax_step():
    base = make_base()
    base_copy = jax.tree.map(lambda x: np.array(x, copy=True), base)
    state = dm.init_diff(base, INCLUDE)
    opt = optax.adam(1e-2)
    opt_state = opt.init(state)
    x = jnp.ones((5, 4))

    def loss_fn(trainable, frozen, rng):
        p = dm.apply_dense_diff(frozen, trainable, rng=rng, hc=HC, train=True)
        h = x @ p["encoder"]["layer_0"]["kernel"] + p["encoder"]["layer_0"]["bias"]
        h = jnp.tanh(h) @ p["encoder"]["layer_1"]["kernel"]
        y = h @ p["head"]["kernel"]
        return jnp.mean((y - 1.0) ** 2) + 1e-3 * dm.l0_penalty(trainable, hc=HC)

    @jax.jit
    def step(trainable, opt_state, frozen, rng):
        grads = jax.grad(loss_fn)(trainable, frozen, rng)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, frozen

    new_state, _, frozen_out = step(state, opt_state, base, jax.random.key(0))
    assert_trees_bitwise_equal(frozen_out, base_copy)
    assert_trees_bitwise_equal(base, base_copy)
    for before, after in zip(
        jax.tree.leaves(state), jax.tree.leaves(new_state), strict=True
    ):
        assert not np.array_equal(before, after)  # delta and log_alpha moved


def test_dense_diff_values_is_deterministic_gated_delta():
    state = random_state(make_base())
    vals = dm.dense_diff_values(state, hc=HC)
    for path, d in flatten(state.delta).items():
        z = deterministic_gate(flatten(state.log_alpha)[path], hc=HC)
        np.testing.assert_array_equal(flatten(vals)[path], z * d)


# -----------------------------------------------------------------------------
# Fingerprints.
# -----------------------------------------------------------------------------


def test_fingerprint_sensitivity():
    base = make_base()
    fp = dm.fingerprint(base)
    assert len(fp) == 16 and fp == dm.fingerprint(make_base())
    reordered = {"head": base["head"], "encoder": base["encoder"]}
    assert dm.fingerprint(reordered) == fp
    flat = flatten(base)
    w = np.array(flat["encoder/layer_1/kernel"])
    w.view(np.uint32)[1, 1] ^= 1  # flip the lowest mantissa bit
    changed = dict(flat, **{"encoder/layer_1/kernel": jnp.asarray(w)})
    assert dm.fingerprint(changed) != dm.fingerprint(flat)
    reshaped = dict(
        flat, **{"encoder/layer_0/bias": flat["encoder/layer_0/bias"][None]}
    )
    assert dm.fingerprint(reshaped) != dm.fingerprint(flat)
    recast = dict(flat, **{"head/kernel": flat["head/kernel"].astype(jnp.float16)})
    assert dm.fingerprint(recast) != dm.fingerprint(flat)


# -----------------------------------------------------------------------------
# Sparse diffs.
# -----------------------------------------------------------------------------


def sparse_from(flat_dense, name="d", fp=""):
    from moddiffy_jax.subnets.selection import unflatten

    return dm.SparseDiff.from_dense(
        unflatten({p: jnp.asarray(v, jnp.float32) for p, v in flat_dense.items()}),
        name=name,
        base_fingerprint=fp,
        rules={"include": [INCLUDE]},
    )


def test_from_dense_to_dense_roundtrip_and_counts():
    a = np.zeros((4, 3), np.float32)
    a[0, 1], a[3, 2] = 1.5, -2.0
    b = np.array([0.0, 0.25, 0.0], np.float32)
    d = sparse_from({"encoder/layer_0/kernel": a, "encoder/layer_0/bias": b})
    assert d.nnz() == 3 and d.num_selected() == 15
    assert d.nnz_per_leaf() == {"encoder/layer_0/kernel": 2, "encoder/layer_0/bias": 1}
    assert d.density() == pytest.approx(3 / 15)
    assert d.density_per_leaf()["encoder/layer_0/bias"] == pytest.approx(1 / 3)
    np.testing.assert_array_equal(d.indices["encoder/layer_0/kernel"], [1, 11])
    dense = d.to_dense()
    np.testing.assert_array_equal(dense["encoder"]["layer_0"]["kernel"], a)
    np.testing.assert_array_equal(dense["encoder"]["layer_0"]["bias"], b)
    np.testing.assert_array_equal(
        d.scale(-2.0).to_dense()["encoder"]["layer_0"]["kernel"], -2.0 * a
    )
    assert d.rules == ((INCLUDE,), ())
    assert d.info["method"] == "from_dense"


def test_rules_are_normalised_to_hashable_tuples():
    vals = {"encoder": {"w": jnp.ones((2,))}}
    for rules, want in [
        (INCLUDE, ((INCLUDE,), ())),
        ([INCLUDE, "x"], ((INCLUDE, "x"), ())),
        (([INCLUDE], [r".*/bias"]), ((INCLUDE,), (r".*/bias",))),
        ((INCLUDE, ()), ((INCLUDE,), ())),
        ({"exclude": "b"}, ((), ("b",))),
        ((), ((), ())),
    ]:
        d = dm.prune_to_sparsity(vals, keep=1, rules=rules)
        assert d.rules == want, rules
        hash(jax.tree.structure(d))
    with pytest.raises(ValueError, match="rule kinds"):
        dm.prune_to_sparsity(vals, keep=1, rules={"includes": ["a"]})


def test_apply_diffs_composition_identities():
    base = make_base()
    fp = dm.fingerprint(base)
    rng = np.random.default_rng(3)
    k0, k1 = "encoder/layer_0/kernel", "encoder/layer_1/kernel"

    def rand_sparse(mask_seed):
        m = np.random.default_rng(mask_seed)
        return {
            k0: rng.normal(size=(4, 3)) * (m.random((4, 3)) < 0.5),
            k1: rng.normal(size=(3, 2)) * (m.random((3, 2)) < 0.5),
        }

    da, db = (
        sparse_from(rand_sparse(10), "a", fp),
        sparse_from(rand_sparse(11), "b", fp),
    )
    both = dm.apply_diffs(base, [da, db])
    one_by_one = dm.apply_diffs(dm.apply_diffs(base, [da]), [db])
    summed = dm.apply_diffs(base, [da.add(db)])
    assert_trees_bitwise_equal(both, one_by_one)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), both, summed)
    assert both["head"]["kernel"] is base["head"]["kernel"]
    # Weighted: +1 then -1 returns the base (up to rounding); 0 weights exactly.
    back = dm.apply_diffs(dm.apply_diffs(base, [da]), [da], weights=[-1.0])
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), back, base)
    zero = dm.apply_diffs(base, [da, db], weights=jnp.zeros((2,)))
    assert_trees_bitwise_equal(zero, base)
    # Reference: dense arithmetic.
    dense = jax.tree.map(lambda x, y: 0.5 * x - 2.0 * y, da.to_dense(), db.to_dense())
    weighted = dm.apply_diffs(base, [da, db], weights=jnp.array([0.5, -2.0]))
    for p, v in flatten(dense).items():
        np.testing.assert_allclose(
            flatten(weighted)[p], flatten(base)[p] + v, rtol=1e-6, atol=1e-6
        )
    assert_trees_bitwise_equal(dm.apply_diffs(base, []), base)


def test_apply_diffs_exact_for_disjoint_supports():
    base = make_base()
    k = "encoder/layer_0/kernel"
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    mask = np.arange(12).reshape(4, 3) % 2 == 0
    da, db = sparse_from({k: x * mask}), sparse_from({k: x * ~mask})
    summed = da.add(db)
    assert summed.nnz() == 12 and summed.name == "d+d"
    ref = dm.apply_diffs(base, [da, db])
    assert_trees_bitwise_equal(ref, dm.apply_diffs(base, [summed]))
    assert_trees_bitwise_equal(ref, dm.apply_diffs(dm.apply_diffs(base, [da]), [db]))


def test_one_composition_is_one_program():
    """Applying diffs eagerly lowers one program for the whole composition,
    not one per operation, leaf shape and nnz (two 1% diffs on MiniLM:
    about 300 single-operation programs before stop 67), and the same
    composition again lowers nothing."""
    import jax.monitoring

    base = make_base()
    rng = np.random.default_rng(5)
    shapes = {"encoder/layer_0/kernel": (4, 3), "encoder/layer_1/kernel": (3, 2)}
    da, db = (
        sparse_from(
            {k: rng.normal(size=s) * (rng.random(s) < f) for k, s in shapes.items()}
        )
        for f in (0.4, 0.7)  # nnz per leaf unlike every other test's
    )
    lowered = []

    def count(event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        out = dm.apply_diffs(base, [da, db], weights=[0.5, -2.0])
        assert len(lowered) == 1, lowered
        again = dm.apply_diffs(base, [da, db], weights=[1.5, 3.0])
        assert len(lowered) == 1, lowered
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    for p in shapes:
        want = np.asarray(flatten(base)[p]) + (
            0.5 * flatten(da.to_dense())[p] - 2.0 * flatten(db.to_dense())[p]
        )
        np.testing.assert_allclose(flatten(out)[p], want, rtol=1e-6, atol=1e-6)
        assert not np.array_equal(flatten(again)[p], flatten(out)[p])


def test_add_requires_same_base():
    k = "encoder/layer_0/kernel"
    one = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="same base"):
        sparse_from({k: one}, fp="aaa").add(sparse_from({k: one}, fp="bbb"))
    with pytest.raises(ValueError, match="shapes"):
        sparse_from({k: one}).add(sparse_from({"encoder/layer_0/bias": np.ones(3)}))


def test_apply_diffs_rejects_wrong_shape():
    base = make_base()
    d = sparse_from({"encoder/layer_0/bias": np.ones(4)})
    with pytest.raises(ValueError, match="shape"):
        dm.apply_diffs(base, [d])
    with pytest.raises(ValueError, match="weights"):
        dm.apply_diffs(base, [d], weights=[1.0, 2.0])


def test_no_retrace_when_swapping_diffs():
    base = make_base()
    state_a, state_b = random_state(base, seed=1), random_state(base, seed=2)
    # Per-leaf budgets give equal shapes; a global budget only fixes the total.
    kw = {"keep": 2, "scope": "per_leaf", "base_fingerprint": dm.fingerprint(base)}
    da = dm.prune_to_sparsity(dm.dense_diff_values(state_a), name="gender", **kw)
    db = dm.prune_to_sparsity(dm.dense_diff_values(state_b), name="age", **kw)
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def apply(b, ds, w):
        return dm.apply_diffs(b, ds, w)

    out_a = apply(base, [da.without_metadata()], jnp.ones((1,)))
    out_b = apply(base, [db.without_metadata()], jnp.array([-1.0], jnp.float32))
    apply(base, [da.scale(3.0).without_metadata()], jnp.ones((1,)))
    assert not np.array_equal(
        out_a["encoder"]["layer_0"]["kernel"], out_b["encoder"]["layer_0"]["kernel"]
    )
    assert_trees_bitwise_equal(out_a, dm.apply_diffs(base, [da], [1.0]))
    # A list of traced scalars as the weights, as a caller's jit passes them.
    scaled = jax.jit(lambda b, s: dm.apply_diffs(b, [da, db], [s, -s]))(base, 0.5)
    assert_trees_bitwise_equal(scaled, dm.apply_diffs(base, [da, db], [0.5, -0.5]))
    # Same name: swapping values alone needs no metadata stripping.
    dc = dm.prune_to_sparsity(dm.dense_diff_values(state_b), name="gender", **kw)
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def apply2(b, ds):
        return dm.apply_diffs(b, ds)

    apply2(base, [da])
    apply2(base, [dc])


def test_apply_sparse_values_fixmask_gradient():
    base = make_base()
    k = "encoder/layer_1/kernel"
    dense = np.zeros((3, 2), np.float32)
    dense[0, 1], dense[2, 0] = 0.5, -1.0
    d = sparse_from({k: dense})
    cot = jnp.arange(6.0).reshape(3, 2) + 1.0

    def loss(values, frozen):
        p = dm.apply_sparse_values(frozen, d, values)
        return jnp.sum(p["encoder"]["layer_1"]["kernel"] * cot) + jnp.sum(
            p["encoder"]["layer_0"]["kernel"]
        )

    g = jax.jit(jax.grad(loss))(d.values, base)
    np.testing.assert_array_equal(g[k], np.asarray(cot).reshape(-1)[[1, 4]])
    out = dm.apply_sparse_values(base, d, d.values)
    assert_trees_bitwise_equal(out, dm.apply_diffs(base, [d]))
    with pytest.raises(ValueError, match="shape"):
        dm.apply_sparse_values(base, d, {k: jnp.zeros((3,))})


# -----------------------------------------------------------------------------
# Magnitude pruning.
# -----------------------------------------------------------------------------


def _tied_values():
    # Many zeros and ties in magnitude across two leaves.
    return {
        "a": jnp.array([[0.0, 3.0, -1.0], [1.0, 0.0, -3.0]]),
        "b": jnp.array([1.0, -1.0, 0.0, 2.0, 0.0]),
    }


def test_prune_global_exact_count_with_ties_and_zeros():
    vals = _tied_values()  # |v| sorted: 3,3,2,1,1,1,1,0,0,0,0 (a first, then b)
    for k, want in [
        (0, {"a": [], "b": []}),
        (2, {"a": [1, 5], "b": []}),
        (3, {"a": [1, 5], "b": [3]}),
        (4, {"a": [1, 2, 5], "b": [3]}),  # first tie at |v|=1 in leaf order
        (6, {"a": [1, 2, 3, 5], "b": [0, 3]}),
        (9, {"a": [0, 1, 2, 3, 4, 5], "b": [0, 1, 3]}),  # zeros kept to reach k
        (11, {"a": [0, 1, 2, 3, 4, 5], "b": [0, 1, 2, 3, 4]}),
    ]:
        d = dm.prune_to_sparsity(vals, keep=k)
        assert d.nnz() == k
        for p in ("a", "b"):
            np.testing.assert_array_equal(d.indices[p], want[p])
            assert d.indices[p].dtype == jnp.int32
            np.testing.assert_array_equal(
                d.values[p], np.asarray(vals[p]).reshape(-1)[want[p]]
            )
    frac = dm.prune_to_sparsity(vals, keep=0.5)  # round(5.5) = 6 (Python rounding)
    assert frac.nnz() == 6 and frac.info["k"] == 6 and frac.info["scope"] == "global"


def test_prune_per_leaf_exact_count():
    vals = _tied_values()
    d = dm.prune_to_sparsity(vals, keep=2, scope="per_leaf")
    assert d.nnz_per_leaf() == {"a": 2, "b": 2}
    np.testing.assert_array_equal(d.indices["a"], [1, 5])
    np.testing.assert_array_equal(d.indices["b"], [0, 3])
    d = dm.prune_to_sparsity(vals, keep=0.4, scope="per_leaf")
    assert d.nnz_per_leaf() == {"a": round(0.4 * 6), "b": round(0.4 * 5)}
    with pytest.raises(ValueError, match="outside"):
        dm.prune_to_sparsity(vals, keep=6, scope="per_leaf")  # leaf b has 5
    with pytest.raises(ValueError, match="scope"):
        dm.prune_to_sparsity(vals, keep=1, scope="layer")
    with pytest.raises(TypeError):
        dm.prune_to_sparsity(vals, keep=True)


def test_prune_never_keeps_ineligible_entries():
    vals = _tied_values()  # |v| sorted: 3,3,2,1,1,1,1,0,0,0,0 (a first, then b)
    ok = {"a": np.ones((2, 3), bool), "b": np.ones(5, bool)}
    ok["a"].reshape(-1)[[1, 5]] = False  # the two 3s: closed gates
    ok["b"][[2, 4]] = False  # two zeros of leaf b
    d = dm.prune_to_sparsity(vals, keep=3, eligible=ok)
    np.testing.assert_array_equal(d.indices["a"], [2, 3])  # the 2, then a 1
    np.testing.assert_array_equal(d.indices["b"], [3])
    # An eligible zero beats an ineligible entry of any size, and a budget
    # above the eligible count keeps every eligible entry and nothing else.
    d = dm.prune_to_sparsity(vals, keep=11, eligible=ok)
    assert d.nnz() == 7 and d.info["k"] == 7
    for p in ("a", "b"):
        np.testing.assert_array_equal(d.indices[p], np.flatnonzero(ok[p].reshape(-1)))
    per_leaf = dm.prune_to_sparsity(vals, keep=5, scope="per_leaf", eligible=ok)
    assert per_leaf.nnz_per_leaf() == {"a": 4, "b": 3}
    mask = dm.magnitude_keep_mask(vals, keep=11, eligible=ok)
    np.testing.assert_array_equal(mask["a"], ok["a"])
    with pytest.raises(ValueError, match="eligible does not match"):
        dm.prune_to_sparsity(vals, keep=2, eligible={"a": ok["a"]})


def test_prune_matches_stable_sort_reference_and_is_deterministic():
    rng = np.random.default_rng(0)
    # Quantised values: lots of exact ties and zeros.
    vals = {
        "x": jnp.asarray(np.round(rng.normal(size=(50, 40)) * 2) / 2, jnp.float32),
        "y": jnp.asarray(np.round(rng.normal(size=(300,)) * 2) / 2, jnp.float32),
    }
    flat = np.concatenate([np.abs(np.asarray(v)).reshape(-1) for v in vals.values()])
    for k in (1, 37, 500, 1234, 2300):
        order = np.argsort(-flat, kind="stable")[:k]  # ties: lower global index
        d = dm.prune_to_sparsity(vals, keep=k)
        got = np.concatenate(
            [np.asarray(d.indices["x"]), 2000 + np.asarray(d.indices["y"])]
        )
        np.testing.assert_array_equal(np.sort(got), np.sort(order))
        d2 = dm.prune_to_sparsity(vals, keep=k)
        assert_trees_bitwise_equal((d.indices, d.values), (d2.indices, d2.values))


def test_prune_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        dm.prune_to_sparsity({"a": jnp.array([1.0, jnp.nan])}, keep=1)


def test_prune_from_trained_state_pipeline():
    base = make_base()
    state = random_state(base)
    d = dm.prune_to_sparsity(
        dm.dense_diff_values(state),
        keep=0.5,
        name="gender",
        base_fingerprint=dm.fingerprint(base),
        rules=INCLUDE,
        info={"lambda_l0": 1.25e-7},
    )
    # N = 12 + 3 + 6 = 21; round(10.5) = 10 (Python rounds half to even).
    assert d.nnz() == 10 and d.num_selected() == 21
    assert d.paths == (
        "encoder/layer_0/bias",
        "encoder/layer_0/kernel",
        "encoder/layer_1/kernel",
    )
    assert d.info == {
        "method": "magnitude_topk",
        "scope": "global",
        "keep": 0.5,
        "k": 10,
        "lambda_l0": 1.25e-7,
    }


# -----------------------------------------------------------------------------
# File format.
# -----------------------------------------------------------------------------


def _saved_diff(base):
    return dm.prune_to_sparsity(
        dm.dense_diff_values(random_state(base)),
        keep=7,
        name="gender",
        base_fingerprint=dm.fingerprint(base),
        rules={"include": [INCLUDE], "exclude": [r".*/bias"]},
        info={"target": 0.01, "nested": {"a": [1, 2]}},
    )


def test_save_load_roundtrip_bitwise(tmp_path):
    base = make_base()
    d = _saved_diff(base)
    path = dm.save_sparse_diff(tmp_path / "gender.safetensors", d)
    loaded = dm.load_sparse_diff(path, base=base)
    assert_trees_bitwise_equal((loaded.indices, loaded.values), (d.indices, d.values))
    for field in ("shapes", "dtype", "name", "base_fingerprint", "rules", "info_json"):
        assert getattr(loaded, field) == getattr(d, field), field
    assert jax.tree.structure(loaded) == jax.tree.structure(d)
    assert loaded.info["nested"] == {"a": [1, 2]}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_save_refuses_overwrite(tmp_path):
    base = make_base()
    d = _saved_diff(base)
    path = tmp_path / "d.safetensors"
    dm.save_sparse_diff(path, d)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        dm.save_sparse_diff(path, d.scale(2.0))
    np.testing.assert_array_equal(
        dm.load_sparse_diff(path).values["encoder/layer_1/kernel"],
        d.values["encoder/layer_1/kernel"],
    )
    dm.save_sparse_diff(path, d.scale(2.0), overwrite=True)
    np.testing.assert_array_equal(
        dm.load_sparse_diff(path).values["encoder/layer_1/kernel"],
        2.0 * np.asarray(d.values["encoder/layer_1/kernel"]),
    )


def test_load_refuses_mismatched_base(tmp_path):
    base = make_base()
    path = dm.save_sparse_diff(tmp_path / "d.safetensors", _saved_diff(base))
    changed = jax.tree.map(lambda x: x, base)
    changed["encoder"]["layer_0"]["kernel"] = (
        base["encoder"]["layer_0"]["kernel"].at[0, 0].add(1e-3)
    )
    with pytest.raises(ValueError) as err:
        dm.load_sparse_diff(path, base=changed)
    msg = str(err.value)
    assert dm.fingerprint(base) in msg and dm.fingerprint(changed) in msg
    assert "allow_base_mismatch=True" in msg
    dm.load_sparse_diff(path, base=changed, allow_base_mismatch=True)

    reshaped = jax.tree.map(lambda x: x, base)
    reshaped["encoder"]["layer_1"]["kernel"] = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="encoder/layer_1/kernel"):
        dm.load_sparse_diff(path, base=reshaped)
    d = dm.load_sparse_diff(path, base=reshaped, allow_base_mismatch=True)
    with pytest.raises(ValueError, match="shape"):  # applying is still refused
        dm.apply_diffs(reshaped, [d])


def test_load_rejects_foreign_and_newer_files(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"w": np.zeros(3, np.float32)}, str(plain))
    with pytest.raises(ValueError, match="not a moddiffy sparse diff"):
        dm.load_sparse_diff(plain)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"definitely not safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        dm.load_sparse_diff(garbage)
    base = make_base()
    d = _saved_diff(base)
    path = dm.save_sparse_diff(tmp_path / "d.safetensors", d)
    from safetensors import safe_open

    with safe_open(path, "np") as f:
        meta = json.loads(f.metadata()[dm.METADATA_KEY])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    meta["version"] = dm.FORMAT_VERSION + 1
    newer = tmp_path / "newer.safetensors"
    save_file(tensors, str(newer), metadata={dm.METADATA_KEY: json.dumps(meta)})
    with pytest.raises(ValueError, match="newer|upgrade"):
        dm.load_sparse_diff(newer)


# -----------------------------------------------------------------------------
# Gated rows: a diff on a table the model reads only by rows.
# -----------------------------------------------------------------------------


def test_uniform_rows_are_rows_of_the_full_draw():
    from moddiffy_jax.subnets import noise

    key = jax.random.fold_in(jax.random.PRNGKey(4), 9)
    rows = jnp.asarray([5, 0, 5, 99, 17], jnp.int32)
    full = jax.random.uniform(key, (100, 7), jnp.float32)
    got = jax.jit(noise.uniform_rows, static_argnums=1)(key, (100, 7), rows)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(full)[np.asarray(rows)])


@pytest.mark.parametrize("straight_through", [True, False])
def test_gathered_rows_equal_the_dense_table(straight_through):
    """Rows read from a GatedRows table, and the gradients through them
    (repeated ids included), are the dense gated table's bit for bit; the
    other leaves are untouched by the option."""
    base = make_base()
    base["encoder"]["emb"] = jnp.asarray(
        np.random.default_rng(3).normal(size=(50, 3)).astype(np.float32)
    )
    state = random_state(base)
    ids = jnp.asarray([[1, 7, 7, 49], [0, 1, 2, 1]], jnp.int32)
    key = jax.random.PRNGKey(11)

    def read(st, gathered):
        p = dm.apply_dense_diff(
            base,
            st,
            rng=key,
            hc=HC,
            train=True,
            straight_through=straight_through,
            gathered=gathered,
        )
        emb = p["encoder"]["emb"]
        rows = (
            emb.take_rows(ids) if hasattr(emb, "take_rows") else jnp.take(emb, ids, 0)
        )
        rest = p["encoder"]["layer_0"]["kernel"]
        return jnp.sum(jnp.sin(rows)) + jnp.sum(rest**2), (rows, rest)

    dense = jax.jit(jax.value_and_grad(lambda s: read(s, ()), has_aux=True))
    lazy = jax.jit(
        jax.value_and_grad(lambda s: read(s, ("encoder/emb",)), has_aux=True)
    )
    (_, (rows_d, rest_d)), g_d = dense(state)
    (_, (rows_l, rest_l)), g_l = lazy(state)
    assert_trees_bitwise_equal(rows_l, rows_d)
    assert_trees_bitwise_equal(rest_l, rest_d)
    # Equal values (an unread row's gradient may be -0.0 on the dense path).
    for a, b in zip(jax.tree.leaves(g_l), jax.tree.leaves(g_d), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.max(jnp.abs(g_l.delta["encoder"]["emb"]))) > 0
