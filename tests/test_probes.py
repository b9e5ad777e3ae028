"""Tests for moddiffy_jax.eval.probes."""

from __future__ import annotations

import dataclasses
import math

import chex
import numpy as np
import pytest

from moddiffy_jax.eval import probes

H = 8
# Small and fast: 10 epochs of 8 batches, 3 members, 3 seeds.
CONFIG = probes.ProbeConfig(
    members=3,
    lr=3e-3,
    batch_size=32,
    max_epochs=10,
    patience=3,
    eval_batch_size=128,
    test_curves=True,
)


def _gaussian(n, rng, *, shift):
    """Binary labels; class means at ``+-shift`` on feature 0."""
    y = rng.integers(0, 2, n)
    x = rng.normal(size=(n, H)).astype(np.float32)
    x[:, 0] += shift * (2 * y - 1)
    return x, y


def _splits(shift, seed, sizes=(256, 256, 256)):
    rng = np.random.default_rng(seed)
    return [a for n in sizes for a in _gaussian(n, rng, shift=shift)]


@pytest.fixture(scope="module")
def separable():
    return probes.train_probe_ensemble(*_splits(2.5, 0), num_classes=2, config=CONFIG)


# ---------------------------------------------------------------------------
# Early-stopping selection.


def _reference_early_stopping(losses, patience):
    best, best_epoch, wait, stop = math.inf, 0, 0, len(losses) - 1
    for epoch, loss in enumerate(losses):
        if loss < best:
            best, best_epoch, wait = loss, epoch, 0
        else:
            wait += 1
            if patience is not None and wait >= patience:
                stop = epoch
                break
    return best_epoch, stop


@pytest.mark.parametrize(
    "losses, patience, expected",
    [
        ([5, 4, 3, 2, 1], 2, (4, 4)),
        ([1, 2, 3, 4, 5], 2, (0, 2)),
        # Stops at epoch 5 before seeing the later, lower minimum.
        ([3, 2, 2.5, 2.1, 2.2, 2.3, 0.5, 0.1], 4, (1, 5)),
        ([3, 2, 2.5, 2.1, 2.2, 2.3, 0.5, 0.1], None, (7, 7)),
        # Ties do not improve; the first minimum is kept.
        ([2, 1, 1, 1, 1], 5, (1, 4)),
        ([2, 1, 1, 1], 2, (1, 3)),
    ],
)
def test_select_best_epoch_cases(losses, patience, expected):
    assert probes.select_best_epoch(losses, patience=patience) == expected
    assert _reference_early_stopping(losses, patience) == expected


def test_select_best_epoch_matches_reference_loop():
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 30))
        # A noisy decreasing-then-increasing curve, sometimes with ties.
        losses = np.round(
            (np.arange(n) - rng.integers(0, n)) ** 2 / 50 + rng.normal(size=n) * 0.3,
            1 if trial % 2 else 6,
        )
        patience = [None, 1, 2, 5][trial % 4]
        assert probes.select_best_epoch(
            losses, patience=patience
        ) == _reference_early_stopping(list(losses), patience), (losses, patience)


# ---------------------------------------------------------------------------
# The MLP-ensemble probe.


def test_probe_on_separable_data(separable):
    r = separable
    s, e, k = 3, CONFIG.max_epochs, CONFIG.members
    assert r.best_epoch.shape == (s,)
    assert r.history["dev_loss"].shape == (s, e, k)
    assert r.history["test_balanced_accuracy"].shape == (s, e)
    assert r.member_test_balanced_accuracy.shape == (s, k)
    assert np.all(r.test_balanced_accuracy > 0.9)
    assert np.all(r.best_member_test_balanced_accuracy > 0.9)
    assert r.notes == ()
    # The reported epoch is the early-stopping pick on the ensemble dev loss.
    for i in range(s):
        curve = r.history["dev_loss"][i].mean(-1)
        assert (r.best_epoch[i], r.stop_epoch[i]) == probes.select_best_epoch(
            curve, patience=CONFIG.patience
        )
        bi = r.best_epoch[i]
        assert r.test_balanced_accuracy[i] == r.history["test_balanced_accuracy"][i, bi]
        m = r.best_member[i]
        assert m == np.argmin(r.history["dev_loss"][i, bi])
        assert (
            r.best_member_test_balanced_accuracy[i]
            == (r.history["test_member_balanced_accuracy"][i, bi, m])
        )
    # Training reduces the loss.
    assert np.all(r.history["train_loss"][:, -1] < r.history["train_loss"][:, 0])


