"""Per-example diff routing: each row of a mixed batch equals the forward of
the model composed for that row alone, with no recompile when the mix
changes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax import routing
from moddiffy_jax.models import bert
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets.selection import flatten


def _diff(params, seed, keep=0.05):
    """A random sparse diff over every leaf kind of the encoder (kernels,
    biases, LayerNorms, the three embedding tables), per-leaf budget."""
    rng = np.random.default_rng(seed)
    dense = jax.tree.map(
        lambda x: rng.normal(scale=0.5, size=x.shape).astype(np.float32), params
    )
    return diffs_lib.prune_to_sparsity(dense, keep=keep, scope="per_leaf")


@pytest.fixture(scope="module")
def setup():
    config = bert.BertConfig.tiny(vocab_size=97)
    params = bert.init_params(config, jax.random.key(0, impl="rbg"))
    diffs = [_diff(params, 1), _diff(params, 2)]
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 97, size=(5, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[2, 6:] = 0
    types = np.zeros_like(ids)
    types[:, 5:] = 1
    batch = {"input_ids": ids * mask, "attention_mask": mask, "token_type_ids": types}
    return config, params, diffs, batch


def test_every_leaf_kind_is_covered(setup):
    _, params, diffs, _ = setup
    paths = {p for p, _ in diffs[0].shapes}
    assert paths == set(flatten(params))
    assert any(p.endswith("embedding") for p in paths)
    assert any("LayerNorm/scale" in p for p in paths)
    routed = routing.RoutedDiffs.build(params, diffs)
    assert routed.num_diffs == 2 and routed.kernels and routed.tables


@pytest.mark.parametrize("kernels", ["sparse", "dense"])
def test_mixed_batch_equals_per_row_forwards(setup, kernels):
    config, params, diffs, batch = setup
    weights = np.asarray(
        [[1, 0], [0, 1], [0, 0], [1, 1], [0.5, -1.0]], np.float32
    )  # gender, age, core, both, a weighted mix
    routed = routing.RoutedDiffs.build(params, diffs, kernels=kernels)
    calls = []

    @jax.jit
    def routed_forward(r, w, b):
        calls.append(1)  # counts traces
        return routing.encode(config, params, r, w, b)

    got = routed_forward(routed, weights, batch)
    compose = jax.jit(diffs_lib.apply_diffs)
    single = jax.jit(lambda p, b: bert.encode(config, p, b))
    for row, w in enumerate(weights):
        composed = compose(params, diffs, jnp.asarray(w))
        one = {k: v[row : row + 1] for k, v in batch.items()}
        want = single(composed, one)
        real = batch["attention_mask"][row].astype(bool)
        np.testing.assert_allclose(
            np.asarray(got.last_hidden_state[row])[real],
            np.asarray(want.last_hidden_state[0])[real],
            atol=2e-5,
        )
        np.testing.assert_allclose(
            got.pooler_output[row], want.pooler_output[0], atol=2e-5
        )
    # The diffs matter (rows differ from the core's) ...
    core = single(params, batch)
    assert float(jnp.abs(got.pooler_output[0] - core.pooler_output[0]).max()) > 1e-2
    np.testing.assert_allclose(got.pooler_output[2], core.pooler_output[2], atol=2e-5)
    # ... and another mix, or other diffs of the same sizes, reuse the program.
    routed_forward(routed, weights[::-1].copy(), batch)
    other = routing.RoutedDiffs.build(
        params, [_diff(params, 3), _diff(params, 4)], kernels=kernels
    )
    routed_forward(other, weights, batch)
    assert len(calls) == 1


def test_bad_weights_are_named(setup):
    config, params, diffs, batch = setup
    routed = routing.RoutedDiffs.build(params, diffs)
    with pytest.raises(ValueError, match=r"weights must be \[B, 2\]"):
        routing.encode(config, params, routed, np.ones((5, 3)), batch)
    with pytest.raises(ValueError, match="4 rows for a batch of 5"):
        routing.encode(config, params, routed, np.ones((4, 2)), batch)


def test_leaves_it_cannot_route_are_named():
    base = {"conv": {"kernel": np.ones((3, 3, 4), np.float32)}}
    diff = diffs_lib.prune_to_sparsity(base, keep=2)
    with pytest.raises(ValueError, match=r"conv/kernel \(3, 3, 4\): the routed"):
        routing.RoutedDiffs.build(base, [diff])
