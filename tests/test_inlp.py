"""Tests for moddiffy_jax.eval.inlp."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax.eval import inlp, probes

H = 12


def _directions(rng, attr_classes):
    """Orthonormal attribute directions [H, C] and a task direction [H]
    orthogonal to all of them."""
    q, _ = np.linalg.qr(rng.normal(size=(H, H)))
    return q[:, :attr_classes], q[:, -1]


def _sample(n, rng, dirs):
    """Attribute ``z`` shifts the mean along ``attr_dirs[:, z]``; task ``y``
    along ``+-task_dir``; isotropic unit noise."""
    attr_dirs, task_dir = dirs
    z = rng.integers(0, attr_dirs.shape[1], n)
    y = rng.integers(0, 2, n)
    x = rng.normal(size=(n, H))
    x += 2.5 * attr_dirs[:, z].T + 2.5 * np.outer(2 * y - 1, task_dir)
    return x.astype(np.float32), z, y


@pytest.fixture(scope="module")
def binary_case():
    rng = np.random.default_rng(0)
    dirs = _directions(rng, 2)
    tr, dv, te = (_sample(n, rng, dirs) for n in (800, 400, 400))
    result = inlp.fit_inlp(tr[0], tr[1], dv[0], dv[1], num_classes=2)
    return tr, dv, te, dirs[0], result


def test_nullspace_projection_properties():
    rng = np.random.default_rng(0)
    d = rng.normal(size=(H, 3))
    d = np.concatenate([d, d[:, :1] * 2.0], axis=1)  # dependent column
    p, q = inlp.nullspace_projection(d, dim=H)
    assert q.shape == (H, 3)
    np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-10)
    np.testing.assert_allclose(p, p.T, atol=1e-12)
    np.testing.assert_allclose(p @ p, p, atol=1e-10)
    np.testing.assert_allclose(p @ d, 0.0, atol=1e-10)
    assert np.trace(p) == pytest.approx(H - 3)
    p0, q0 = inlp.nullspace_projection(np.zeros((H, 0)), dim=H)
    np.testing.assert_array_equal(p0, np.eye(H))
    assert q0.shape == (H, 0)


def test_inlp_removes_attribute_keeps_task(binary_case):
    (xtr, ztr, ytr), (xdv, zdv, ydv), (xte, zte, yte), a, result = binary_case
    p = result.projection
    before = probes.linear_probe(xtr, ztr, xdv, zdv, xte, zte, num_classes=2)
    assert before.test_balanced_accuracy > 0.9

    ptr, pdv, pte = (inlp.apply_projection(x, p) for x in (xtr, xdv, xte))
    attr = probes.linear_probe(ptr, ztr, pdv, zdv, pte, zte, num_classes=2)
    task = probes.linear_probe(ptr, ytr, pdv, ydv, pte, yte, num_classes=2)
    assert attr.test_balanced_accuracy < 0.6
    assert task.test_balanced_accuracy > 0.95

    # The removed span covers the attribute's mean difference and P projects.
    diff = a[:, 1] - a[:, 0]
    assert np.linalg.norm(p @ diff) < 0.2 * np.linalg.norm(diff)
    np.testing.assert_allclose(p @ p, p, atol=1e-5)
    r = result.directions.shape[1]
    assert 1 <= r == result.num_removed <= 10
    np.testing.assert_allclose(
        result.directions.T @ result.directions, np.eye(r), atol=1e-5
    )
    # It stopped early: the last classifier was at the majority rate.
    assert len(result.dev_accuracy) == r + 1
    assert result.dev_accuracy[-1] <= result.majority_rate + 0.01
    assert result.dev_accuracy[0] > 0.9


def test_inlp_multiclass_and_fixed_iterations():
    rng = np.random.default_rng(2)
    dirs, _ = d = _directions(rng, 3)
    x, z, _ = _sample(900, rng, d)
    result = inlp.fit_inlp(
        x[:600],
        z[:600],
        x[600:],
        z[600:],
        num_classes=3,
        n_iterations=2,
        stop_margin=None,
    )
    # C - 1 = 2 directions per iteration, never more than asked for.
    assert result.directions.shape == (H, 4)
    assert len(result.dev_accuracy) == 2
    centered = dirs - dirs.mean(axis=1, keepdims=True)
    assert np.linalg.norm(result.projection @ centered) < 0.2 * np.linalg.norm(centered)


def test_apply_projection_jax_and_errors(binary_case):
    *_, result = binary_case
    h = jnp.ones((3, H), jnp.float32)
    out = inlp.apply_projection(h, result.projection)
    assert isinstance(out, jnp.ndarray) and out.shape == (3, H)
    np.testing.assert_allclose(
        np.asarray(out), np.ones((3, H)) @ result.projection, rtol=1e-5
    )
    with pytest.raises(ValueError, match="single class"):
        inlp.fit_inlp(
            np.ones((4, H)),
            np.zeros(4, int),
            np.ones((4, H)),
            np.zeros(4, int),
            num_classes=2,
        )
