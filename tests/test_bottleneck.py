"""The task-only reference rows: the core's decision and the task bottleneck."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax.eval import bottleneck, probes
from moddiffy_jax.models import bert


def planted(n, seed):
    """Synthetic representations [n, 12]: the task in coordinates 0-1, an
    attribute independent of the task written into coordinates 2-11 both
    in their means and in their spread (what a linear eraser would leave),
    and noise."""
    rng = np.random.default_rng(seed)
    task = rng.integers(0, 2, n)
    attr = rng.integers(0, 2, n)
    h = rng.normal(size=(n, 12)).astype(np.float32)
    h[:, 0] += 3.0 * (2 * task - 1)
    h[:, 1] += 1.5 * (2 * task - 1)
    h[:, 2:7] += 0.8 * (2 * attr[:, None] - 1)
    h[:, 7:] *= np.where(attr[:, None] == 1, 2.5, 0.4)
    return h, task, attr


def head_of(h, task):
    """A linear 'core head' fitted on all coordinates (as training would)."""
    from moddiffy_jax.eval import linear_probes

    kernel, bias, _, _ = linear_probes.fit_logistic_regression(
        h, task, num_classes=2, l2=1e-2
    )
    return lambda x: jnp.asarray(x) @ kernel + bias, kernel


@pytest.fixture(scope="module")
def data():
    splits = {
        s: planted(n, i)
        for i, (s, n) in enumerate([("train", 1500), ("dev", 600), ("test", 600)])
    }
    logits_of, kernel = head_of(*splits["train"][:2])
    return splits, logits_of, kernel


def fit_on(data, **kwargs):
    """The bottleneck of the planted data's train and dev splits."""
    splits, logits_of, _ = data
    (htr, ttr, _), (hdv, tdv, _) = splits["train"], splits["dev"]
    kwargs.setdefault("reference_dev_accuracy", 0.9)
    return bottleneck.fit_bottleneck(
        logits_of, htr, ttr, hdv, tdv, num_classes=2, **kwargs
    )


def test_coordinate_order_is_the_heads_reading(data):
    splits, logits_of, kernel = data
    h = splits["train"][0]
    order = bottleneck.coordinate_order(logits_of, h)
    expected = np.argsort(-np.linalg.norm(kernel, axis=1) * h.std(0), kind="stable")
    np.testing.assert_array_equal(order, expected)
    assert set(order[:2]) == {0, 1}


def test_bottleneck_keeps_the_task_and_removes_a_planted_attribute(data):
    splits, logits_of, _ = data
    (htr, ttr, atr), (hdv, tdv, adv), (hte, tte, ate) = (
        splits[s] for s in ("train", "dev", "test")
    )
    core_dev = float(np.mean(np.argmax(logits_of(hdv), -1) == tdv))
    fit = fit_on(data, reference_dev_accuracy=core_dev, max_drop=1.0)
    assert fit.k <= 2 and set(fit.coordinates) <= {0, 1}
    assert fit.dev_accuracy >= core_dev - 0.01
    assert [c["k"] for c in fit.curve] == [1, 2, 4, 8, 12][: len(fit.curve)]
    core_test = np.mean(np.argmax(logits_of(hte), -1) == tte)
    assert np.mean(fit.predict(fit.apply(hte)) == tte) >= core_test - 0.02
    # Dropped coordinates are constant; the kept ones as they were.
    cut = fit.apply(hte)
    dropped = np.setdiff1d(np.arange(12), fit.coordinates)
    assert np.ptp(cut[:, dropped], axis=0).max() == 0.0
    np.testing.assert_array_equal(cut[:, fit.coordinates], hte[:, fit.coordinates])

    def mlp(h):
        return probes.converged_mlp_probe(
            h(htr), atr, h(hdv), adv, h(hte), ate, num_classes=2
        )["test_balanced_accuracy"]

    before, after = mlp(lambda x: x), mlp(fit.apply)
    assert before > 0.9, before
    assert after < 0.6, after  # chance 0.5; the attribute is independent of the task


