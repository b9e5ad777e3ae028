"""The MMD removal objective: unbiased, scale-invariant, task-conditional."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax import objectives


def _two_groups(rng, n_a, n_b, shift, dim=16):
    a = rng.normal(size=(n_a, dim))
    b = rng.normal(size=(n_b, dim)) + shift
    h = jnp.asarray(np.concatenate([a, b]), jnp.float32)
    labels = jnp.asarray([0] * n_a + [1] * n_b)
    return h, labels


@pytest.mark.parametrize("kernel", ["gaussian", "linear", "both"])
def test_same_distribution_is_near_zero_and_shift_is_not(kernel):
    rng = np.random.default_rng(0)
    mmd = jax.jit(
        jax.vmap(lambda h, y: objectives.mmd_loss(h, y, num_classes=2, kernel=kernel))
    )

    def batches(n, shift):
        hs, ys = zip(*(_two_groups(rng, 6, 26, shift) for _ in range(n)), strict=True)
        return np.asarray(mmd(jnp.stack(hs), jnp.stack(ys)))

    same, shifted = batches(200, 0.0), batches(50, 1.0)
    # Unbiased: the mean over batches of one distribution is ~0 (the biased
    # V-statistic sits near 0.45 here), with values of both signs.
    se = np.std(same) / np.sqrt(len(same))
    assert abs(np.mean(same)) < 4 * se + 1e-3
    assert min(same) < 0 < max(same)
    assert np.mean(shifted) > 10 * (abs(np.mean(same)) + 4 * se)


def test_unbiased_matches_hand_computed_u_statistic():
    k = jnp.asarray(np.random.default_rng(1).uniform(size=(5, 5)), jnp.float32)
    k = (k + k.T) / 2
    a = jnp.asarray([1.0, 1.0, 0.0, 0.0, 0.0])
    b = 1.0 - a
    value, valid = objectives.unbiased_mmd2(k, a, b)
    kn = np.asarray(k)
    expected = (
        (kn[0, 1] + kn[1, 0]) / 2
        + (kn[2, 3] + kn[3, 2] + kn[2, 4] + kn[4, 2] + kn[3, 4] + kn[4, 3]) / 6
        - 2 * kn[:2, 2:].mean()
    )
    assert bool(valid)
    np.testing.assert_allclose(float(value), expected, rtol=1e-5)
    # A group of one member has no within-group pair: not valid, value 0.
    value, valid = objectives.unbiased_mmd2(k, jnp.asarray([1.0, 0, 0, 0, 0]), b)
    assert not bool(valid) and float(value) == 0.0


@pytest.mark.parametrize("kernel", ["gaussian", "linear"])
def test_scale_invariant_so_collapse_does_not_pay(kernel):
    h, labels = _two_groups(np.random.default_rng(2), 8, 24, 0.7)
    value = objectives.mmd_loss(h, labels, num_classes=2, kernel=kernel)
    for scale in (1e-3, 10.0):
        scaled = objectives.mmd_loss(scale * h, labels, num_classes=2, kernel=kernel)
        np.testing.assert_allclose(float(scaled), float(value), rtol=1e-3)
    # The gradient has no component along h (shrinking or growing h).
    grad = jax.grad(
        lambda x: objectives.mmd_loss(x, labels, num_classes=2, kernel=kernel)
    )(h)
    radial = float(jnp.sum(grad * h)) / (
        float(jnp.linalg.norm(grad)) * float(jnp.linalg.norm(h))
    )
    assert abs(radial) < 1e-3


@pytest.mark.parametrize("mode", ["stratify", "reweight", "residual"])
def test_task_conditional_ignores_what_the_task_label_implies(mode):
    # The attribute follows the task, and within each task class the two
    # attribute groups have one distribution: the unconditional MMD sees the
    # task difference, the conditional one sees nothing.
    rng = np.random.default_rng(3)
    task = rng.integers(0, 2, 256)
    attr = np.where(rng.random(256) < 0.75, task, 1 - task)
    h = rng.normal(size=(256, 8)) + 3.0 * task[:, None]
    joint = np.zeros((2, 2))
    np.add.at(joint, (task, attr), 1.0)
    kw = {"task": jnp.asarray(task), "num_task_classes": 2}
    if mode in ("reweight", "residual"):
        kw["joint"] = jnp.asarray(joint / joint.sum(), jnp.float32)
    kw["center_task"] = mode == "residual"
    h, attr = jnp.asarray(h, jnp.float32), jnp.asarray(attr)
    uncond = objectives.mmd_loss(h, attr, num_classes=2)
    cond = objectives.mmd_loss(h, attr, num_classes=2, **kw)
    assert float(uncond) > 0.05
    assert abs(float(cond)) < 0.02
    # An attribute signal within the task classes is seen by both.
    h2 = h.at[:, 0].add(2.0 * attr)
    cond2 = objectives.mmd_loss(h2, attr, num_classes=2, **kw)
    assert float(cond2) > max(0.02, 3 * abs(float(cond)))


def test_multiclass_padding_and_errors():
    rng = np.random.default_rng(4)
    h = jnp.asarray(rng.normal(size=(30, 4)), jnp.float32)
    labels = jnp.asarray(np.arange(30) % 3)
    w = jnp.asarray([1.0] * 27 + [0.0] * 3)
    padded = objectives.mmd_loss(h, labels, num_classes=3, weights=w)
    trimmed = objectives.mmd_loss(h[:27], labels[:27], num_classes=3)
    np.testing.assert_allclose(float(padded), float(trimmed), rtol=1e-4)
    with pytest.raises(ValueError, match="Unknown MMD kernel"):
        objectives.mmd_loss(h, labels, num_classes=3, kernel="rbf")
    with pytest.raises(ValueError, match="num_task_classes"):
        objectives.mmd_loss(h, labels, num_classes=3, task=labels)


def _cells(rng, n, dim):
    task = rng.integers(0, 2, n)
    attr = rng.integers(0, 2, n)
    h = rng.normal(size=(n, dim)) + 3.0 * task[:, None] + 1.5 * attr[:, None]
    return h, attr, task


def test_within_group_scatter_matches_numpy():
    rng = np.random.default_rng(0)
    h, attr, task = _cells(rng, 40, 5)
    scatter, dof = objectives.within_group_scatter(
        jnp.asarray(h, jnp.float32),
        jnp.asarray(attr),
        num_classes=2,
        task=jnp.asarray(task),
        num_task_classes=2,
    )
    centred = h.copy()
    cells = {(t, a) for t, a in zip(task, attr, strict=True)}
    for t, a in cells:
        m = (task == t) & (attr == a)
        centred[m] -= h[m].mean(0)
    np.testing.assert_allclose(scatter, centred.T @ centred, rtol=1e-4, atol=1e-3)
    assert float(dof) == 40 - len(cells)


def test_running_covariance_converges_and_skips_tiny_batches():
    rng = np.random.default_rng(1)
    true = np.diag([4.0, 1.0, 0.25])
    stats = objectives.init_covariance(3)
    update = jax.jit(
        lambda s, h, y: objectives.update_covariance(s, h, y, num_classes=2, decay=0.9)
    )
    for _ in range(300):
        labels = rng.integers(0, 2, 32)
        h = rng.multivariate_normal(np.zeros(3), true, 32) + 5.0 * labels[:, None]
        stats = update(stats, jnp.asarray(h, jnp.float32), jnp.asarray(labels))
    estimate = np.asarray(stats["cov"]) / float(stats["weight"])
    # The group means (5 apart) are not variance: the estimate is the
    # within-group covariance.
    np.testing.assert_allclose(estimate, true, atol=0.35)
    # Two rows in two groups: no degrees of freedom, no change.
    same = update(stats, jnp.ones((2, 3)), jnp.asarray([0, 1]))
    np.testing.assert_array_equal(same["cov"], stats["cov"])
    np.testing.assert_array_equal(same["weight"], stats["weight"])


def test_whitening_gives_mahalanobis_distances_and_no_gradient_to_statistics():
    rng = np.random.default_rng(2)
    a = rng.normal(size=(4, 4))
    cov = a @ a.T + np.eye(4)
    stats = {"cov": jnp.asarray(0.5 * cov, jnp.float32), "weight": jnp.asarray(0.5)}
    h = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    white = objectives.whiten(h, stats, shrinkage=0.1)
    floor = 1e-3 * np.trace(cov) / 4 + 1e-9
    geo_mean = np.exp(np.mean(np.log(np.linalg.eigvalsh(cov + floor * np.eye(4)))))
    ridge = 0.1 * geo_mean + 1e-6
    inv = np.linalg.inv(cov + ridge * np.eye(4))
    diff = np.asarray(h[0] - h[1])
    np.testing.assert_allclose(
        float(jnp.sum((white[0] - white[1]) ** 2)), diff @ inv @ diff, rtol=1e-4
    )
    grads = jax.grad(lambda s: jnp.sum(objectives.whiten(h, s) ** 2))(stats)
    assert not np.any(np.asarray(grads["cov"])) and float(grads["weight"]) == 0.0
    # No statistics yet: the identity.
    empty = {"cov": jnp.zeros((4, 4)), "weight": jnp.zeros(())}
    np.testing.assert_array_equal(objectives.whiten(h, empty), h)


def test_young_statistics_keep_a_ridge_on_their_null_space():
    """One batch of 12 rows in 64 dimensions has a rank-10 scatter. Kish's
    count (10 rows after one step, about dof (1 + d) / (1 - d) at steady
    state) takes the ridge from the 10 eigenvalues seen, so the null space
    is scaled like a direction of a tenth of the typical variance; a ridge
    from all 64 (54 of them 0) would scale it up a hundredfold more."""
    rng = np.random.default_rng(6)
    dim, decay = 64, 0.9
    labels = jnp.asarray(np.arange(12) % 2)
    h = jnp.asarray(rng.normal(size=(12, dim)), jnp.float32)
    young = objectives.update_covariance(
        objectives.init_covariance(dim), h, labels, num_classes=2, decay=decay
    )
    np.testing.assert_allclose(float(objectives.effective_rows(young)), 10.0, rtol=1e-5)
    probe = jnp.asarray(rng.normal(size=(50, dim)), jnp.float32)
    seen = np.sort(
        np.linalg.eigvalsh(np.asarray(young["cov"]) / float(young["weight"]))
    )[-10:]
    white = objectives.whiten(probe, young, shrinkage=0.1)
    # At most 1 / (0.1 geometric mean of the seen eigenvalues) per unit.
    bound = np.sum(np.asarray(probe) ** 2, -1) / (0.1 * np.exp(np.mean(np.log(seen))))
    assert np.all(np.asarray(jnp.sum(white**2, -1)) <= bound * 1.001)
    bare = {"cov": young["cov"], "weight": young["weight"]}
    blown = objectives.whiten(probe, bare, shrinkage=0.1)
    assert float(jnp.mean(jnp.sum(blown**2, -1))) > 20 * float(
        jnp.mean(jnp.sum(white**2, -1))
    )
    for _ in range(300):
        young = objectives.update_covariance(
            young, h, labels, num_classes=2, decay=decay
        )
    np.testing.assert_allclose(
        float(objectives.effective_rows(young)),
        10.0 * (1 + decay) / (1 - decay),
        rtol=1e-3,
    )


@pytest.mark.parametrize("kernel", ["linear", "gaussian"])
def test_whitening_sees_a_difference_along_a_low_variance_direction(kernel):
    """Groups 0.6 apart along a direction of std 0.2, next to six directions
    of std 3 and one blown up to std 100: a linear probe separates them
    well, raw MMD is lost in its noise, whitened MMD sees them (the blown-up
    direction does not raise the ridge enough to hide them)."""
    rng = np.random.default_rng(3)
    n, dim = 256, 8
    labels = np.arange(n) % 2
    scales = np.array([100.0] + [3.0] * (dim - 2) + [0.2])
    h = rng.normal(size=(n, dim)) * scales
    h[:, -1] += 0.6 * labels
    h, labels = jnp.asarray(h, jnp.float32), jnp.asarray(labels)
    stats = objectives.update_covariance(
        objectives.init_covariance(dim),
        h,
        labels,
        num_classes=2,
    )
    raw = float(objectives.mmd_loss(h, labels, num_classes=2, kernel=kernel))
    white = objectives.whiten(h, stats, shrinkage=0.01)
    whitened = float(objectives.mmd_loss(white, labels, num_classes=2, kernel=kernel))
    assert whitened > 0.04 and whitened > 5 * abs(raw)


def test_residual_conditioning_is_not_noisy_where_task_classes_sit_far_apart():
    """Gender-like attribute (follows the task 90/10), no attribute signal,
    task classes 20 apart: a few heavily weighted minority members make the
    reweighted estimate swing with the task distance; centring each task
    class first removes that, with the same (zero) expectation."""
    rng = np.random.default_rng(4)

    def batch():
        task = rng.integers(0, 2, 32)
        attr = np.where(rng.random(32) < 0.9, task, 1 - task)
        h = rng.normal(size=(32, 8)) + 20.0 * task[:, None]
        return h, task, attr

    hs, tasks, attrs = (
        np.stack(x) for x in zip(*(batch() for _ in range(200)), strict=True)
    )
    joint = jnp.asarray([[0.45, 0.05], [0.05, 0.45]], jnp.float32)

    def values(center):
        f = jax.vmap(
            lambda h, t, a: objectives.mmd_loss(
                h,
                a,
                num_classes=2,
                task=t,
                num_task_classes=2,
                joint=joint,
                kernel="linear",
                center_task=center,
            )
        )
        return np.asarray(f(jnp.asarray(hs, jnp.float32), tasks, attrs))

    reweighted, residual = values(False), values(True)
    assert np.std(residual) < 0.3 * np.std(reweighted)
    assert abs(np.mean(residual)) < 4 * np.std(residual) / np.sqrt(200) + 1e-3


def test_whitened_linear_kernel_cannot_be_diluted_by_one_inflated_direction():
    """Inflating an irrelevant direction after the (lagging) statistics were
    taken leaves the whitened linear MMD's expectation where it was; divided
    by the batch's variance, the same inflation hides the shift."""
    rng = np.random.default_rng(5)
    labels = np.arange(64) % 2
    stats = {"cov": jnp.eye(6), "weight": jnp.ones(())}
    hs = rng.normal(size=(400, 64, 6))
    hs[:, :, 0] += 1.0 * labels
    inflated = hs.copy()
    inflated[:, :, 5] *= 30.0

    def mean_mmd(x, whitened):
        f = jax.vmap(
            lambda h: objectives.mmd_loss(
                objectives.whiten(h, stats),
                jnp.asarray(labels),
                num_classes=2,
                kernel="linear",
                whitened=whitened,
            )
        )
        v = np.asarray(f(jnp.asarray(x, jnp.float32)))
        return v.mean(), v.std() / np.sqrt(len(v))

    (base, se0), (infl, se1) = mean_mmd(hs, True), mean_mmd(inflated, True)
    assert abs(infl - base) < 4 * np.hypot(se0, se1)
    assert base > 10 * se0
    assert mean_mmd(inflated, False)[0] < 0.2 * mean_mmd(hs, False)[0]