@pytest.mark.parametrize("patience", [None, 1, 3])
def test_reading_test_once_gives_the_per_epoch_result(patience):
    """Without test curves the program keeps each seed's members at the
    early-stopping epoch and reads the test split once: the same numbers."""
    data = _splits(0.0, 3)  # no signal: the dev loss soon stops improving
    config = dataclasses.replace(CONFIG, patience=patience)
    curves = probes.train_probe_ensemble(*data, num_classes=2, config=config)
    once = probes.train_probe_ensemble(
        *data, num_classes=2, config=dataclasses.replace(config, test_curves=False)
    )
    assert "test_loss" not in once.history and "test_loss" in curves.history
    for field in (
        "best_epoch",
        "stop_epoch",
        "best_member",
        "test_balanced_accuracy",
        "test_accuracy",
        "dev_balanced_accuracy",
        "member_test_balanced_accuracy",
        "best_member_test_balanced_accuracy",
    ):
        np.testing.assert_allclose(
            getattr(once, field), getattr(curves, field), rtol=1e-6, err_msg=field
        )
    for i, curve in enumerate(curves.history["dev_loss"].mean(-1)):
        assert (once.best_epoch[i], once.stop_epoch[i]) == probes.select_best_epoch(
            curve, patience=patience
        )
    if patience == 1:  # the case is not trivial: some seed stopped early
        assert np.any(once.stop_epoch < CONFIG.max_epochs - 1)


def test_seeds_differ_and_summary(separable):
    r = separable
    # Different init, dropout and shuffling per seed.
    curves = r.history["dev_loss"]
    assert not np.allclose(curves[0], curves[1])
    assert not np.allclose(curves[1], curves[2])
    summary = r.summary()
    vals = r.test_balanced_accuracy
    assert summary["test_balanced_accuracy/mean"] == pytest.approx(vals.mean())
    assert summary["test_balanced_accuracy/std"] == pytest.approx(vals.std(ddof=1))
    assert "best_member_test_balanced_accuracy/mean" in summary
    assert "best_epoch/std" in summary


def test_probe_on_noise_labels_is_near_chance():
    # Same shapes and config as `separable`: reuses its compiled program.
    r = probes.train_probe_ensemble(*_splits(0.0, 1), num_classes=2, config=CONFIG)
    assert abs(r.summary()["test_balanced_accuracy/mean"] - 0.5) < 0.08
    assert np.all(np.abs(r.test_balanced_accuracy - 0.5) < 0.12)


def test_one_program_for_all_seeds_and_members(monkeypatch):
    """Unique shapes force a fresh compile; the per-probe epoch function is
    traced once for all 3 seeds x 2 members, and not again for other seeds,
    patience or data of the same shapes. A seed's run does not depend on
    which other seeds share the program, or on its position."""
    traced = chex.assert_max_traces(probes._train_one_epoch, n=1)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)  # Runs at trace time only.
        return traced(*args, **kwargs)

    monkeypatch.setattr(probes, "_train_one_epoch", counted)
    config = dataclasses.replace(CONFIG, members=2, max_epochs=3, seeds=(0, 1, 2))
    sizes = (96, 40, 24)
    data = _splits(2.0, 2, sizes)
    first = probes.train_probe_ensemble(*data, num_classes=2, config=config)
    other = dataclasses.replace(config, seeds=(2, 7, 0), patience=None)
    second = probes.train_probe_ensemble(*data, num_classes=2, config=other)
    third = probes.train_probe_ensemble(
        *_splits(2.0, 3, sizes), num_classes=2, config=config
    )
    assert len(calls) == 1
    assert second.history["dev_loss"].shape == (3, 3, 2)
    assert second.stop_epoch.tolist() == [2, 2, 2]
    for a, b in ((0, 2), (2, 0)):
        np.testing.assert_allclose(
            first.history["dev_loss"][a], second.history["dev_loss"][b], rtol=1e-5
        )
    assert not np.allclose(first.history["dev_loss"], third.history["dev_loss"])


def test_multiclass_and_class_weighted():
    rng = np.random.default_rng(5)
    means = 3.0 * np.eye(3, H)

    def split(n):
        y = rng.choice(3, n, p=[0.6, 0.3, 0.1])
        return (rng.normal(size=(n, H)) + means[y]).astype(np.float32), y

    config = dataclasses.replace(CONFIG, class_weighted=True, seeds=(0,), max_epochs=5)
    r = probes.train_probe_ensemble(
        *split(200), *split(100), *split(100), num_classes=3, config=config
    )
    assert r.test_balanced_accuracy[0] > 0.8
    assert math.isnan(r.summary()["test_balanced_accuracy/std"])  # one seed


