"""Tests for packed diffs: apply_packed equals apply_diffs and never retraces."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax.subnets import diffs as dm
from moddiffy_jax.subnets.selection import flatten, unflatten

K0, B0, K1 = "encoder/layer_0/kernel", "encoder/layer_0/bias", "encoder/layer_1/kernel"


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


def dense_values(seed):
    """Random dense diff values over the three encoder leaves."""
    rng = np.random.default_rng(seed)
    shapes = {K0: (4, 3), B0: (3,), K1: (3, 2)}
    return {
        "encoder": {
            "layer_0": {
                "kernel": rng.normal(size=shapes[K0]).astype(np.float32),
                "bias": rng.normal(size=shapes[B0]).astype(np.float32),
            },
            "layer_1": {"kernel": rng.normal(size=shapes[K1]).astype(np.float32)},
        }
    }


def global_pair(base, keep=6):
    """Two globally pruned diffs: same total nnz, different split over leaves."""
    fp = dm.fingerprint(base)
    for s in range(100):
        da = dm.prune_to_sparsity(
            dense_values(2 * s), keep=keep, name="a", base_fingerprint=fp
        )
        db = dm.prune_to_sparsity(
            dense_values(2 * s + 1), keep=keep, name="b", base_fingerprint=fp
        )
        if da.nnz_per_leaf() != db.nnz_per_leaf():
            return da, db
    raise AssertionError("no pair with different per-leaf splits")


def assert_trees_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def assert_trees_close(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


apply_packed = jax.jit(dm.apply_packed)
WEIGHTS = ([1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, -1.0], [0.5, -2.0])


def test_pack_layout_and_unpack_round_trip():
    base = make_base()
    da, db = global_pair(base)
    packed, names = dm.pack_diffs([da, db], nnz=9)
    assert names == ("a", "b")
    assert packed.indices.shape == (2, 9) and packed.indices.dtype == jnp.int32
    assert packed.values.shape == (2, 9) and packed.values.dtype == jnp.float32
    assert packed.paths == da.paths and packed.num_selected == 12 + 3 + 6
    assert packed.base_fingerprint == da.base_fingerprint
    # Padding: pad index N, value 0, at the end of each row.
    np.testing.assert_array_equal(packed.indices[:, 6:], packed.num_selected)
    np.testing.assert_array_equal(packed.values[:, 6:], 0.0)
    for k, d in enumerate([da, db]):
        back = dm.unpack(packed, names, k)
        assert back.name == d.name and back.shapes == d.shapes
        assert back.base_fingerprint == d.base_fingerprint
        assert_trees_bitwise_equal(back.indices, d.indices)
        assert_trees_bitwise_equal(back.values, d.values)
    with pytest.raises(ValueError, match="names"):
        dm.unpack(packed, ("a",), 0)
    with pytest.raises(ValueError, match="outside"):
        dm.unpack(packed, names, 2)


def test_apply_packed_matches_apply_diffs():
    base = make_base()
    da, db = global_pair(base)
    packed, _ = dm.pack_diffs([da, db])
    for w in WEIGHTS:
        out = apply_packed(base, packed, jnp.asarray(w, jnp.float32))
        assert_trees_close(out, dm.apply_diffs(base, [da, db], jnp.asarray(w)))
        assert_trees_bitwise_equal(out["head"], base["head"])
    # Eager (unjitted) too, with a list of weights.
    assert_trees_close(
        dm.apply_packed(base, packed, [1.0, 1.0]), dm.apply_diffs(base, [da, db])
    )
    # Unselected leaves are returned as they are.
    eager = dm.apply_packed(base, packed, [1.0, 1.0])
    assert eager["head"]["kernel"] is base["head"]["kernel"]


def test_apply_packed_exact_for_disjoint_supports():
    base = make_base()
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    mask = np.arange(12).reshape(4, 3) % 2 == 0
    fp = dm.fingerprint(base)

    def sparse(v, name):
        tree = {"encoder": {"layer_0": {"kernel": v}}}
        return dm.SparseDiff.from_dense(tree, name=name, base_fingerprint=fp)

    da, db = sparse(x * mask, "a"), sparse(x * ~mask, "b")
    packed, _ = dm.pack_diffs([da, db], nnz=8)
    for w in WEIGHTS:
        w = jnp.asarray(w, jnp.float32)
        assert_trees_bitwise_equal(
            apply_packed(base, packed, w), dm.apply_diffs(base, [da, db], w)
        )


def test_no_retrace_across_diffs_weights_and_budgets():
    base = make_base()
    da, db = global_pair(base, keep=6)
    dc, dd = global_pair(base, keep=4)
    assert da.nnz_per_leaf() != db.nnz_per_leaf()
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def apply(b, packed, w):
        return dm.apply_packed(b, packed, w)

    cap = 8
    packs = [
        dm.pack_diffs([da, db], nnz=cap)[0],
        dm.pack_diffs([db, da], nnz=cap)[0],
        dm.pack_diffs([dc, da], nnz=cap)[0],  # different budgets, one capacity
        dm.pack_diffs([dc.scale(3.0), dd], nnz=cap)[0],
    ]
    outs = []
    for packed in packs:
        for w in WEIGHTS:
            outs.append(apply(base, packed, jnp.asarray(w, jnp.float32)))
    # Switching really changes the result.
    assert not np.array_equal(
        outs[0]["encoder"]["layer_0"]["kernel"], outs[1]["encoder"]["layer_0"]["kernel"]
    )
    assert_trees_close(outs[0], dm.apply_diffs(base, [da], [1.0]))
    assert_trees_close(outs[1], dm.apply_diffs(base, [db], [1.0]))
    assert_trees_close(outs[len(WEIGHTS)], dm.apply_diffs(base, [db], [1.0]))
    # Diffs differing only in name share the compile (names are kept outside).
    renamed = [d.replace(name=n) for d, n in ((da, "gender"), (db, "age"))]
    packed, names = dm.pack_diffs(renamed, nnz=cap)
    assert names == ("gender", "age")
    apply(base, packed, jnp.ones((2,), jnp.float32))


def test_default_capacity_is_largest_nnz_and_too_small_refused():
    base = make_base()
    da, _ = global_pair(base, keep=6)
    dc, _ = global_pair(base, keep=4)
    packed, _ = dm.pack_diffs([dc, da])
    assert packed.capacity == 6
    np.testing.assert_array_equal(packed.indices[0, 4:], packed.num_selected)
    assert_trees_close(
        apply_packed(base, packed, jnp.array([1.0, -1.0])),
        dm.apply_diffs(base, [dc, da], [1.0, -1.0]),
    )
    with pytest.raises(ValueError, match="below the largest"):
        dm.pack_diffs([dc, da], nnz=5)
    # Padding is dropped, not added as 0 at position 0: with an infinite weight
    # (inf * 0 is NaN), entries outside the support still equal the base.
    values = jax.tree.map(np.zeros_like, dense_values(0))
    values["encoder"]["layer_1"]["kernel"][1, 1] = 2.0
    d = dm.SparseDiff.from_dense(values)
    packed, _ = dm.pack_diffs([d], nnz=5)
    out = apply_packed(base, packed, jnp.array([jnp.inf]))
    expected = dict(flatten(base))
    expected[K1] = expected[K1].at[1, 1].set(jnp.inf)
    for p, v in flatten(out).items():
        np.testing.assert_array_equal(v, expected[p])


def test_mismatches_refused():
    base = make_base()
    da, db = global_pair(base)
    with pytest.raises(ValueError, match="base fingerprint"):
        dm.pack_diffs([da, db.replace(base_fingerprint="other")])
    sub = dm.SparseDiff.from_dense(
        {"encoder": {"layer_0": {"kernel": np.ones((3, 4), np.float32)}}},
        base_fingerprint=da.base_fingerprint,
    )
    with pytest.raises(ValueError, match="one shape per leaf"):
        dm.pack_diffs([da, sub])
    with pytest.raises(ValueError, match="dtype"):
        dm.pack_diffs([da, db.replace(dtype="float16")])
    with pytest.raises(ValueError, match="at least one"):
        dm.pack_diffs([])
    packed, _ = dm.pack_diffs([da, db])
    with pytest.raises(ValueError, match="one weight per packed diff"):
        dm.apply_packed(base, packed, [1.0])
    with pytest.raises(ValueError, match="one weight per packed diff"):
        apply_packed(base, packed, jnp.ones((3,)))
    with pytest.raises(ValueError, match="one weight per packed diff"):
        apply_packed(base, packed, jnp.ones((2, 1)))
    other = dict(
        base, encoder=dict(base["encoder"], layer_1={"kernel": jnp.ones((2, 3))})
    )
    with pytest.raises(ValueError, match="shape"):
        dm.apply_packed(other, packed, [1.0, 1.0])


def test_diffs_over_different_leaves_pack_together():
    """A diff over every tensor and a pruning of one kernel (MoDDiffy + FFW)."""
    base = make_base()
    da, _ = global_pair(base)
    flat = flatten(base)
    path = next(p for p in flat if np.ndim(flat[p]) == 2)
    keep = np.ones(np.shape(flat[path]), bool)
    keep[0, :] = False
    mask = dm.pruning_diff(base, unflatten({path: keep}), name="prune")
    mask = mask.replace(base_fingerprint=da.base_fingerprint)
    packed, names = dm.pack_diffs([da, mask])
    assert names == (da.name, "prune")
    out = dm.apply_packed(base, packed, jnp.asarray([1.0, 1.0]))
    want = dm.apply_diffs(dm.apply_diffs(base, [da]), [mask])
    for p, v in flatten(out).items():
        np.testing.assert_allclose(v, flatten(want)[p], rtol=1e-6, atol=1e-6)
