"""The running linear erasure term (objectives/erasure.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moddiffy_jax import objectives

DIM = 16


def _batch(key, shift, n=32):
    """``n`` rows; the attribute (alternating 0/1) moves coordinate 0."""
    labels = jnp.arange(n) % 2
    h = jax.random.normal(key, (n, DIM))
    return h.at[:, 0].add(shift * labels), labels


@jax.jit
def _loss(h, labels, state, decay=0.9):
    """The term on one batch, compiled (op by op the loops below take tens of
    seconds)."""
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

    step = jax.jit(jax.grad(loss_at))
    for _ in range(300):
        shift = shift - 0.5 * step(shift)
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


# --------------------------------------------------------------------------
# Erased targets.


def _cells(key, n=64, shift=2.0):
    """Rows of two task classes (coordinate 1) whose attribute value (its
    share differs by class) moves coordinate 0 by ``shift``."""
    k1, k2 = jax.random.split(key)
    task = (jnp.arange(n) % 2).astype(jnp.int32)
    labels = (jax.random.uniform(k1, (n,)) < jnp.where(task == 1, 0.8, 0.3)).astype(
        jnp.int32
    )
    h = jax.random.normal(k2, (n, DIM))
    h = h.at[:, 1].add(3.0 * task).at[:, 0].add(shift * labels)
    return h, task, labels


def test_cell_means_and_offsets():
    h, task, labels = _cells(jax.random.PRNGKey(0))
    state = objectives.update_cell_means(
        objectives.init_cell_means(2, 2, DIM), h, task, labels, decay=0.0
    )
    offsets = objectives.cell_offsets(state)
    hn, tn, ln = np.asarray(h), np.asarray(task), np.asarray(labels)
    for t in range(2):
        mean_t = hn[tn == t].mean(0)
        for a in range(2):
            cell = hn[(tn == t) & (ln == a)].mean(0)
            np.testing.assert_allclose(offsets[t, a], cell - mean_t, atol=1e-5)
    # A cell absent from a batch keeps its estimate; a present one decays.
    h2, task2, labels2 = _cells(jax.random.PRNGKey(5))
    only = task2 == 0
    again = objectives.update_cell_means(
        state, h2[only], task2[only], labels2[only], decay=0.5
    )
    np.testing.assert_allclose(again["sum"][1], state["sum"][1])
    np.testing.assert_allclose(again["weight"][1], state["weight"][1])
    assert not np.allclose(again["sum"][0], state["sum"][0])
    fresh = objectives.cell_offsets(objectives.init_cell_means(2, 2, DIM))
    assert not np.any(np.asarray(fresh))  # nothing seen: no shift


def test_shifted_target_loss_is_zero_at_the_target_and_pulls_towards_it():
    h, task, labels = _cells(jax.random.PRNGKey(1))
    state = objectives.update_cell_means(
        objectives.init_cell_means(2, 2, DIM), h, task, labels, decay=0.0
    )
    offsets = objectives.cell_offsets(state)
    target = h - offsets[task, labels]

    def loss(x):
        return objectives.erased_target_loss(
            x, h, task, labels, state, white=jnp.eye(DIM), mode="shift"
        )

    assert float(loss(target)) == pytest.approx(0.0, abs=1e-10)
    expected = np.mean(np.sum(np.asarray(offsets[task, labels]) ** 2, -1)) / DIM
    assert float(loss(h)) == pytest.approx(expected, rel=1e-5)
    # The gradient at the anchor points from the target to the anchor.
    grad = jax.grad(loss)(h)
    np.testing.assert_allclose(grad, 2.0 * (h - target) / (h.shape[0] * DIM), rtol=1e-4)


def test_projected_target_takes_the_offset_directions_out_in_the_whitened_metric():
    h, task, labels = _cells(jax.random.PRNGKey(4))
    state = objectives.update_cell_means(
        objectives.init_cell_means(2, 2, DIM), h, task, labels, decay=0.0
    )
    white = jnp.diag(jnp.linspace(0.5, 2.0, DIM))
    # A binary attribute: one direction, the mean over value 1's members of
    # their cell's within-class offset, whitened.
    ones = np.asarray(labels) == 1
    pooled = np.asarray(objectives.cell_offsets(state))[np.asarray(task)[ones], 1]
    pooled = pooled.mean(0)
    unit = pooled @ np.asarray(white)
    unit /= np.linalg.norm(unit)
    centre = np.asarray(h).mean(0)
    z = (np.asarray(h) - centre) @ np.asarray(white)
    along = (z @ unit)[:, None]
    target_white = z - along * unit  # whitened, about the overall mean
    target = target_white @ np.linalg.inv(np.asarray(white)) + centre

    def loss(x):
        return objectives.erased_target_loss(x, h, task, labels, state, white=white)

    assert float(loss(jnp.asarray(target, jnp.float32))) == pytest.approx(0.0, abs=1e-9)
    # At the anchor: the within-class variance along the offset directions.
    expected = np.mean(along**2) / DIM
    assert float(loss(h)) == pytest.approx(expected, rel=1e-4)
    with pytest.raises(ValueError, match="not one of"):
        objectives.erased_target_loss(h, h, task, labels, state, white=white, mode="x")


def test_erased_targets_remove_what_a_linear_probe_reads_and_keep_the_task():
    """An affine map trained on the projected targets (representation
    ``x + x M + b``) leaves a fresh probe of the attribute near what the
    task label implies, and the task direction where it was. (The attribute
    is not a function of ``x`` here, so moving each row by its own cell's
    offset, ``mode="shift"``, is out of an affine map's reach: the
    least-squares fit only shrinks coordinate 0, which a probe of the
    standardized representation still reads.)"""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import balanced_accuracy_score

    def moved(p, x):
        return x + x @ p["m"] + p["b"]

    def probe(p, train, test):
        fit = LogisticRegression(class_weight="balanced", max_iter=2000)
        fit.fit(np.asarray(moved(p, train[0])), np.asarray(train[2]))
        pred = fit.predict(np.asarray(moved(p, test[0])))
        return balanced_accuracy_score(np.asarray(test[2]), pred)

    train_set = _cells(jax.random.PRNGKey(2), n=2000)
    test_set = _cells(jax.random.PRNGKey(3), n=2000)
    floor = balanced_accuracy_score(np.asarray(test_set[2]), np.asarray(test_set[1]))
    state = objectives.init_cell_means(2, 2, DIM)
    start_p = {"m": jnp.zeros((DIM, DIM)), "b": jnp.zeros(DIM)}
    p = start_p
    opt = optax.adam(1e-2)
    opt_state = opt.init(p)

    @jax.jit  # one program for the 300 steps (op by op: tens of seconds)
    def step(p, opt_state, state, x, task, labels):
        state = objectives.update_cell_means(state, x, task, labels, decay=0.9)

        def loss(p_):
            return objectives.erased_target_loss(
                moved(p_, x), x, task, labels, state, white=jnp.eye(DIM)
            )

        updates, opt_state = opt.update(jax.grad(loss)(p), opt_state)
        return optax.apply_updates(p, updates), opt_state, state

    for i in range(300):
        start = (i * 32) % 2000
        batch = (a[start : start + 32] for a in train_set)
        p, opt_state, state = step(p, opt_state, state, *batch)
    before = probe(start_p, train_set, test_set)
    after = probe(p, train_set, test_set)
    assert before > floor + 0.1, (before, floor)
    assert after - floor < 0.25 * (before - floor), (before, after, floor)
    # The task (coordinate 1) is read as before.
    x, task = test_set[0], test_set[1]

    def task_gap(r):
        return float(jnp.mean(r[task == 1, 1]) - jnp.mean(r[task == 0, 1]))

    assert task_gap(moved(p, x)) == pytest.approx(task_gap(x), rel=0.15)
