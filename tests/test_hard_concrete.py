"""Property tests for the hard-concrete gates."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax.subnets import hard_concrete as hcm
from moddiffy_jax.subnets import noise
from moddiffy_jax.subnets.hard_concrete import HardConcrete

DEFAULT = HardConcrete()
# Asymmetric stretch and a non-unit temperature exercise the log-ratio term.
SKEWED = HardConcrete(left=-0.1, right=1.1, temperature=2.0 / 3.0)


def test_defaults_match_references():
    assert DEFAULT == HardConcrete(-1.5, 1.5, 1.0, 5.0, 1e-4)
    assert DEFAULT.log_ratio == 0.0
    hash(DEFAULT)  # usable as a static jit argument


@pytest.mark.parametrize(
    "kwargs", [{"left": 0.1}, {"right": 0.9}, {"temperature": 0.0}, {"eps": 0.6}]
)
def test_invalid_hyperparameters_rejected(kwargs):
    with pytest.raises(ValueError):
        HardConcrete(**kwargs)


@pytest.mark.parametrize("hc", [DEFAULT, SKEWED], ids=["default", "skewed"])
def test_expected_l0_matches_monte_carlo(hc):
    log_alpha = jnp.array([-3.0, -1.0, 0.0, 0.7, 2.0, 4.0])
    n = 200_000
    z = jax.jit(
        lambda k: hcm.sample_gate(jnp.broadcast_to(log_alpha, (n, 6)), k, hc=hc)
    )(jax.random.key(0))
    empirical = np.mean(np.asarray(z) > 0, axis=0)
    expected = np.asarray(hcm.prob_nonzero(log_alpha, hc=hc))
    # Binomial std <= 0.5 / sqrt(n) ~ 1.1e-3; eps clamping is negligible here.
    np.testing.assert_allclose(empirical, expected, atol=5e-3)
    total = hcm.expected_l0({"a": log_alpha, "b": {"c": log_alpha[:2]}}, hc=hc)
    np.testing.assert_allclose(total, expected.sum() + expected[:2].sum(), rtol=1e-6)


def test_samples_at_init_log_alpha():
    z = hcm.sample_gate(jnp.full((200_000,), 5.0), jax.random.key(1), hc=DEFAULT)
    z = np.asarray(z)
    assert z.min() >= 0.0 and z.max() <= 1.0
    np.testing.assert_allclose(np.mean(z == 1.0), 0.967, atol=3e-3)
    np.testing.assert_allclose(np.mean(z == 0.0), 0.0067, atol=1.5e-3)


def test_deterministic_gate_thresholds():
    ln5 = math.log(5.0)
    la = jnp.array([-10.0, -1e-3, 0.0, 1e-3, 1.0, ln5 - 1e-3, ln5 + 1e-3, 3.0, 50.0])
    z = np.asarray(hcm.deterministic_gate(la, hc=DEFAULT))
    np.testing.assert_array_equal(z == 1.0, np.asarray(la) >= ln5)
    np.testing.assert_array_equal(z == 0.0, np.asarray(la) <= 0.0)
    assert np.all((z > 0) & (z < 1) == ((np.asarray(la) > 0) & (np.asarray(la) < ln5)))


def test_sample_gate_gradient_flows_to_log_alpha():
    la = jnp.array([0.0, 1.0, -0.5])
    g = jax.grad(lambda a: jnp.sum(hcm.sample_gate(a, jax.random.key(3), hc=DEFAULT)))(
        la
    )
    z = hcm.sample_gate(la, jax.random.key(3), hc=DEFAULT)
    interior = (z > 0) & (z < 1)
    assert np.all(np.asarray(g)[np.asarray(interior)] > 0)
    assert np.all(np.asarray(g)[~np.asarray(interior)] == 0)


def test_dtype_preserved():
    la = jnp.zeros((3,), jnp.bfloat16)
    assert hcm.sample_gate(la, jax.random.key(0)).dtype == jnp.bfloat16
    assert hcm.deterministic_gate(la).dtype == jnp.bfloat16


def _tree():
    return {
        "enc": {"w": jnp.zeros((4, 3)), "b": jnp.zeros((3,))},
        "emb": jnp.zeros((5, 2)),
    }


def test_sample_gates_distinct_keys_and_deterministic():
    tree = jax.tree.map(lambda x: x + 0.5, _tree())
    rng = jax.random.key(7)
    sample = jax.jit(lambda t, k: hcm.sample_gates(t, k, hc=DEFAULT))
    z1, z2 = sample(tree, rng), sample(tree, rng)
    jax.tree.map(np.testing.assert_array_equal, z1, z2)
    assert jax.tree.structure(z1) == jax.tree.structure(tree)
    # Same-shaped leaves with the same log_alpha get different noise.
    zs = sample({"a": jnp.zeros((64,)), "b": jnp.zeros((64,))}, rng)
    assert not np.array_equal(zs["a"], zs["b"])
    assert hcm.sample_gates({}, rng) == {}


def test_sample_gates_n_shape_and_independence():
    tree = _tree()
    zn = jax.jit(lambda t, k: hcm.sample_gates_n(t, k, hc=DEFAULT, n=5))(
        tree, jax.random.key(0)
    )
    for leaf, z in zip(jax.tree.leaves(tree), jax.tree.leaves(zn), strict=True):
        assert z.shape == (5, *leaf.shape)
    zw = np.asarray(zn["enc"]["w"]).reshape(5, -1)
    assert len({row.tobytes() for row in zw}) == 5


def test_expected_l0_empty_and_jit():
    assert float(hcm.expected_l0({})) == 0.0
    val = jax.jit(lambda t: hcm.expected_l0(t, hc=DEFAULT))(_tree())
    np.testing.assert_allclose(val, 0.5 * (12 + 3 + 10), rtol=1e-6)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (384, 1536)])
def test_fused_noise_is_jax_random_uniform_bit_for_bit(shape):
    for seed in (0, 1, 2**31 + 5):
        key = jax.random.fold_in(jax.random.PRNGKey(seed % 2**31), seed)
        want = np.asarray(jax.random.uniform(key, shape, jnp.float32))
        got = np.asarray(jax.jit(noise.uniform, static_argnums=1)(key, shape))
        np.testing.assert_array_equal(got, want)
        typed = jax.random.key(seed % 2**31)
        np.testing.assert_array_equal(
            np.asarray(noise.uniform(typed, shape)),
            np.asarray(jax.random.uniform(typed, shape)),
        )


def test_fused_noise_hash_is_traced_once_per_shape(monkeypatch):
    """A step draws noise for many leaves of few shapes: the hash is traced
    once per shape (and per rows' shape) and inlined, so the program is the
    one tracing it every time gives, and so are the numbers."""
    traced = []
    real = noise._to_unit_float

    def counting(words, counter):
        traced.append(counter.shape)
        return real(words, counter)

    monkeypatch.setattr(noise, "_to_unit_float", counting)
    for fn in (noise._uniform_of_words, noise._rows_of_words):
        fn.clear_cache()
    keys = jax.random.split(jax.random.PRNGKey(4), 4)
    rows = jnp.asarray([2, 0])

    def draws(keys):
        return (
            noise.uniform(keys[0], (3, 11)),
            noise.uniform(keys[1], (3, 11)),
            noise.uniform(keys[2], (13,)),
            noise.uniform_rows(keys[3], (3, 11), rows),
            noise.uniform_rows(keys[0], (3, 11), rows),
        )

    got = jax.jit(draws)(keys)
    assert sorted(traced) == [(2, 11), (3, 11), (13,)]
    assert "pjit" not in str(jax.make_jaxpr(draws)(keys))  # inlined
    want = [jax.random.uniform(keys[i], s) for i, s in ((0, (3, 11)), (1, (3, 11)))]
    want += [jax.random.uniform(keys[2], (13,))]
    want += [jax.random.uniform(keys[i], (3, 11))[rows] for i in (3, 0)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_small_leaves_of_one_shape_draw_as_one_hash(monkeypatch):
    """uniform_many: the numbers of one uniform() per key, bit for bit, with
    the small draws of one shape computed by one stacked hash; a lone shape
    and a leaf at the size limit keep their own draw; and sample_gates gives
    each leaf what sample_gate gives it with its key."""
    monkeypatch.setattr(noise, "GROUP_BELOW", 64)
    hashes = []
    real = noise._to_unit_float

    def counting(words, counter):
        hashes.append(jnp.broadcast_shapes(counter.shape, jnp.shape(words[0])))
        return real(words, counter)

    monkeypatch.setattr(noise, "_to_unit_float", counting)
    for fn in (noise._uniform_of_words, noise._stacked_of_words):
        fn.clear_cache()
    shapes = [(5,), (3, 4), (5,), (8, 8), (5,), (3, 4), (8, 8), (2,)]
    keys = list(jax.random.split(jax.random.PRNGKey(9), len(shapes)))
    got = jax.jit(lambda ks: noise.uniform_many(ks, shapes))(keys)
    for k, s, g in zip(keys, shapes, got, strict=True):
        assert g.shape == s
        np.testing.assert_array_equal(
            np.asarray(g), np.asarray(jax.random.uniform(k, s))
        )
    # (5,) x3 and (3, 4) x2 stacked; (8, 8) has 64 entries: one draw each; (2,)
    # alone.
    assert sorted(hashes) == [(2,), (2, 3, 4), (3, 5), (8, 8)]
    tree = {"a": jnp.full((5,), 0.3), "b": jnp.zeros((5,)), "c": jnp.ones((3, 4))}
    rng = jax.random.PRNGKey(2)
    z = jax.jit(lambda t: hcm.sample_gates(t, rng, hc=DEFAULT))(tree)
    leaves = jax.tree.leaves(tree)
    for la, k, zi in zip(
        leaves, jax.random.split(rng, len(leaves)), jax.tree.leaves(z), strict=True
    ):
        np.testing.assert_array_equal(
            np.asarray(zi), np.asarray(hcm.sample_gate(la, k, hc=DEFAULT))
        )
    with pytest.raises(ValueError, match="2 keys for 1 shapes"):
        noise.uniform_many(keys[:2], shapes[:1])


def test_fused_noise_falls_back_for_other_generators():
    key = jax.random.key(3, impl="rbg")
    np.testing.assert_array_equal(
        np.asarray(noise.uniform(key, (4, 5))),
        np.asarray(jax.random.uniform(key, (4, 5))),
    )
