"""The exact top-k threshold of magnitude pruning (sparse_diff._topk_threshold)."""

import numpy as np
import pytest

from moddiffy_jax.subnets import sparse_diff


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ties", [0.0, 0.5, 0.95])
def test_topk_threshold_is_the_kth_largest_eligible_value(dtype, ties):
    rng = np.random.default_rng(0)
    n = 20_000
    m = np.abs(rng.normal(size=n)).astype(dtype)
    m[rng.random(n) < ties] = dtype(0.25)  # many equal entries
    m[rng.random(n) < 0.3] = dtype(-1)  # ineligible
    m[:5] = dtype(0.0)
    eligible = np.sort(m[m >= 0])[::-1]
    for k in (1, 2, 17, eligible.size // 2, eligible.size - 1, eligible.size):
        got = sparse_diff._topk_threshold(m.copy(), k)
        assert got == eligible[k - 1] and np.asarray(got).dtype == dtype


def test_topk_threshold_refuses_k_beyond_the_eligible_entries():
    m = np.array([0.5, -1.0, 0.2], np.float32)
    with pytest.raises(ValueError, match="eligible"):
        sparse_diff._topk_threshold(m, 3)
