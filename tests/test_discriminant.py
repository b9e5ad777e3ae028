"""The attribute-penalized task discriminant (eval/discriminant.py)."""

import numpy as np
import pytest

from moddiffy_jax.eval import discriminant, probes, removal


def planted(n, seed):
    """Synthetic representations [n, 8] (an attribute independent of the
    task, floor 0.5): coordinate 0 carries the task; coordinate 1 carries
    the task too (so Fisher's discriminant leans on it) and the attribute
    inside each task class, in its mean and its spread; the rest is noise."""
    rng = np.random.default_rng(seed)
    task = rng.integers(0, 2, n)
    attr = rng.integers(0, 2, n)
    h = rng.normal(size=(n, 8))
    sign_t, sign_a = 2 * task - 1, 2 * attr - 1
    h[:, 0] += 1.5 * sign_t
    h[:, 1] = 2.0 * sign_t + 0.8 * sign_a + np.where(attr == 1, 1.0, 0.5) * h[:, 1]
    return h.astype(np.float32), task, attr


@pytest.fixture(scope="module")
def splits():
    return {
        s: planted(n, i)
        for i, (s, n) in enumerate([("train", 2000), ("dev", 800), ("test", 800)])
    }


def fit(splits, **kwargs):
    (htr, ttr, atr), (hdv, tdv, adv) = splits["train"], splits["dev"]
    kwargs.setdefault("reference_dev_accuracy", 0.9)
    kwargs.setdefault("num_attr_classes", {"a": 2})
    return discriminant.fit_discriminant(
        htr, ttr, hdv, tdv, {"a": atr}, {"a": adv}, num_classes=2, **kwargs
    )


def mlp_leakage(splits, transform):
    args = []
    for s in ("train", "dev", "test"):
        h, _, a = splits[s]
        args += [transform(h), a]
    return probes.converged_mlp_probe(*args, num_classes=2)["test_balanced_accuracy"]


def test_the_penalty_removes_what_fishers_discriminant_keeps(splits):
    """Fisher's direction (penalty 0) leans on coordinate 1 and leaks the
    attribute; the chosen penalty turns away from it: a converged MLP reads
    the attribute near chance (the floor: 0.5), the task is kept within
    max_drop on dev, and the core reads it clearly."""
    h, task, _ = splits["test"]
    chosen = fit(splits, max_drop=3.0, reference_dev_accuracy=0.0)
    fisher = fit(splits, penalties=(0.0,))
    assert chosen.penalty > 0
    assert fisher.penalty == 0
    core = mlp_leakage(splits, lambda x: x)
    plain = mlp_leakage(splits, fisher.apply)
    after = mlp_leakage(splits, chosen.apply)
    assert core > 0.75 and plain > 0.65
    assert after < 0.6 and after < plain - 0.08
    # The task stays: coordinate 0 alone gives about 0.93.
    assert np.mean(chosen.predict(chosen.apply(h)) == task) > 0.9
    leaks = {c["penalty"]: c["dev_leakage"]["a"] for c in chosen.candidates}
    assert leaks[chosen.penalty] < leaks[0.0]
    summary = chosen.summary()
    assert summary["kind"] == "discriminant" and summary["attributes"] == ["a"]
    assert summary["k"] == 1 and len(summary["candidates"]) == 6


def test_max_drop_holds_the_task(splits):
    """Held to the reference dev accuracy, a penalty that costs the task is
    not chosen where one within max_drop exists."""
    loose = fit(splits, reference_dev_accuracy=0.0)
    strict = fit(splits, reference_dev_accuracy=loose.candidates[0]["dev_accuracy"])
    ok = loose.candidates[0]["dev_accuracy"] - 0.005
    assert strict.dev_accuracy >= ok


