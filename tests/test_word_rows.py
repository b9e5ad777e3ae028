"""The word rows an attribute's diff may change (config.diff.word_rows)."""

import math

import jax
import numpy as np
import pytest

from moddiffy_jax import train
from moddiffy_jax.methods import common, moddiffy, word_rows
from moddiffy_jax.subnets import diffs as diffs_lib
from moddiffy_jax.subnets import selection
from tests.helpers import set_fields, tiny
from tests.test_substeps import _first_step


def _toy_corpus():
    """Eight examples: token 5 marks attribute 1 in both task classes, token
    6 follows the task label only, token 7 is in every example, and the
    padding id 0 (mask 0) sits exactly where attribute 1 is."""
    task = np.array([0, 0, 0, 0, 1, 1, 1, 1], np.int32)
    attr = np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int32)
    ids = np.zeros((8, 4), np.int32)
    mask = np.ones((8, 4), np.int32)
    ids[:, 0] = 7
    ids[:, 1] = np.where(attr == 1, 5, 8)
    ids[:, 2] = np.where(task == 1, 6, 9)
    ids[:, 3] = np.where(attr == 1, 0, 9)
    mask[:, 3] = (attr == 0).astype(np.int32)
    return ids, mask, task, attr


def test_conditional_information_scores_attribute_tokens_only():
    ids, mask, task, attr = _toy_corpus()
    info = word_rows.conditional_information(ids, mask, task, attr, vocab=10)
    # Token 5 decides the binary attribute within each class: ln 2 nats.
    assert info[5] == pytest.approx(math.log(2.0))
    assert info[8] == pytest.approx(math.log(2.0))  # its complement
    for t in (6, 7, 1, 2):  # the label's token, an every-example token, unseen
        assert info[t] == pytest.approx(0.0, abs=1e-12)
    assert info[0] == 0.0  # padding is never counted, wherever it sits
    # Token 9 is in every attribute-0 example and half the attribute-1 ones.
    assert 0.0 < info[9] < math.log(2.0)


def test_top_tokens_caps_the_count_and_the_share():
    info = np.array([0.0, 0.5, 0.04, 1.0, 0.2, 0.5])
    np.testing.assert_array_equal(word_rows.top_tokens(info, 10), [3, 1, 5, 4, 2])
    np.testing.assert_array_equal(word_rows.top_tokens(info, 2), [3, 1])
    np.testing.assert_array_equal(word_rows.top_tokens(info, 10, 0.3), [3, 1, 5])
    assert word_rows.top_tokens(np.zeros(4), 3).size == 0


def test_restrict_closes_every_other_word_row():
    base = {
        "embeddings": {"word_embeddings": {"embedding": np.ones((6, 3), np.float32)}},
        "layer": {"kernel": np.ones((3, 3), np.float32)},
    }
    state = diffs_lib.init_diff(base, (r".*",))
    state = state.replace(delta=jax.tree.map(lambda d: d + 0.5, state.delta))
    out = word_rows.restrict(state, np.array([1, 4]))
    la = selection.flatten(out.log_alpha)
    delta = selection.flatten(out.delta)
    table = word_rows.WORD_TABLE
    shut = np.array([0, 2, 3, 5])
    assert np.all(np.asarray(la[table])[shut] == diffs_lib.CLOSED_LOG_ALPHA)
    assert np.all(np.asarray(delta[table])[shut] == 0.0)
    np.testing.assert_array_equal(np.asarray(delta[table])[[1, 4]], 0.5)
    np.testing.assert_array_equal(
        la["layer/kernel"], selection.flatten(state.log_alpha)["layer/kernel"]
    )
    values = selection.flatten(diffs_lib.dense_diff_values(out))
    assert np.all(np.asarray(values[table])[shut] == 0.0)
    no_table = diffs_lib.init_diff({"layer": base["layer"]}, (r".*",))
    assert word_rows.restrict(no_table, np.array([1])) is no_table


def test_a_debias_step_changes_only_its_attributes_rows():
    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par", **{"diff.word_rows": 8}
    )
    tokens = ctx.word_tokens
    assert set(tokens) == {"gender", "age"} and all(
        0 < len(t) <= 8 for t in tokens.values()
    )
    gender = [s for s in substeps if s.name == "debias/gender"]
    state, _ = jax.jit(common.make_train_step(gender))(
        state, frozen, batch, jax.random.PRNGKey(0)
    )
    values = diffs_lib.dense_diff_values(state.trainable["diffs"]["gender"])
    rows = np.abs(np.asarray(selection.flatten(values)[word_rows.WORD_TABLE])).sum(1)
    assert np.all(np.delete(rows, tokens["gender"]) == 0.0)
    assert rows[tokens["gender"]].sum() > 0.0  # the chosen rows did learn


def test_the_cut_keeps_open_rows_only_when_the_budget_exceeds_them():
    """A diff confined to its word table with a budget above its open rows
    keeps exactly those rows: closed rows never reach fixmask to train."""
    ctx, _, state, frozen, _ = _first_step(
        "moddiffy_par",
        **{
            "diff.word_rows": 4,
            "diff.include": (word_rows.WORD_TABLE,),
            "diff.keep": 0.5,
            "diff.prune_schedule": "final",
        },
    )
    table = selection.flatten(state.trainable["diffs"]["gender"].delta)
    hidden = np.shape(table[word_rows.WORD_TABLE])[1]
    for form in ("sparse", "dense"):  # diff.fixmask_state: the same entries
        set_fields(ctx.config, {"diff.fixmask_state": form})
        trainable, cut = moddiffy.to_fixmask(ctx, dict(state.trainable), frozen)
        sparse = moddiffy.sparse_diffs_of(ctx, trainable, cut, "fixmask")
        for attr, tokens in ctx.word_tokens.items():
            kept = sparse[attr].indices[word_rows.WORD_TABLE]
            want = (np.asarray(tokens)[:, None] * hidden + np.arange(hidden)).reshape(
                -1
            )
            np.testing.assert_array_equal(kept, np.sort(want))


@pytest.mark.parametrize(
    ("method", "overrides", "message"),
    [
        ("moddiffy_par", {"diff.word_rows": -1}, "whole number of tokens"),
        ("moddiffy_par", {"diff.word_rows_share": 1.5}, "in \\[0, 1\\]"),
        ("moddiffy_par", {"diff.word_rows": 4, "diff.structured": True}, "structured"),
        ("diffprun", {"diff.word_rows": 4}, "needs a modular debiasing method"),
    ],
)
def test_bad_word_rows_settings_name_the_fix(method, overrides, message):
    with pytest.raises(ValueError, match=message):
        train.build_context(tiny(method, "", **overrides))


def test_a_run_records_its_tokens_as_text():
    got = train._word_row_tokens(
        tiny("moddiffy_par"), {"gender": np.array([2002, 2016])}
    )
    assert got == {"gender": ["he", "she"]}