def test_bottleneck_without_a_size_in_reach_takes_its_best(data):
    fit = fit_on(data, reference_dev_accuracy=1.5, sizes=[1, 2, 4])
    best = max(fit.curve, key=lambda c: c["dev_accuracy"])
    assert fit.dev_accuracy == best["dev_accuracy"] and len(fit.curve) == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_drop": 100.0}, "max_drop"),
        ({"max_drop": -0.1}, "max_drop"),
        ({"sizes": [4, 2]}, "sizes"),
        ({"sizes": [0, 2]}, "sizes"),
        ({"sizes": [2, 13]}, "sizes"),
    ],
)
def test_bad_settings_say_what_is_wrong(data, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit_on(data, **kwargs)


def test_representations_of_two_widths_are_refused(data):
    splits, logits_of, _ = data
    (htr, ttr, _), (hdv, tdv, _) = splits["train"], splits["dev"]
    with pytest.raises(ValueError, match="one width"):
        bottleneck.fit_bottleneck(
            logits_of,
            htr,
            ttr,
            hdv[:, :5],
            tdv,
            num_classes=2,
            reference_dev_accuracy=0.9,
        )


def test_the_bottleneck_is_a_last_layernorm_diff():
    """Adding layernorm_delta to the encoder's last LayerNorm gives, through
    the whole encoder, the CLS vectors that apply() gives."""
    config = bert.BertConfig.tiny(vocab_size=97)
    params = bert.init_params(config, jax.random.key(0, impl="rbg"))
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 97, size=(16, 10)).astype(np.int32)
    inputs = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "token_type_ids": np.zeros_like(ids),
    }
    encode = jax.jit(bert.encode, static_argnums=0)

    def cls(p):
        return np.asarray(encode(config, p, inputs).last_hidden_state[:, 0])

    h = cls(params)
    kept = np.array([3, 17, 20])
    fit = bottleneck.BottleneckFit(
        coordinates=kept,
        fill=h.mean(0),
        kernel=np.zeros((32, 2), np.float32),
        bias=np.zeros(2, np.float32),
        dev_accuracy=1.0,
        reference_dev_accuracy=1.0,
        curve=(),
    )
    last = f"layer_{config.num_hidden_layers - 1}"
    ln = params["encoder"][last]["output"]["LayerNorm"]
    delta = bottleneck.layernorm_delta(fit, ln["scale"], ln["bias"])
    assert np.count_nonzero(delta["scale"]) <= 32 - len(kept)
    edited = jax.tree_util.tree_map(lambda x: x, params)
    edited["encoder"][last]["output"]["LayerNorm"] = {
        "scale": ln["scale"] + delta["scale"],
        "bias": ln["bias"] + delta["bias"],
    }
    np.testing.assert_allclose(cls(edited), fit.apply(h), atol=1e-5)
    with pytest.raises(ValueError, match="width"):
        bottleneck.layernorm_delta(fit, ln["scale"][:4], ln["bias"])
    with pytest.raises(ValueError, match="width"):
        fit.apply(h[:, :4])


def test_decision_reps_are_the_heads_centred_logits(data):
    """The logits less their mean over classes: a shift shared by all the
    logits (no part of the decision) is left out."""
    splits, logits_of, _ = data
    reps = {s: splits[s][0] for s in splits}
    out = bottleneck.decision_reps(logits_of, reps)
    shifted = bottleneck.decision_reps(lambda h: logits_of(h) + h[:, 5:6] ** 2, reps)
    for s, h in reps.items():
        logits = np.asarray(logits_of(h))
        expected = logits - logits.mean(-1, keepdims=True)
        np.testing.assert_allclose(out[s], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(shifted[s], out[s], rtol=1e-5, atol=1e-5)
        assert out[s].shape == (len(h), 2)