def test_single_class_handling():
    data = _splits(2.0, 6)
    one = np.zeros(256, np.int64)
    with pytest.raises(ValueError, match="single class"):
        probes.train_probe_ensemble(
            data[0], one, *data[2:], num_classes=2, config=CONFIG
        )
    with pytest.raises(ValueError, match="single class"):
        probes.linear_probe(data[0], one, *data[2:], num_classes=2)
    # A single-class test split: NaN and a note, never a number.
    r = probes.linear_probe(*data[:4], data[4], np.ones(256, np.int64), num_classes=2)
    assert math.isnan(r.test_balanced_accuracy)
    assert not math.isnan(r.dev_balanced_accuracy)
    assert any("test" in note for note in r.notes)
    with pytest.raises(ValueError, match="outside"):
        probes.linear_probe(*data[:4], data[4], np.full(256, 2), num_classes=2)
    with pytest.raises(ValueError, match="empty"):
        probes.linear_probe(*data[:4], data[4][:0], data[5][:0], num_classes=2)


# ---------------------------------------------------------------------------
# Linear probe.


def test_linear_probe():
    separable = probes.linear_probe(*_splits(2.5, 7), num_classes=2)
    assert separable.converged and separable.notes == ()
    assert separable.test_balanced_accuracy > 0.95
    assert separable.kernel.shape == (H, 2) and separable.bias.shape == (2,)
    # The informative feature dominates the learned direction.
    direction = separable.kernel[:, 1] - separable.kernel[:, 0]
    assert np.argmax(np.abs(direction)) == 0
    noise = probes.linear_probe(*_splits(0.0, 8), num_classes=2)
    assert abs(noise.test_balanced_accuracy - 0.5) < 0.1


def test_logistic_regression_reaches_the_optimum():
    x, y, *_ = _splits(1.0, 9)
    l2 = 1e-2
    kernel, bias, steps, converged = probes.fit_logistic_regression(
        x, y, num_classes=2, l2=l2
    )
    assert converged and steps < 500
    # Stationarity of mean CE + l2/2 |W|^2, by hand in float64.
    logits = x.astype(np.float64) @ kernel + bias
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    resid = (prob - np.eye(2)[y]) / len(y)
    np.testing.assert_allclose(x.T @ resid + l2 * kernel, 0.0, atol=1e-4)
    np.testing.assert_allclose(resid.sum(0), 0.0, atol=1e-4)


def test_probes_do_not_read_a_shrunk_representation_as_removal():
    """Shrinking the representation 100-fold leaves both probes' leakage
    where it was (standardized inputs); read raw, the L2 penalty then wipes
    out the linear probe. The linear probe's kernel and bias stay in the raw
    coordinates."""
    data = _splits(0.6, 11)
    shrunk = [x * 0.01 if x.ndim == 2 else x for x in data]
    full = probes.linear_probe(*data, num_classes=2, l2=0.1)
    small = probes.linear_probe(*shrunk, num_classes=2, l2=0.1)
    assert full.test_balanced_accuracy > 0.65
    assert small.test_balanced_accuracy == pytest.approx(
        full.test_balanced_accuracy, abs=0.01
    )
    raw = probes.linear_probe(*shrunk, num_classes=2, l2=0.1, standardize=False)
    assert raw.test_balanced_accuracy < full.test_balanced_accuracy - 0.05
    test_h, test_y = shrunk[4], shrunk[5]
    pred = np.argmax(test_h @ small.kernel + small.bias, -1)
    assert np.mean(pred == test_y) == pytest.approx(small.test_accuracy)
    ensemble = [
        probes.train_probe_ensemble(*d, num_classes=2, config=CONFIG)
        for d in (data, shrunk)
    ]
    np.testing.assert_allclose(
        ensemble[1].test_balanced_accuracy,
        ensemble[0].test_balanced_accuracy,
        atol=0.02,
    )


def _hidden(n, rng, *, width=16, signal=0.05):
    """The attribute on a direction spread over every feature that holds
    almost no variance: ``signal`` * (2y - 1) plus a quarter of it as noise;
    every other direction holds unit variance."""
    y = rng.integers(0, 2, n)
    u = np.ones(width) / math.sqrt(width)
    x = rng.normal(size=(n, width))
    x -= np.outer(x @ u, u)
    x += np.outer(signal * (2 * y - 1) + 0.25 * signal * rng.normal(size=n), u)
    return x.astype(np.float32), y