def test_fishers_direction_without_penalty():
    """Penalty 0 is Fisher's discriminant: for two classes, W^-1 (m1 - m0)."""
    h, task, attr = planted(3000, 7)
    within, between, scatter = discriminant.scatter_matrices(h, task, {"a": attr})
    v = discriminant.discriminant_directions(
        within, between, scatter["a"], penalty=0.0, rank=1
    )[:, 0]
    ridge = 1e-3 * np.trace(within) / len(within) * np.eye(len(within))
    expected = np.linalg.solve(
        within + ridge, h[task == 1].mean(0) - h[task == 0].mean(0)
    )
    cosine = abs(v @ expected) / np.linalg.norm(v) / np.linalg.norm(expected)
    assert cosine == pytest.approx(1.0, abs=1e-6)


def test_attribute_scatter_is_zero_without_within_class_shifts():
    """Groups that share their task class's mean add nothing to A; a shift
    of d inside a class of share s adds s * d d' / 4 per group pair."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=(40, 3))
    h = np.concatenate([base, base])  # each attribute value: the same rows
    task = np.tile(np.repeat([0, 1], 20), 2)
    attr = np.repeat([0, 1], 40)
    _, _, scatter = discriminant.scatter_matrices(h, task, {"a": attr})
    np.testing.assert_allclose(scatter["a"], 0.0, atol=1e-12)
    shifted = h.copy()
    shifted[attr == 1, 2] += 2.0
    _, _, scatter = discriminant.scatter_matrices(shifted, task, {"a": attr})
    # Each group sits 1.0 from its class mean on coordinate 2: A = 1 there.
    np.testing.assert_allclose(scatter["a"][2, 2], 1.0, atol=1e-12)
    assert np.abs(scatter["a"][:2]).max() < 1e-12


def test_gaussian_leakage_reads_means_and_spreads():
    rng = np.random.default_rng(1)
    n = 2000
    task = rng.integers(0, 2, 2 * n)
    attr = rng.integers(0, 2, 2 * n)
    noise = rng.normal(size=(2 * n, 2))
    independent = noise + task[:, None]
    spread = noise * np.where(attr[:, None] == 1, 3.0, 0.5)  # equal means
    read = {}
    for name, h in (("independent", independent), ("spread", spread)):
        read[name] = discriminant.gaussian_leakage(
            h[:n], attr[:n], task[:n], h[n:], attr[n:], num_attr_classes=2
        )
    assert abs(read["independent"] - 0.5) < 0.05
    assert read["spread"] > 0.75


def test_several_attributes_at_once(splits):
    """Two attributes share one penalty sum; the floors are the task label's."""
    (htr, ttr, atr), (hdv, tdv, adv) = splits["train"], splits["dev"]
    other = (ttr + np.random.default_rng(3).integers(0, 2, len(ttr))) % 2
    other_dev = (tdv + np.random.default_rng(4).integers(0, 2, len(tdv))) % 2
    both = discriminant.fit_discriminant(
        htr,
        ttr,
        hdv,
        tdv,
        {"a": atr, "b": other},
        {"a": adv, "b": other_dev},
        num_classes=2,
        num_attr_classes={"a": 2, "b": 2},
        reference_dev_accuracy=0.0,
        max_drop=3.0,
    )
    assert both.attributes == ("a", "b")
    floor = removal.leakage_floor(
        ttr, other, tdv, other_dev, num_task_classes=2, num_attr_classes=2
    )
    assert both.candidates[0]["dev_floor"]["b"] == pytest.approx(floor)


