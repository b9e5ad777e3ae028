"""The discriminant written into a sparse diff (eval/discriminant_diff.py)."""

import numpy as np
import pytest

from moddiffy_jax.eval import discriminant, discriminant_diff
from moddiffy_jax.methods.erasure_refit import normalised
from moddiffy_jax.subnets.selection import flatten

EPS = 1e-12


def test_solve_pre_layernorm_gives_the_target():
    rng = np.random.default_rng(0)
    y = rng.normal(size=(40, 24)) * 3 + 1
    coords = np.array([3, 11])
    target = rng.normal(size=(40, 2))
    u = discriminant_diff.solve_pre_layernorm(y, coords, target, EPS)
    full = y.copy()
    full[:, coords] = u
    n, _ = normalised(full, EPS)
    np.testing.assert_allclose(n[:, coords], target, atol=1e-6)
    # The other coordinates were not touched.
    np.testing.assert_array_equal(np.delete(full, coords, 1), np.delete(y, coords, 1))
    with pytest.raises(ValueError, match="unit mean square"):
        discriminant_diff.solve_pre_layernorm(y, coords, target * 10, EPS)


def test_kept_coordinates_span_the_centred_kernel():
    kernel = np.zeros((6, 3))
    kernel[1] = [5.0, 5.0, 5.0]  # a shift of every logit: reads nothing
    kernel[2] = [1.0, -1.0, 0.0]
    kernel[3] = [0.5, -0.5, 0.0]  # parallel to row 2 once chosen
    kernel[4] = [0.0, 0.2, -0.2]
    assert discriminant_diff.kept_coordinates(kernel, 2).tolist() == [2, 4]
    with pytest.raises(ValueError, match="fewer than 2"):
        discriminant_diff.kept_coordinates(kernel[[1, 3]], 2)


def test_linear_head():
    rng = np.random.default_rng(1)
    w, b = rng.normal(size=(5, 3)), rng.normal(size=3)
    kernel, bias = discriminant_diff.linear_head(lambda h: h @ w + b, 5)
    np.testing.assert_allclose(kernel, w, atol=1e-6)
    np.testing.assert_allclose(bias, b, atol=1e-6)
    with pytest.raises(ValueError, match="task_hidden") as raised:
        discriminant_diff.linear_head(lambda h: np.tanh(h @ w) + b, 5)
    # The reason "auto" reports stands without the fix the error adds.
    assert "nodiscriminant_weights" in str(raised.value)
    assert "task_hidden" in raised.value.reason
    assert "Set " not in raised.value.reason


def one_layer(scale, ln_bias, inter):
    """The last layer's leaves the diff writes, of a one-layer encoder (its
    FFN output zero: the tests give the pre-LayerNorm vectors directly)."""
    width = len(scale)
    dense = {
        "kernel": np.zeros((inter, width), np.float32),
        "bias": np.zeros(width, np.float32),
    }
    layer = {"output": {"LayerNorm": {"scale": scale, "bias": ln_bias}, "dense": dense}}
    return {"encoder": {"layer_0": layer}}


def fit_three_classes(train, dev, reference, penalties=discriminant.PENALTIES):
    """The discriminant of attribute ``a`` on ``(h, task, attr)`` splits."""
    (htr, ttr, atr), (hdv, tdv, adv) = train, dev
    return discriminant.fit_discriminant(
        htr.astype(np.float32),
        ttr,
        hdv.astype(np.float32),
        tdv,
        {"a": atr},
        {"a": adv},
        num_classes=3,
        num_attr_classes={"a": 2},
        reference_dev_accuracy=reference,
        penalties=penalties,
    )


def _planted(n, rng, width=32):
    """Pre-LayerNorm vectors with a task (3 classes) and an attribute that
    shifts them inside each class along another direction."""
    task = rng.integers(0, 3, n)
    attr = (rng.random(n) < 0.3 + 0.4 * (task == 1)).astype(np.int32)
    means = rng.normal(size=(3, width)) * 2.0
    shift = rng.normal(size=width) * 1.5
    y = means[task] + attr[:, None] * shift + rng.normal(size=(n, width))
    return y, task, attr