def test_the_whitened_attacker_reads_an_attribute_hidden_in_a_small_direction():
    """Per-feature standardization leaves such a direction small, and a probe
    trained by gradient steps with weight decay misses it in the same
    steps; in the train split's own metric it is plain."""
    rng = np.random.default_rng(0)
    splits = [a for n in (512, 256, 256) for a in _hidden(n, rng)]
    config = probes.ProbeConfig(members=3, seeds=(0,), max_epochs=10, lr=3e-3)
    white = probes.train_probe_ensemble(*splits, num_classes=2, config=config)
    plain = probes.train_probe_ensemble(
        *splits, num_classes=2, config=dataclasses.replace(config, whiten=False)
    )
    assert white.summary()["test_balanced_accuracy/mean"] > 0.95
    assert plain.summary()["test_balanced_accuracy/mean"] < 0.65


def test_the_whitener_maps_train_to_unit_covariance():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 6)) @ rng.normal(size=(6, 6)) + 3.0
    mean, matrix = probes.probe_inputs.whitener(x, ridge=1e-9)
    cov = np.cov((x - mean) @ matrix, rowvar=False)
    np.testing.assert_allclose(cov, np.eye(6), atol=1e-3)
    with pytest.raises(ValueError, match="whiten_ridge must be > 0"):
        probes.ProbeConfig(whiten_ridge=0.0)


def test_max_dev_stops_early_on_a_fixed_subset_of_dev():
    data = _splits(1.0, 4)
    train_h, train_y, dev_h, dev_y, test_h, test_y = data
    sub_h, sub_y = probes.dev_subset(dev_h, dev_y, 100)
    assert sub_h.shape == (100, H) and sub_y.shape == (100,)
    again_h, _ = probes.dev_subset(dev_h, dev_y, 100)
    np.testing.assert_array_equal(sub_h, again_h)  # the same subset each call
    rows = [int(np.flatnonzero((dev_h == r).all(1))[0]) for r in sub_h]
    assert rows == sorted(rows) and len(set(rows)) == 100  # dev order, no repeats
    assert probes.dev_subset(dev_h, dev_y, 1000)[0] is dev_h  # nothing to cut
    config = dataclasses.replace(CONFIG, test_curves=False)
    capped = probes.train_probe_ensemble(
        *data, num_classes=2, config=dataclasses.replace(config, max_dev=100)
    )
    by_hand = probes.train_probe_ensemble(
        train_h, train_y, sub_h, sub_y, test_h, test_y, num_classes=2, config=config
    )
    np.testing.assert_array_equal(capped.best_epoch, by_hand.best_epoch)
    np.testing.assert_allclose(
        capped.test_balanced_accuracy, by_hand.test_balanced_accuracy
    )
    with pytest.raises(ValueError, match="max_dev"):
        probes.ProbeConfig(max_dev=0)


