"""The running linear erasure term (objectives/erasure.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from moddiffy_jax import objectives

DIM = 16


def _batch(key, shift, n=32):
    """``n`` rows; the attribute (alternating 0/1) moves coordinate 0."""
    labels = jnp.arange(n) % 2
    h = jax.random.normal(key, (n, DIM))
    return h.at[:, 0].add(shift * labels), labels


def _loss(h, labels, state, decay=0.9):
    pairs = objectives.pair_weights(labels, [jnp.ones(h.shape[0])], 2)
    return objectives.fisher_loss(
        h,
        pairs,
        state,
        white=jnp.eye(DIM),
        decay=decay,
    )


def test_value_is_the_unbiased_squared_separation_along_the_running_direction():
    first, labels = _batch(jax.random.PRNGKey(0), 3.0)
    value, state = _loss(first, labels, objectives.init_mean_differences(1, DIM))
    assert float(value) == 0.0  # no direction before the first batch
    diff = jnp.mean(first[labels == 1], 0) - jnp.mean(first[labels == 0], 0)
    u = diff / jnp.linalg.norm(diff)  # the first batch sets the direction
    h, _ = _batch(jax.random.PRNGKey(1), 3.0)
    value, _ = _loss(h, labels, state)
    z = h @ u
    za, zb = z[labels == 1], z[labels == 0]
    noise = jnp.var(za, ddof=1) / za.size + jnp.var(zb, ddof=1) / zb.size
    pooled = (jnp.var(za) * za.size + jnp.var(zb) * zb.size) / (z.size - 2)
    expected = ((jnp.mean(za) - jnp.mean(zb)) ** 2 - noise) / pooled / DIM
    np.testing.assert_allclose(value, expected, rtol=1e-4)


def test_expectation_is_near_zero_without_a_difference():
    """Unbiased: on groups from one distribution the values average to ~0
    (the plain squared separation would average 1/n_a + 1/n_b in units of
    the variance)."""
    state = objectives.init_mean_differences(1, DIM)
    values = []
    for i in range(200):
        h, labels = _batch(jax.random.PRNGKey(i), 0.0)
        value, state = _loss(h, labels, state)
        values.append(float(value) * DIM)
    assert abs(np.mean(values)) < 0.03, np.mean(values)


def test_the_minimum_is_where_the_batch_groups_agree():
    """Moving group 1 by the gradient closes the gap along the direction
    and does not run past it (the first form did)."""
    state = objectives.init_mean_differences(1, DIM)
    for i in range(20):
        h, labels = _batch(jax.random.PRNGKey(i), 2.0)
        _, state = _loss(h, labels, state)
    h, labels = _batch(jax.random.PRNGKey(99), 2.0)
    shift = jnp.zeros(DIM)

    def loss_at(s):
        return _loss(h + s * labels[:, None], labels, state)[0]

    for _ in range(300):
        shift = shift - 0.5 * jax.grad(loss_at)(shift)
    moved = h + shift * labels[:, None]
    gap = jnp.mean(moved[labels == 1], 0) - jnp.mean(moved[labels == 0], 0)
    assert abs(float(gap[0])) < 0.2, gap[0]
    assert float(loss_at(shift)) < 0.0 + 1e-3


def test_shrinking_along_the_direction_lowers_nothing():
    state = objectives.init_mean_differences(1, DIM)
    for i in range(5):
        h, labels = _batch(jax.random.PRNGKey(i), 3.0)
        _, state = _loss(h, labels, state)
    h, labels = _batch(jax.random.PRNGKey(9), 3.0)
    value, _ = _loss(h, labels, state)
    u = state["diff"][0] / jnp.linalg.norm(state["diff"][0])  # the direction
    squeezed = h - 0.95 * (h @ u)[:, None] * u[None, :]
    value_squeezed, _ = _loss(squeezed, labels, state)
    np.testing.assert_allclose(value_squeezed, value, rtol=1e-4)
    # The median-scale form read this squeeze as removal.
    assert float(value) > 0.05


def test_shrinking_the_representation_lowers_nothing():
    state = objectives.init_mean_differences(1, DIM)
    for i in range(5):
        h, labels = _batch(jax.random.PRNGKey(i), 3.0)
        _, state = _loss(h, labels, state)
    h, labels = _batch(jax.random.PRNGKey(9), 3.0)
    value, _ = _loss(h, labels, state)
    shrunk, _ = _loss(0.05 * h, labels, state)
    np.testing.assert_allclose(shrunk, value, rtol=1e-4)


def test_gradient_follows_the_persistent_direction_not_the_batch_noise():
    """Groups of 8 in 16 dimensions: one batch's mean difference is mostly
    noise; the running one points along coordinate 0, where they differ."""

    def direction(state, key):
        h, labels = _batch(key, 1.0, n=16)
        grad = jax.grad(lambda x: _loss(x, labels, state)[0])(h)
        # The gradient on the group-1 members' mean: the direction the loss
        # moves that group in.
        g = jnp.mean(grad[labels == 1], 0)
        return abs(float(g[0])) / float(jnp.linalg.norm(g))

    def batch_direction(key):
        # The per-batch squared distance's gradient is along the batch's
        # own mean difference.
        h, labels = _batch(key, 1.0, n=16)
        g = jnp.mean(h[labels == 1], 0) - jnp.mean(h[labels == 0], 0)
        return abs(float(g[0])) / float(jnp.linalg.norm(g))

    warm = objectives.init_mean_differences(1, DIM)
    for i in range(60):
        h, labels = _batch(jax.random.PRNGKey(100 + i), 1.0, n=16)
        _, warm = _loss(h, labels, warm, decay=0.95)
    keys = [jax.random.PRNGKey(1000 + i) for i in range(20)]
    batch_only = np.mean([batch_direction(k) for k in keys])
    running = np.mean([direction(warm, k) for k in keys])
    assert running > 0.8, running
    assert batch_only < 0.6, batch_only


def test_a_pair_without_both_groups_leaves_its_state_and_the_loss_alone():
    h = jax.random.normal(jax.random.PRNGKey(0), (8, DIM))
    labels = jnp.zeros(8, jnp.int32)  # one group only
    state = {
        "diff": jnp.ones((1, DIM), jnp.float32),
        "weight": jnp.full((1,), 0.5, jnp.float32),
    }
    value, new = _loss(h, labels, state)
    assert float(value) == 0.0
    np.testing.assert_array_equal(new["diff"], state["diff"])
    np.testing.assert_array_equal(new["weight"], state["weight"])


def test_strata_and_one_vs_rest_splits():
    labels = jnp.array([0, 1, 2, 0, 1, 2])
    task = jnp.array([0, 0, 0, 1, 1, 1])
    strata = [(task == t).astype(jnp.float32) for t in range(2)]
    pairs = objectives.pair_weights(labels, strata, 3)
    assert len(pairs) == 6
    a, b, size = pairs[0]  # task 0, value 0 against the rest
    np.testing.assert_array_equal(a, [1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(b, [0, 1, 1, 0, 0, 0])
    assert int(size) == 3