def test_a_saved_discriminant_reads_back_and_names_its_core(splits, tmp_path):
    fitted = fit(splits, max_drop=3.0, reference_dev_accuracy=0.0)
    path = discriminant.save_discriminant(
        tmp_path / "d" / "a.safetensors", fitted, base_fingerprint="abc"
    )
    again = discriminant.load_discriminant(path, base_fingerprint="abc")
    h = splits["test"][0]
    np.testing.assert_array_equal(again.apply(h), fitted.apply(h))
    assert again.summary() == fitted.summary()
    with pytest.raises(ValueError, match="core 'abc', not of the given core 'xyz'"):
        discriminant.load_discriminant(path, base_fingerprint="xyz")
    from safetensors.numpy import save_file

    other = tmp_path / "other.safetensors"
    save_file({"x": np.zeros(2, np.float32)}, str(other))
    with pytest.raises(ValueError, match="not a discriminant file"):
        discriminant.load_discriminant(other)
    # Written again: replaced whole, nothing left beside it.
    discriminant.save_discriminant(path, fitted)
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.safetensors"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_drop": -1.0}, "max_drop is in points"),
        ({"rank": 2}, r"rank must lie in \[1, 1\]"),
        ({"penalties": (-1.0,)}, "penalties must be >= 0"),
        ({"num_attr_classes": {}}, "num_attr_classes lacks"),
    ],
)
def test_bad_settings_are_refused(splits, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fit(splits, **kwargs)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"dev_attrs": "other name"}, "same attributes"),
        ({"dev_h": "narrower"}, "differ in feature width"),
        ({"train_task": "shifted"}, r"train: labels outside \[0, 2\)"),
    ],
)
def test_bad_inputs_are_refused(splits, change, match):
    (htr, ttr, atr), (hdv, tdv, adv) = splits["train"], splits["dev"]
    dev_attrs = {"b": adv} if "dev_attrs" in change else {"a": adv}
    with pytest.raises(ValueError, match=match):
        discriminant.fit_discriminant(
            htr,
            ttr + 1 if "train_task" in change else ttr,
            hdv[:, :4] if "dev_h" in change else hdv,
            tdv,
            {"a": atr},
            dev_attrs,
            num_classes=2,
            num_attr_classes={"a": 2, "b": 2},
            reference_dev_accuracy=0.9,
        )


def test_a_fit_refuses_another_width(splits):
    htr = splits["train"][0]
    fitted = fit(splits, penalties=(0.0,))
    with pytest.raises(ValueError, match="fitted on width 8"):
        fitted.apply(htr[:, :5])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"weights": "yes"}, "True .*False .*'auto'"),
        ({"weights": True}, "pass core_params"),
        ({"weights": "auto"}, "pass core_params"),
    ],
)
def test_bad_weight_settings_are_refused(kwargs, match):
    """Checked before anything is read (the context is not touched)."""
    with pytest.raises(ValueError, match=match):
        discriminant.discriminant_reps(None, None, None, {}, **kwargs)


def test_sets_that_project_alike_share_one_diff_and_one_encoding(splits, monkeypatch):
    """With weights, a set whose fit projects as an earlier one's (here every
    set at penalty 0: Fisher's direction) reuses its diff and encoding."""
    from types import SimpleNamespace

    from moddiffy_jax.eval import discriminant_diff
    from moddiffy_jax.subnets import diffs as diffs_lib

    data = SimpleNamespace(
        splits={
            s: SimpleNamespace(task=t, attrs={"a": a, "b": a[::-1].copy()})
            for s, (_, t, a) in splits.items()
        },
        task_classes=("x", "y"),
        attr_classes={"a": (0, 1), "b": (0, 1)},
    )
    ctx = SimpleNamespace(data=data, attributes=("a", "b"))
    rep = SimpleNamespace(predict=lambda head, h: (h[:, 0] > 0).astype(int))
    encodings = []

    class Writer:
        def __init__(self, *args, **kwargs):
            pass

        def write(self, fit, name, fingerprint):
            diff = diffs_lib.SparseDiff.from_dense(
                {"w": np.ones(2, np.float32)}, name=name
            )
            return discriminant_diff.Written(diff, np.array([0]), {"entries": 2})

        def represent(self, diff):
            encodings.append(diff.name)
            return {s: h for s, (h, _, _) in splits.items()}

        def predict(self, h):
            return np.zeros(len(h), int)

    monkeypatch.setattr(discriminant_diff, "Writer", Writer)
    rows = discriminant.discriminant_reps(
        ctx,
        rep,
        None,
        {s: h for s, (h, _, _) in splits.items()},
        weights=True,
        core_params={},
        penalties=(0.0,),
    )
    assert list(rows) == [
        "core+discriminant(a)",
        "core+discriminant(b)",
        "core+discriminant(a,b)",
    ]
    assert encodings == ["a"]
    for label in list(rows)[1:]:
        assert rows[label][2]["weights"]["same_as"] == "core+discriminant(a)"
    assert "same_as" not in rows["core+discriminant(a)"][2]["weights"]
