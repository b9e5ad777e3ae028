"""Leakage floors, gap closed, and aggregation over training runs."""

import json

import numpy as np
import pytest

from moddiffy_jax.eval import aggregate, composition, removal


def test_leakage_floor_by_hand():
    # Task 0 -> attribute 0 in 3 of 4 train rows; task 1 -> attribute 1 in 3 of 4.
    train_task = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    train_attr = np.array([0, 0, 0, 1, 1, 1, 1, 0])
    test_task = np.array([0, 0, 1, 1])
    test_attr = np.array([0, 1, 1, 1])
    floor = removal.leakage_floor(
        train_task,
        train_attr,
        test_task,
        test_attr,
        num_task_classes=2,
        num_attr_classes=2,
    )
    # Rule: task 0 -> 0, task 1 -> 1. Attribute 0: 1/1 right; attribute 1: 2/3.
    assert floor == pytest.approx((1.0 + 2 / 3) / 2)
    # An attribute independent of the task has a floor at chance.
    rng = np.random.default_rng(0)
    t, a = rng.integers(0, 2, 4000), rng.integers(0, 2, 4000)
    f = removal.leakage_floor(t, a, t, a, num_task_classes=2, num_attr_classes=2)
    assert abs(f - 0.5) < 0.03


def test_the_report_reads_train_as_read_where_balancing_upsampled_it():
    """evaluate_run's view: the floors and the known train representations
    come from the rows as read, not from data.balance's copies."""
    import dataclasses

    from moddiffy_jax import data

    c = data.default_data_config()
    c.balance.attribute = "gender"
    c.max_examples_per_split = 400
    balanced = data.load_text_dataset(c)
    n = balanced.train_originals
    assert n == 400 and len(balanced.splits["train"]) > n

    @dataclasses.dataclass
    class Ctx:
        data: object
        attributes: tuple = ("gender", "age")

    reps = {
        "core": {
            "train": np.zeros((len(balanced.splits["train"]), 3)),
            "dev": np.ones((400, 3)),
        }
    }
    ctx, known = composition._train_as_read(Ctx(balanced), reps)
    assert len(ctx.data.splits["train"]) == n and ctx.data.train_originals is None
    assert known["core"]["train"].shape == (n, 3)
    assert known["core"]["dev"] is reps["core"]["dev"]
    floors = composition.leakage_floors(ctx)
    on_copies = composition.leakage_floors(Ctx(balanced))
    # gender follows the label at 0.8: found on the rows as read, a tie
    # (chance) on the balanced copies.
    assert floors["gender"]["floor"] > 0.75
    assert on_copies["gender"]["floor"] == pytest.approx(0.5)
    plain = Ctx(data.load_text_dataset(data.default_data_config()))
    assert composition._train_as_read(plain, reps) == (plain, reps)
    images = Ctx(object())  # a dataset kind without balancing
    assert composition._train_as_read(images, reps) == (images, reps)
    assert data.original_train(images.data) is images.data


def test_gap_closed():
    assert composition.gap_closed(0.98, 0.95, 0.92) == pytest.approx(0.5)
    assert composition.gap_closed(0.9, 0.95, 0.8) == pytest.approx(-0.5)
    assert composition.gap_closed(0.9, 0.85, 0.95) is None  # no gap to close


def _results(core_leak, diff_leak, acc, floor):
    def row(leak, test_acc):
        return {
            "test_task_acc": test_acc,
            "task": {"test": {"a/rms_tpr_gap": 0.1}},
            "leakage": {
                "a": {"mean": leak, "linear": {"test_balanced_accuracy": leak}}
            },
        }

    return {
        "method": "moddiffy_par",
        "dataset": "synthetic",
        "synthetic": True,
        "attributes": ["a"],
        "floors": {"a": {"floor": floor, "chance": 0.5}},
        "composition": {
            "core": row(core_leak, acc),
            "core+a": row(diff_leak, acc - 0.01),
        },
    }


def test_aggregate_runs(tmp_path):
    runs = []
    for i, (core, diff) in enumerate([(0.9, 0.8), (0.9, 0.7)]):
        run = tmp_path / f"r{i}"
        (run / "eval").mkdir(parents=True)
        (run / "eval" / "results.json").write_text(
            json.dumps(_results(core, diff, 0.9, 0.7))
        )
        runs.append(run)
    agg = aggregate.aggregate_runs(runs)
    row = agg["rows"]["core+a"]
    assert row["a leakage"]["mean"] == pytest.approx(0.75)
    assert row["a leakage"]["std"] == pytest.approx(0.05)
    assert row["a gap closed"]["mean"] == pytest.approx(0.75)
    assert row["a gap closed"]["n"] == 2
    text = aggregate.format_aggregate(agg)
    assert "2 training runs" in text and "SYNTHETIC" in text
    other = tmp_path / "other"
    (other / "eval").mkdir(parents=True)
    bad = _results(0.9, 0.8, 0.9, 0.7) | {"dataset": "dwmw17_dialect"}
    (other / "eval" / "results.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="different experiments"):
        aggregate.aggregate_runs([runs[0], other])
    with pytest.raises(FileNotFoundError, match="evaluate the run first"):
        aggregate.aggregate_runs([tmp_path / "missing"])