@pytest.mark.parametrize("kernel", ["linear", "gaussian"])
def test_whitened_mmd_is_not_lowered_by_shrinking_the_representation(kernel):
    """A representation shrunk after the (lagging) statistics were taken has
    the same whitened MMD: collapsing is not removal (the age diff on MiniLM
    shrank its representation 24-fold under the fixed scale)."""
    rng = np.random.default_rng(6)
    labels = jnp.asarray(np.arange(64) % 2)
    h = rng.normal(size=(64, 16))
    h[:, 0] += 1.5 * np.asarray(labels)
    stats = {"cov": jnp.eye(16), "weight": jnp.ones(())}

    def value(x):
        white = objectives.whiten(jnp.asarray(x, jnp.float32), stats)
        return float(
            objectives.mmd_loss(
                white, labels, num_classes=2, kernel=kernel, whitened=True
            )
        )

    assert value(h) > 0.05
    np.testing.assert_allclose(value(0.05 * h), value(h), rtol=1e-3)


def test_the_scale_is_read_from_the_directions_the_statistics_have_seen():
    """A young covariance (one batch of 8 rows in 16 dimensions) has seen at
    most 8 directions: ``whiten(..., return_seen=True)`` marks those, and the
    kernels' scale comes from them, not from the null space's noise."""
    rng = np.random.default_rng(7)
    h = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    labels = jnp.asarray(np.arange(8) % 2)
    stats = objectives.update_covariance(
        objectives.init_covariance(16), h, labels, num_classes=2
    )
    white, seen = objectives.whiten(h, stats, return_seen=True)
    assert white.shape == h.shape and seen.shape == (16,)
    assert 1 <= float(seen.sum()) <= 8
    assert np.all(np.asarray(seen)[-int(seen.sum()) :] == 1)  # the top eigenvalues
    fresh = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    white_fresh = objectives.whiten(fresh, stats)
    value = objectives.mmd_loss(
        white_fresh, labels, num_classes=2, kernel="linear", whitened=True, seen=seen
    )
    assert np.isfinite(float(value))