def test_write_discriminant_gives_the_projection_through_the_core_head():
    """With activations that read the pre-LayerNorm vector linearly, the
    diff's CLS vectors make the core's head decide as the discriminant's
    head does; every coordinate but the kept ones is held."""
    rng = np.random.default_rng(2)
    width, classes = 32, 3
    y_tr, t_tr, a_tr = _planted(3000, rng, width)
    y_dv, t_dv, a_dv = _planted(1000, rng, width)
    scale = 1.0 + 0.2 * rng.normal(size=width)
    ln_bias = 0.1 * rng.normal(size=width)

    def cls(y):
        return normalised(y, EPS)[0] * scale + ln_bias

    head_w, head_b = rng.normal(size=(width, classes)), rng.normal(size=classes)
    h_tr, h_dv = cls(y_tr), cls(y_dv)
    fit = fit_three_classes((h_tr, t_tr, a_tr), (h_dv, t_dv, a_dv), 0.5)

    def activations(y):
        return np.concatenate([y, normalised(y, EPS)[1][:, None]], 1)

    inter = width + 1
    core = one_layer(scale, ln_bias, inter)
    written = discriminant_diff.write_discriminant(
        fit,
        core,
        h_tr.astype(np.float32),
        y_tr,
        activations(y_tr),
        head_kernel=head_w,
        head_bias=head_b,
        num_layers=1,
        layer_norm_eps=EPS,
        name="a",
        base_fingerprint="core",
    )
    sd = written.diff
    assert sd.name == "a" and sd.base_fingerprint == "core"
    assert sd.nnz() == written.record["entries"] <= 2 * width + 2 * (inter + 1)
    assert written.record["readout_r2"] > 0.99
    delta = flatten(sd.to_dense())
    paths = discriminant_diff.paths(1)
    y2 = (
        y_dv
        + activations(y_dv) @ np.asarray(delta[paths["kernel"]])
        + np.asarray(delta[paths["out_bias"]])
    )
    h2 = normalised(y2, EPS)[0] * (scale + np.asarray(delta[paths["scale"]])) + (
        ln_bias + np.asarray(delta[paths["bias"]])
    )
    rest = np.setdiff1d(np.arange(width), written.coordinates)
    np.testing.assert_allclose(
        h2[:, rest],
        np.broadcast_to(h_tr.mean(0)[rest], (len(h2), len(rest))),
        atol=1e-6,
    )
    ours = np.argmax(h2 @ head_w + head_b, -1)
    theirs = fit.predict(fit.apply(h_dv.astype(np.float32)))
    assert np.mean(ours == theirs) >= 0.97


def test_a_model_without_a_bert_encoder_falls_back_with_a_reason():
    class Vision:
        pass

    class Ctx:
        model = Vision()

    writer, why = discriminant_diff.writer_or_reason(Ctx(), None, None, None, {})
    assert writer is None and "BERT encoder's last layer" in why
    with pytest.raises(ValueError, match="weights='auto' or False"):
        discriminant_diff.Writer(Ctx(), None, None, None, {})


def test_a_discriminant_diff_is_not_added_beside_another():
    """It rewrites the last LayerNorm, so a sum with another diff is refused
    with the way out; alone it applies."""
    from moddiffy_jax.subnets import diffs as diffs_lib

    base = {"w": np.ones(4, np.float32)}
    alone = diffs_lib.SparseDiff.from_dense(
        {"w": np.array([0, -1, 0, 0], np.float32)},
        name="gender",
        info={"compose": "alone"},
    )
    other = diffs_lib.SparseDiff.from_dense(
        {"w": np.array([1, 0, 0, 0], np.float32)}, name="age"
    )
    np.testing.assert_array_equal(
        diffs_lib.apply_diffs(base, [alone])["w"], [1, 0, 1, 1]
    )
    np.testing.assert_array_equal(
        diffs_lib.apply_diffs(base, [other, other])["w"], [3, 1, 1, 1]
    )
    with pytest.raises(ValueError, match=r"\['gender'\] are not added to others"):
        diffs_lib.apply_diffs(base, [alone, other])


def test_an_outlying_train_row_widens_the_kept_scale_instead_of_failing():
    """A train row whose kept coordinates would need more than LayerNorm's
    unit mean square allows (40 class-mean distances out) is met by a
    larger scale, not an error; the others still decide as the projection."""
    rng = np.random.default_rng(3)
    width = 16
    y_tr, t_tr, a_tr = _planted(600, rng, width)
    y_tr[0] *= 40.0
    scale, ln_bias = np.ones(width), np.zeros(width)
    h_tr = normalised(y_tr, EPS)[0]
    between = h_tr[t_tr == 1].mean(0) - h_tr[t_tr == 0].mean(0)
    h_tr[0] = h_tr[1:].mean(0) + 40 * between
    fit = fit_three_classes((h_tr, t_tr, a_tr), (h_tr, t_tr, a_tr), 0.0, (0.0,))
    core = one_layer(scale, ln_bias, width)
    written = discriminant_diff.write_discriminant(
        fit,
        core,
        h_tr.astype(np.float32),
        y_tr,
        y_tr,
        head_kernel=rng.normal(size=(width, 3)),
        head_bias=np.zeros(3),
        num_layers=1,
        layer_norm_eps=EPS,
    )
    assert written.diff.nnz() > 0
