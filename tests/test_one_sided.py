"""methods/one_sided.py: a marker word hidden among its attribute's filler
tokens, the step between two whole numbers of counterpart groups."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from moddiffy_jax import train
from moddiffy_jax.methods import one_sided, swap_budget
from tests.helpers import tiny


def _slotted(n, seed, rates=(0.8, 0.8)):
    """One attribute slot an example: a marker of its class (3 or 4 for
    class 0, 5 or 6 for class 1; in ``rates`` of each class's examples),
    else a filler (7 twice as often as 8). Task words 1 / 2 (75% right),
    the attribute equal to the label 85% of the time. Token 9 is in half
    the examples whatever they hold; 10 stands where no marker is, in
    class-1 examples only; 11 stands there in three examples."""
    rng = np.random.default_rng(seed)
    task = rng.integers(0, 2, n)
    attr = np.where(rng.random(n) < 0.85, task, 1 - task)
    word = np.where(rng.random(n) < 0.75, task, 1 - task) + 1
    marked = rng.random(n) < np.asarray(rates)[attr]
    slot = np.where(marked, 3 + 2 * attr + rng.integers(0, 2, n), 0)
    filler = np.where(rng.random(n) < 2 / 3, 7, 8)
    slot = np.where(marked, slot, filler)
    noise = np.where(rng.random(n) < 0.5, 9, 0)
    skewed = np.where(~marked & (attr == 1) & (rng.random(n) < 0.5), 10, 0)
    rare = np.zeros(n, np.int64)
    rare[np.flatnonzero(~marked)[:3]] = 11
    ids = np.column_stack([word, slot, noise, skewed, rare]).astype(np.int64)
    return types.SimpleNamespace(
        input_ids=ids,
        attention_mask=(ids != 0).astype(np.int32),
        task=task,
        attrs={"a": attr},
    )


def test_fillers_stand_where_no_marker_is_and_tell_nothing():
    split = _slotted(3000, 0)
    fillers = one_sided.filler_tokens(split, "a", [3, 4, 5, 6], 16)
    # 9 is beside the markers, 10 tells the class, 11 is too rare; the
    # task words are beside the markers too. Most frequent first.
    np.testing.assert_array_equal(fillers, [7, 8])
    # Another attribute's markers are not taken; no markers, no fillers.
    np.testing.assert_array_equal(
        one_sided.filler_tokens(split, "a", [3, 4, 5, 6], 16, exclude=[7]), [8]
    )
    assert one_sided.filler_tokens(split, "a", [], 16).size == 0
    # Where one class holds its markers less often, the examples with no
    # marker lean to it, and so do the fillers: they tell what a marker's
    # absence tells, and are found.
    uneven = _slotted(3000, 0, rates=(0.9, 0.4))
    np.testing.assert_array_equal(
        one_sided.filler_tokens(uneven, "a", [3, 4, 5, 6], 16), [7, 8]
    )


def test_a_run_s_fillers_leave_out_another_attribute_s_telling_tokens():
    split = _slotted(3000, 0)
    groups = [[3, 5], [4, 6]]
    np.testing.assert_array_equal(
        one_sided.attribute_fillers(split, "a", groups, ["a"], 1, 0.5), [7, 8]
    )
    # A second attribute that filler 7 tells: 7 is that attribute's word,
    # and hiding it among a's fillers would hide it from b's diff too.
    split.attrs["b"] = (split.input_ids[:, 1] == 7).astype(np.int64)
    np.testing.assert_array_equal(
        one_sided.attribute_fillers(split, "a", groups, ["a", "b"], 1, 0.5), [8]
    )


def _read(table):
    """A read of merged groups from a table keyed by the merged groups."""

    def read(merged):
        key = tuple(tuple(int(t) for t in g) for g in merged)
        cost, closed = table[key]
        return swap_budget.PrefixRead(len(merged), 0.9, 0.9, cost, closed)

    return read


def test_the_half_step_takes_the_better_word_of_the_next_group():
    groups = [[3, 5], [4, 6]]
    read = _read(
        {
            ((3, 7, 8),): (0.05, 0.1),
            ((5, 7, 8),): (0.1, 0.3),  # closes more: taken
            ((3, 5), (4, 7, 8)): (3.0, 0.9),  # over budget: not taken
            ((3, 5), (6, 7, 8)): (1.0, 0.6),
        }
    )
    halves = one_sided.half_reads(read, groups, [7, 8], (-1, 0, 1, 2), 0.9, 2.0)
    assert [(h.groups, h.word) for h in halves] == [(0, 5), (1, 6)]
    np.testing.assert_array_equal(halves[1].group, [6, 7, 8])
    assert one_sided.half_reads(read, groups, [], (0,), 0.9, 2.0) == []
    # Where both words reach the target, the cheaper one.
    (cheap,) = one_sided.half_reads(read, groups, [7, 8], (0,), 0.05, 2.0)
    assert cheap.word == 3


@pytest.mark.parametrize(
    ("target", "max_drop", "groups", "half", "reason"),
    [
        (0.5, 3.0, 1, True, "target (one-sided)"),  # 1.5 steps reach it first
        (0.4, 3.0, 1, False, "target"),  # one whole group already does
        (0.9, 1.6, 1, True, "budget (one-sided)"),  # the furthest within 1.6
        (0.9, 3.0, 2, False, "budget"),
        (0.9, 0.1, 1, False, "over budget"),  # as the whole choice was
    ],
)
def test_the_one_sided_step_is_chosen_by_the_whole_groups_rule(
    target, max_drop, groups, half, reason
):
    reads = [
        swap_budget.PrefixRead(k, 0.9, 0.9, cost, closed)
        for k, cost, closed in [(0, 0, 0), (1, 0.5, 0.4), (2, 2.5, 0.8)]
    ]
    halves = [one_sided.HalfRead(1, 6, (7, 8), 0.9, 0.9, 1.5, 0.55)]
    whole, why = swap_budget.choose_count(reads, target, max_drop)
    got = swap_budget.choose_steps(reads, halves, whole, why, target, max_drop)
    assert (got[0], got[1] is not None, got[2]) == (groups, half, reason)


def test_the_choice_reads_the_one_sided_steps_beside_the_whole_groups():
    train_split, dev = _slotted(4000, 0), _slotted(4000, 1)
    groups = [[3, 5], [4, 6]]
    kw = {"num_task_classes": 2, "num_attr_classes": 2}
    whole = swap_budget.choose_groups(
        train_split, dev, "a", groups, target=0.45, max_drop=20.0, **kw
    )
    assert whole.chosen == 1 and whole.half_reads == () and whole.one_sided is None
    fillers = one_sided.filler_tokens(train_split, "a", [3, 4, 5, 6], 16)
    choice = swap_budget.choose_groups(
        train_split, dev, "a", groups, target=0.45, max_drop=20.0, fillers=fillers, **kw
    )
    one, two = whole.reads[1], whole.reads[2]
    # Read beside the whole choice (after 0 and 1 groups); hiding one word
    # of the next group closes part of what the whole group would.
    assert [h.groups for h in choice.half_reads] == [0, 1]
    half = choice.half_reads[1]
    assert one.closed < half.closed < two.closed
    aimed = swap_budget.choose_groups(
        train_split,
        dev,
        "a",
        groups,
        target=half.closed,
        max_drop=20.0,
        fillers=fillers,
        **kw,
    )
    assert aimed.chosen == 1 and aimed.one_sided == half and aimed.final() == half
    assert aimed.reason == "target (one-sided)"
    assert json.loads(json.dumps(aimed.to_json()))["one_sided"]["word"] == half.word
    with pytest.raises(ValueError, match="give one or the other"):
        swap_budget.choose_groups(
            train_split,
            dev,
            "a",
            groups,
            target=0.5,
            max_drop=2.0,
            fillers=fillers,
            counts=(0, 2),
            **kw,
        )


def test_a_run_swaps_the_chosen_one_sided_group_and_records_its_reads():
    overrides = {
        "method.swap_weight": 1.0,
        # On the tiny run's dev split, age's one word hidden after one
        # group reads past this where one whole group does not.
        "method.swap_target": 1.0,
        "method.swap_one_sided": True,
        "data.synthetic.num_train": 2000,
    }
    ctx = train.build_context(tiny("moddiffy_par", **overrides))
    assert ctx.swap_reads["age"]["one_sided"] is not None
    for attr, groups in ctx.swap_groups.items():
        read = ctx.swap_reads[attr]
        assert read["half_reads"], attr  # the generator's fillers were found
        half = read["one_sided"]
        assert len(groups) == read["chosen"] + (half is not None)
        if half is not None:
            np.testing.assert_array_equal(groups[-1], [half["word"], *half["fillers"]])
            # The cycle moves the word to a filler and the last filler back.
            table = ctx.swap_tables[attr]
            assert table[half["word"]] == half["fillers"][0]
            assert table[half["fillers"][-1]] == half["word"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"method.swap_target": 0.0}, "swap_one_sided=True adds a one-sided step"),
        (
            {"method.swap_target": 0.5, "method.swap_reread_at": 0.5},
            "would drop the one-sided step",
        ),
    ],
)
def test_a_one_sided_step_without_a_choice_to_keep_it_is_refused(overrides, match):
    config = tiny(
        "moddiffy_par",
        **{"method.swap_weight": 1.0, "method.swap_one_sided": True, **overrides},
    )
    with pytest.raises(ValueError, match=match):
        train.build_context(config)


def test_the_report_line_names_a_one_sided_step():
    from moddiffy_jax.eval.report import objective_line

    read = {"groups": 2, "of": 5, "closed": 0.6, "cost": 1.5}
    choice = {"objective": "swap", "reason": "r", "reads": {"age": read}}
    assert "age: 2 of 5 groups close 0.60" in objective_line(choice)
    choice["reads"]["age"] = {**read, "one_sided": 3394}
    assert "2 of 5 groups and one word one-sided close 0.60" in objective_line(choice)
