"""Diff strength calibration (methods/strength.py)."""

import jax
import numpy as np
import pytest

from moddiffy_jax.methods import strength
from moddiffy_jax.methods.word_rows import WORD_TABLE
from moddiffy_jax.models import bert
from moddiffy_jax.subnets import selection
from tests.helpers import bag_of_rows, planted_split

VOCAB = 40


def _reader(costs, leaks=None, se=0.0):
    """``read(scale)`` from tables keyed by scale; records what was read."""
    seen = []

    def read(scale):
        seen.append(scale)
        leak = None if leaks is None else leaks[scale]
        return strength.Reading(costs[scale], se, leak)

    return read, seen


def test_goes_up_until_the_floor_and_stops_there():
    costs = {1.0: 0.5, 1.25: 0.8, 1.5: 1.0, 2.0: 1.2, 2.5: 1.3, 3.0: 1.4}
    leaks = {1.0: 0.95, 1.25: 0.93, 1.5: 0.90, 2.0: 0.88, 2.5: 0.87, 3.0: 0.86}
    read, seen = _reader(costs, leaks)
    scale, records = strength.choose_scale(read, 1.5, floor=0.89, tolerance=0.0)
    assert scale == 2.0 and seen == [1.0, 1.25, 1.5, 2.0]
    assert records[-1]["leakage"] == 0.88
    # Without a floor it takes the largest weight within budget.
    read, seen = _reader(costs)
    assert strength.choose_scale(read, 1.5)[0] == 3.0


def test_stops_at_the_budget_and_counts_the_reads_noise():
    costs = {1.0: 0.5, 1.25: 1.2, 1.5: 1.6, 2.0: 1.0, 2.5: 3.0, 3.0: 3.0}
    read, seen = _reader(costs)
    scale, records = strength.choose_scale(read, 1.5)
    # 1.5 is over budget; the low read at 2.0 is never taken.
    assert scale == 1.25 and seen == [1.0, 1.25, 1.5]
    read, _ = _reader(costs, se=0.4)
    scale, records = strength.choose_scale(read, 1.5, cost_z=1.0)
    assert scale == 1.0  # 1.2 + 0.4 > 1.5
    assert records[1]["bound"] == pytest.approx(1.6)


def test_goes_down_when_weight_one_is_over_budget():
    costs = {1.0: 2.5, 0.75: 1.9, 0.5: 1.1, 0.25: 0.3}
    read, seen = _reader(costs)
    scale, _ = strength.choose_scale(read, 1.5)
    assert scale == 0.5 and seen == [1.0, 0.75, 0.5]
    read, seen = _reader(costs)
    scale, _ = strength.choose_scale(read, 0.1)
    assert scale == 0.0 and seen == [1.0, 0.75, 0.5, 0.25]


def test_refuses_bad_arguments():
    read, _ = _reader({1.0: 0.0})
    with pytest.raises(ValueError, match="max_drop"):
        strength.choose_scale(read, -1.0)
    with pytest.raises(ValueError, match="cost_z"):
        strength.choose_scale(read, 1.0, cost_z=-0.5)
    with pytest.raises(ValueError, match="up must be ascending"):
        strength.choose_scale(read, 1.0, up=(2.0, 1.5))
    with pytest.raises(ValueError, match="down must be descending"):
        strength.choose_scale(read, 1.0, down=(0.5, 0.0))


def test_calibrate_finds_the_weight_that_closes_a_shrunk_difference():
    """A diff that moves the attribute tokens' rows 40% of the way to their
    mean leaves the attribute readable; at weight 2.5 the rows meet."""
    config = bert.BertConfig.tiny(vocab_size=VOCAB)
    params = bert.init_params(config, jax.random.key(0, impl="rbg"))
    flat = selection.flatten(params)
    table = np.asarray(flat[WORD_TABLE])
    delta = np.zeros_like(table)
    mean = table[[20, 21]].mean(0)
    delta[[20, 21]] = 0.4 * (mean - table[[20, 21]])
    train, dev = planted_split(400, 0), planted_split(200, 1)
    direction = table[11] - table[10]
    midpoint = (table[10] + table[11]) / 2 / 5 + table[30:40].mean(0) * 3 / 5

    def predict(h):  # reads the task tokens' rows: the diff cannot cost it
        return ((h - midpoint) @ direction > 0).astype(np.int32)

    def compose(core, d, scale):
        return selection.unflatten({**flat, WORD_TABLE: table + scale * d})

    choice = strength.calibrate(
        params, delta, "a", 2, train, dev, compose, bag_of_rows, predict
    )
    assert choice.scale == 2.5
    assert [r["scale"] for r in choice.read] == [1.0, 1.25, 1.5, 2.0, 2.5]
    assert choice.read[0]["leakage"] > 0.9  # 40% of the way: still read
    assert choice.read[-1]["leakage"] <= choice.floor + choice.tolerance
    assert all(r["cost"] == 0.0 for r in choice.read)
    assert choice.summary()["scale"] == 2.5


def test_config_sections_become_evaluate_run_options():
    from moddiffy_jax import train
    from moddiffy_jax.config_lib import experiment_config

    config = experiment_config("moddiffy_par", "model=tiny")
    assert train.eval_options(config, "strength") is None  # off by default
    with config.unlocked():
        config.eval.strength.enabled = True
        config.eval.strength.max_drop = 1.0
    options = train.eval_options(config, "strength")
    assert options == {
        "max_drop": 1.0,
        "select_train": 2000,
        "cost_z": 1.0,
        "floor_z": 1.0,
    }
    assert set(options) <= set(strength.calibrate.__kwdefaults__)