def test_a_rows_attributes_probed_on_threads_give_the_same_numbers():
    """A row's attributes' probes handed to worker threads (futures) give
    the entries trained one after the other, and a bad count is refused."""
    import concurrent.futures
    from types import SimpleNamespace

    from moddiffy_jax.eval import composition

    rng = np.random.default_rng(5)
    sizes = {"train": 96, "dev": 48, "test": 64}
    reps = {s: rng.normal(size=(n, H)).astype(np.float32) for s, n in sizes.items()}
    attrs = {
        s: {a: rng.integers(0, k, n) for a, k in (("g", 2), ("age", 3))}
        for s, n in sizes.items()
    }
    for s in sizes:  # a planted attribute and a weaker one
        reps[s][:, 0] += 4.0 * attrs[s]["g"]
        reps[s][:, 1] += 0.5 * attrs[s]["age"]
    ctx = SimpleNamespace(
        attributes=("g", "age"),
        data=SimpleNamespace(
            splits={s: SimpleNamespace(attrs=attrs[s]) for s in sizes},
            attr_classes={"g": ("a", "b"), "age": ("y", "m", "o")},
        ),
    )
    config = dataclasses.replace(
        CONFIG, members=2, max_epochs=8, lr=2e-2, test_curves=False
    )
    one = composition._leakage(ctx, reps, config, linear=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rows = {
            "row": {
                "leakage": composition._leakage(
                    ctx, reps, config, linear=True, pool=pool
                )
            }
        }
        composition._resolve_leakage(rows)
    two = rows["row"]["leakage"]
    assert list(two) == ["g", "age"]
    assert one == two
    assert one["g"]["mean"] > 0.8  # the probes did read the planted attribute
    with pytest.raises(ValueError, match="threads must be >= 1"):
        probes.ProbeConfig(threads=0)


def _spread(n, rng):
    """The attribute in a feature's spread, not its mean (what a linear
    eraser leaves behind): class 1's feature 0 has four times class 0's
    standard deviation, equal means."""
    y = rng.integers(0, 2, n)
    x = rng.normal(size=(n, H)).astype(np.float32)
    x[:, 0] *= np.where(y == 1, 4.0, 1.0)
    return x, y


def test_the_converged_mlp_reads_what_linear_probes_and_the_attacker_miss():
    """An attribute with no mean offset: the linear probe reads chance, the
    paper's early-stopped attacker little (its 40 epochs at lr 1e-4), and
    the converged MLP most of it (0.78; the Bayes rule |x0| > 1.72 gives
    0.79)."""
    rng = np.random.default_rng(0)
    splits = [a for n in (2000, 500, 2000) for a in _spread(n, rng)]
    lin = probes.linear_probe(*splits, num_classes=2, class_weighted=True)
    attacker = probes.train_probe_ensemble(
        *splits, num_classes=2, config=probes.ProbeConfig(seeds=(0,))
    )
    mlp = probes.converged_mlp_probe(*splits, num_classes=2)
    assert lin.test_balanced_accuracy < 0.56
    assert attacker.summary()["test_balanced_accuracy/mean"] < 0.68
    assert mlp["test_balanced_accuracy"] > 0.74
    assert set(mlp) == {"test_balanced_accuracy", "dev_balanced_accuracy", "best_epoch"}


@pytest.mark.parametrize("dev_classes", [2, 1])
def test_the_converged_mlp_read_once_is_the_curves_best_dev_epoch(dev_classes):
    """The converged MLP keeps the epoch of its best dev balanced accuracy
    inside the program and reads test once (stop 63): the epoch and the
    numbers are those the per-epoch curves give (the first best epoch; the
    last when dev's balanced accuracy is undefined, one class in dev)."""
    rng = np.random.default_rng(1)
    splits = [a for n in (600, 200, 400) for a in _spread(n, rng)]
    if dev_classes == 1:
        splits[3] = np.zeros_like(splits[3])
    config = dataclasses.replace(probes.CONVERGED_MLP, max_epochs=30)
    once = probes.converged_mlp_probe(*splits, num_classes=2, config=config)
    curves = probes.train_probe_ensemble(
        *splits, num_classes=2, config=dataclasses.replace(config, test_curves=True)
    )
    dev = curves.history["dev_balanced_accuracy"][0]
    test = curves.history["test_balanced_accuracy"][0]
    epoch = len(dev) - 1 if np.all(np.isnan(dev)) else int(np.nanargmax(dev))
    assert once["best_epoch"] == epoch
    if dev_classes == 2:
        assert 0 < epoch < len(dev) - 1  # not a trivial pick
        assert once["dev_balanced_accuracy"] == pytest.approx(dev[epoch], abs=1e-12)
    assert once["test_balanced_accuracy"] == pytest.approx(test[epoch], abs=1e-12)
    with pytest.raises(ValueError, match="select='dev_balanced_accuracy'"):
        loss_rule = dataclasses.replace(config, select="dev_loss")
        probes.converged_mlp_probe(*splits, num_classes=2, config=loss_rule)
    with pytest.raises(ValueError, match="select must be one of"):
        probes.ProbeConfig(select="dev_acc")


def test_constant_columns_get_scale_one_wherever_the_array_sits():
    # A diff that holds coordinates at their train mean (the task bottleneck,
    # the discriminant's diff) leaves exactly constant columns. Summed in
    # float32, their std came out 1e-7 to 4e-5 or 0 by the array's address,
    # and a converged MLP read dwmw17's bottleneck row at chance at one
    # address and at 0.845 at another (stop 76).
    from moddiffy_jax.eval.probe_inputs import standardizer

    rng = np.random.default_rng(0)
    n, d = 7474, 64
    values = np.empty((n, d), np.float32)
    values[:] = (rng.normal(size=d) * 0.3).astype(np.float32)
    values[:, 0] = rng.normal(size=n)
    results = []
    for offset in (0, 4, 8, 16, 32, 48):
        buf = np.zeros(n * d * 4 + 64, np.uint8)
        x = np.ndarray((n, d), np.float32, buffer=buf, offset=offset)
        x[:] = values
        mean, scale = standardizer(x)
        assert (scale[1:] == 1.0).all(), (offset, scale[1:][scale[1:] != 1.0][:4])
        np.testing.assert_array_equal(mean[1:], values[0, 1:])  # each column's value
        np.testing.assert_allclose(scale[0], values[:, 0].astype(np.float64).std())
        results.append((mean, scale))
    for mean, scale in results[1:]:
        np.testing.assert_array_equal(mean, results[0][0])
        np.testing.assert_array_equal(scale, results[0][1])
