"""methods/swap_reread.py: the swap groups chosen again from the trained
diffs' own read, with the tables as inputs of the train step."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from moddiffy_jax import objectives, train
from moddiffy_jax.eval.evaluator import Evaluator
from moddiffy_jax.methods import swap_budget, swap_reread
from tests.helpers import tiny
from tests.test_counterfactual import _gender_loss
from tests.test_substeps import _first_step

SWAPS = {"method.swap_weight": 1.0, "data.synthetic.num_train": 2000}


def _reads():
    return [
        swap_budget.PrefixRead(k, 0.9, 0.9, cost, closed)
        for k, cost, closed in [(0, 0, 0), (1, 0.5, 0.3), (2, 1.5, 0.6), (3, 2.5, 0.9)]
    ]


def test_the_reads_are_scaled_to_the_trained_diff():
    # Two groups were read to close 0.6 at 1.5 points; the diff closed 0.9
    # at 2.5: every closure times 1.5, every cost one point more.
    scaled = swap_budget.calibrated(_reads(), 2, closed=0.9, cost=2.5)
    assert [r.closed for r in scaled] == [0.0, 0.45, 0.9, 1.35]
    assert [r.cost for r in scaled] == [0.0, 1.5, 2.5, 3.5]
    # Past the target at a cost over the budget: one group fewer.
    assert swap_budget.choose_count(scaled, 0.75, 2.0) == (1, "budget")
    # A diff that removed less than read, at less cost: more groups.
    scaled = swap_budget.calibrated(_reads(), 1, closed=0.15, cost=0.0)
    assert [r.closed for r in scaled] == [0.0, 0.15, 0.3, 0.45]
    assert [r.cost for r in scaled] == [0.0, 0.0, 1.0, 2.0]
    assert swap_budget.choose_count(scaled, 0.3, 2.0) == (2, "target")
    # A read that closes nothing cannot be scaled: closures as read.
    reads = [swap_budget.PrefixRead(k, 0.9, 0.9, k, 0.0) for k in range(3)]
    assert [r.closed for r in swap_budget.calibrated(reads, 1, 0.5, 1.0)] == [0.0] * 3


def test_the_debias_step_reads_its_swap_table_from_the_step_inputs():
    """The tables are inputs of the step (frozen["swap_tables"]): another
    table changes the swap term without tracing the loss again."""
    ctx, _, state, frozen, batch = _first_step("moddiffy_par", **SWAPS)
    table = ctx.swap_tables["gender"]
    np.testing.assert_array_equal(frozen[swap_reread.FROZEN_KEY]["gender"], table)
    traces = []
    raw = _gender_loss(ctx, table)

    def counted(*args):
        traces.append(1)
        return raw(*args)

    loss = jax.jit(counted)
    values = {}
    for name, tables in (("own", frozen["swap_tables"]), ("identity", None)):
        if tables is None:
            tables = {
                a: np.arange(t.size, dtype=np.int32) for a, t in ctx.swap_tables.items()
            }
        inputs = {**frozen, swap_reread.FROZEN_KEY: tables}
        _, terms = loss(state.trainable, inputs, batch, jax.random.PRNGKey(1))
        values[name] = float(terms["swap/gender"])
    assert values["own"] > 0.0 and values["identity"] == 0.0
    assert len(traces) == 1


def test_the_groups_are_chosen_again_written_and_restored_on_resume(tmp_path):
    overrides = {**SWAPS, "method.swap_target": 0.5, "method.swap_reread_at": 0.5}
    ctx = train.build_context(tiny("moddiffy_par", **overrides))
    assert swap_reread.read_step(ctx, 10) == 5
    trainable, frozen = ctx.method.init(ctx, jax.random.PRNGKey(0))
    before = {a: len(g) for a, g in ctx.swap_groups.items()}
    new_frozen, record = swap_reread.reread(
        ctx, Evaluator(ctx), tmp_path, trainable, frozen, "l0", step=5
    )
    saved = json.loads((tmp_path / swap_reread.FILE).read_text())
    assert saved["step"] == 5 and set(saved["attributes"]) == {"gender", "age"}
    vocab = ctx.swap_tables["gender"].size
    for attr, chosen in saved["attributes"].items():
        m = chosen["measured"]
        # Fresh diffs are zero: core + diff reads as the core.
        assert m["closed"] == 0.0 and m["cost"] == 0.0
        assert m["leakage"] == m["core_leakage"] and m["floor"] > 0.0
        assert chosen["groups_before"] == before[attr]
        n = chosen["groups_after"]
        assert record[f"swap_reread/{attr}/groups"] == n
        assert len(ctx.swap_groups[attr]) == n
        want = objectives.swap_table(ctx.swap_ranked[attr][:n], vocab)
        np.testing.assert_array_equal(ctx.swap_tables[attr], want)
        np.testing.assert_array_equal(new_frozen[swap_reread.FROZEN_KEY][attr], want)
    assert any(c["groups_after"] != before[a] for a, c in saved["attributes"].items())
    # A run resumed before the read's step swaps the first choice (and reads
    # again at the step); at or past it, the saved one.
    for step, same_as_saved in ((4, False), (5, True)):
        again = train.build_context(tiny("moddiffy_par", **overrides))
        _, fresh = again.method.init(again, jax.random.PRNGKey(0))
        got, inputs = swap_reread.resume(again, tmp_path, step, fresh)
        assert (got is not None) == same_as_saved
        for attr, chosen in saved["attributes"].items():
            n = chosen["groups_after"] if same_as_saved else before[attr]
            assert len(again.swap_groups[attr]) == n
            np.testing.assert_array_equal(
                inputs[swap_reread.FROZEN_KEY][attr], again.swap_tables[attr]
            )


def test_the_reread_is_off_without_prefix_reads():
    ctx = train.build_context(
        tiny("moddiffy_par", **SWAPS, **{"method.swap_reread_at": 0.5})
    )
    assert ctx.swap_reads is None and swap_reread.read_step(ctx, 10) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"method.swap_reread_at": 1.0}, "swap_reread_at is the share"),
        ({"method.swap_reread_max_drop": -1.0}, "swap_reread_max_drop must be"),
        ({"method.swap_reread_train": 3}, "swap_reread_train"),
        ({"method.swap_reread_mode": "words"}, "swap_reread_mode='words' is not one"),
        ({"method.swap_reread_mode": "decision"}, "set config.method.swap_reread_at"),
        ({"method.swap_keep_above": 0.0}, "swap_keep_above is a share"),
        ({"method.swap_keep_distill": -1.0}, "swap_keep_distill must be >= 0"),
        ({"method.swap_reread_mode": "weight"}, "set config.method.swap_reread_at"),
        ({"method.swap_weight_down": -0.5}, "swap_weight_down scales"),
        ({"method.swap_weight_up": 0.5}, "swap_weight_up scales"),
        ({"method.swap_raise_below": 1.5}, "swap_raise_below is a share"),
    ],
)
def test_bad_reread_settings_name_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        train.build_context(tiny("moddiffy_par", **overrides))


def test_the_read_switches_an_attribute_past_its_floor_to_the_core_decision():
    """swap_reread_mode="decision": an attribute whose diff closed at least
    swap_keep_above of its gap keeps the core's decision from the read on
    (its debias loss becomes the one of swap_keep_task with the KL to the
    core's prediction at swap_keep_distill); the other keeps the plain
    swaps; the switches are step inputs, 0 before the read."""
    import dataclasses

    from tests.test_counterfactual import _debias_terms, _own_tables

    overrides = {
        "method.swap_weight": 1.0,
        "method.swap_reread_at": 0.5,
        "method.swap_reread_mode": "decision",
        "method.swap_keep_distill": 2.0,
    }
    # Without the swaps' prefix reads the read could never run: an error.
    with pytest.raises(ValueError, match="set config.method.swap_target > 0"):
        _first_step("moddiffy_par", **overrides)
    overrides.update(SWAPS, **{"method.swap_target": 0.5})
    ctx, _, state, frozen, batch = _first_step("moddiffy_par", **overrides)
    assert {a: float(v) for a, v in frozen[swap_reread.KEEP_KEY].items()} == {
        "gender": 0.0,
        "age": 0.0,
    }
    measured = {"gender": {"closed": 1.3, "cost": 3.0}, "age": {"closed": 0.4}}
    chosen = swap_reread.choose(ctx, measured)
    assert chosen["gender"]["keep_decision"] and not chosen["age"]["keep_decision"]
    assert chosen["gender"]["groups_after"] == len(ctx.swap_groups["gender"])
    switched = swap_reread.apply(ctx, chosen, frozen)
    assert float(switched[swap_reread.KEEP_KEY]["gender"]) == 1.0
    assert float(switched[swap_reread.KEEP_KEY]["age"]) == 0.0

    def terms(attribute, debias, inputs):
        return _debias_terms(ctx, attribute, debias, state.trainable, inputs, batch)

    plain = {k: v for k, v in _own_tables(frozen).items() if k != swap_reread.KEEP_KEY}
    kept = dataclasses.replace(ctx.debias, swap_keep_task=True, task_distill=2.0)
    want = {a: terms(a, ctx.debias, plain) for a in ("gender", "age")}
    want_kept = terms("gender", kept, plain)
    for inputs, on in ((frozen, set()), (switched, {"gender"})):
        for attribute in ("gender", "age"):
            got = terms(attribute, ctx.debias, _own_tables(inputs))
            kl = got.pop("distill_kept")
            if attribute in on:
                ref = dict(want_kept)
                np.testing.assert_allclose(kl, ref.pop("distill"), rtol=1e-5)
            else:
                ref = want[attribute]
                assert kl == 0.0
            assert got.keys() == ref.keys()
            for k in ref:
                np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-7)
    assert want_kept["swap/gender"] < want["gender"]["swap/gender"]
    # With the pivotal pairs (the swap recipe's default since stop 68) the
    # switch still frees the decision directions on every row.
    pivotal = dataclasses.replace(ctx.debias, swap_keep_pivotal=True)
    got = terms("gender", pivotal, _own_tables(switched))["swap/gender"]
    np.testing.assert_allclose(got, want_kept["swap/gender"], rtol=1e-5, atol=1e-7)


def test_the_read_sets_each_attributes_swap_weight():
    """swap_reread_mode="weight": a diff past swap_keep_above has its swap
    term scaled by swap_weight_down, one short of swap_raise_below within
    swap_reread_max_drop points by swap_weight_up, the rest by 1; the
    scales are step inputs (1 before the read) and scale the swap term
    alone."""
    from tests.test_counterfactual import _debias_terms, _own_tables

    overrides = {
        **SWAPS,
        "method.swap_target": 0.5,
        "method.swap_reread_at": 0.5,
        "method.swap_reread_mode": "weight",
        "method.swap_weight_down": 0.25,
        "method.swap_weight_up": 3.0,
    }
    ctx, _, state, frozen, batch = _first_step("moddiffy_par", **overrides)
    assert swap_reread.KEEP_KEY not in frozen
    before = {a: float(v) for a, v in frozen[swap_reread.SCALE_KEY].items()}
    assert before == {"gender": 1.0, "age": 1.0}
    cases = {
        "past": ({"closed": 1.2, "cost": 2.5}, 0.25),
        "short": ({"closed": 0.3, "cost": 1.0}, 3.0),
        "short, costly": ({"closed": 0.3, "cost": 1.6}, 1.0),
        "between": ({"closed": 0.8, "cost": 0.5}, 1.0),
    }
    for name, (m, want) in cases.items():
        got = swap_reread.choose(ctx, {"gender": m})["gender"]
        assert got["swap_scale"] == want, name
        assert got["groups_after"] == len(ctx.swap_groups["gender"])
    chosen = swap_reread.choose(
        ctx, {"gender": cases["past"][0], "age": cases["short"][0]}
    )
    scaled = swap_reread.apply(ctx, chosen, frozen)
    assert {a: float(v) for a, v in scaled[swap_reread.SCALE_KEY].items()} == {
        "gender": 0.25,
        "age": 3.0,
    }
    for attribute, factor in (("gender", 0.25), ("age", 3.0)):
        plain = _debias_terms(
            ctx, attribute, ctx.debias, state.trainable, _own_tables(frozen), batch
        )
        got = _debias_terms(
            ctx, attribute, ctx.debias, state.trainable, _own_tables(scaled), batch
        )
        key = f"swap/{attribute}"
        assert plain[key] > 0.0
        np.testing.assert_allclose(got.pop(key), factor * plain.pop(key), rtol=1e-5)
        for k in plain:  # every other term as before the read
            np.testing.assert_allclose(got[k], plain[k], rtol=1e-5, atol=1e-7)
