"""methods/swap_budget.py: the bag-of-tokens reads that choose which
counterpart groups a swap diff is made invariant to."""

from __future__ import annotations

import types

import numpy as np
import pytest

from moddiffy_jax import context, train
from moddiffy_jax.eval import metrics
from moddiffy_jax.methods import swap_budget
from tests.helpers import set_fields, tiny


def _split(ids, task, attr, pad=0):
    ids = np.asarray(ids, np.int64)
    return types.SimpleNamespace(
        input_ids=ids,
        attention_mask=(ids != pad).astype(np.int32),
        task=np.asarray(task),
        attrs={"a": np.asarray(attr)},
    )


def test_bag_of_tokens_counts_presence_merges_groups_and_drops_the_rest():
    split = _split([[5, 7, 7, 0], [6, 9, 0, 0], [8, 0, 0, 0]], [0, 1, 0], [0, 1, 0])
    columns = np.array([5, 6, 7, 9])  # 8 is not a column; 0 is padding
    x = swap_budget.bag_of_tokens(split, [], columns).toarray()
    np.testing.assert_array_equal(x, [[1, 0, 1, 0], [0, 1, 0, 1], [0, 0, 0, 0]])
    merged = swap_budget.bag_of_tokens(split, [[5, 6]], columns).toarray()
    np.testing.assert_array_equal(merged[:, :2], [[1, 0], [1, 0], [0, 0]])


def test_the_logistic_read_learns_a_telling_token_and_balances_classes():
    rng = np.random.default_rng(0)
    n = 600
    y = (rng.random(n) < 0.15).astype(int)  # a rare class
    # Token 3 marks class 1 in 70% of its examples; tokens 10..19 are noise.
    marker = np.where((y == 1) & (rng.random(n) < 0.7), 3, 0)
    noise = rng.integers(10, 20, size=(n, 3))
    split = _split(np.column_stack([marker, noise]), y, y)
    columns = np.arange(1, 20)
    x = swap_budget.bag_of_tokens(split, [], columns)
    plain = swap_budget._predict(swap_budget.fit_logistic(x, y, 2), x)
    balanced = swap_budget._predict(swap_budget.fit_logistic(x, y, 2, balanced=True), x)
    assert metrics.balanced_accuracy(y, balanced, 2) > 0.8
    # Unweighted, the rare class's unmarked examples go to the majority; the
    # balanced fit recalls at least as many of the rare class.
    assert balanced[y == 1].mean() >= plain[y == 1].mean()
    # The fit is the minimum: its gradient vanishes.
    w = swap_budget.fit_logistic(x, y, 2, max_iter=2000)
    assert np.abs(_grad(x, y, w)).max() < 1e-3


def _grad(x, y, w):
    xb = np.column_stack([x.toarray(), np.ones(x.shape[0])])
    logits = xb @ w
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    g = xb.T @ (p - np.eye(w.shape[1])[y])
    g[:-1] += w[:-1]
    return g


def _planted(n, seed):
    """Task words 1/2 (75% reliable), attribute counterparts 3/4 and 5/6
    (each in half the examples, always of the example's attribute), and the
    attribute equal to the task label 85% of the time (so where the words
    disagree, the attribute's word tells the label better)."""
    rng = np.random.default_rng(seed)
    task = rng.integers(0, 2, n)
    attr = np.where(rng.random(n) < 0.85, task, 1 - task)
    word = np.where(rng.random(n) < 0.75, task, 1 - task) + 1
    first = np.where(rng.random(n) < 0.5, 3 + attr, 0)
    second = np.where(rng.random(n) < 0.5, 5 + attr, 0)
    return _split(np.column_stack([word, first, second]), task, attr)


def test_each_prefix_is_read_and_merging_every_group_reaches_the_floor():
    train_split, dev = _planted(3000, 0), _planted(3000, 1)
    reads, floor = swap_budget.read_prefixes(
        train_split, dev, "a", [[3, 4], [5, 6]], num_task_classes=2, num_attr_classes=2
    )
    assert [r.groups for r in reads] == [0, 1, 2]
    assert reads[0].leakage > 0.9 and reads[0].closed == 0.0
    assert 0.3 < reads[1].closed < reads[2].closed  # one of two markers gone
    # All that is left is the task word, a noisier read of the label than
    # the floor's gold label: at the floor or below it.
    assert reads[2].closed > 0.9 and reads[2].leakage < floor + 0.02
    # The attribute words told the task through the correlation: merging
    # them costs task accuracy, more for more groups.
    assert 0.0 < reads[1].cost < reads[2].cost


@pytest.mark.parametrize(
    ("target", "max_drop", "chosen", "reason"),
    [
        (0.5, 3.0, 2, "target"),  # the fewest groups reaching the target
        (0.9, 3.0, 3, "target"),
        (0.95, 3.0, 3, "budget"),  # never reached: the most within budget
        (0.5, 1.0, 1, "budget"),
        (0.5, 0.1, 1, "over budget"),  # even one group costs more
    ],
)
def test_the_choice_takes_the_fewest_groups_that_reach_the_target(
    target, max_drop, chosen, reason
):
    reads = [
        swap_budget.PrefixRead(k, 0.9, 0.9, cost, closed)
        for k, cost, closed in [(0, 0, 0), (1, 0.5, 0.3), (2, 1.5, 0.6), (3, 2.5, 0.9)]
    ]
    assert swap_budget.choose_count(reads, target, max_drop) == (chosen, reason)


def test_a_swap_target_swaps_a_prefix_of_the_groups_and_records_its_reads():
    overrides = {"method.swap_weight": 1.0, "data.synthetic.num_train": 2000}
    every = train.build_context(tiny("moddiffy_par", **overrides))
    some = train.build_context(
        tiny("moddiffy_par", **overrides, **{"method.swap_target": 0.5})
    )
    assert every.swap_reads is None
    for attr, groups in some.swap_groups.items():
        choice = some.swap_reads[attr]
        assert len(groups) == choice["chosen"] < len(every.swap_groups[attr])
        for kept, full in zip(groups, every.swap_groups[attr], strict=False):
            np.testing.assert_array_equal(kept, full)
        assert len(choice["reads"]) == len(every.swap_groups[attr]) + 1
        assert choice["reads"][choice["chosen"]]["closed"] >= 0.5


def _par_config(arg=None, method="moddiffy_par", **overrides):
    """configs/<method>.py's config on the tiny model (its default objective
    is "auto")."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "configs" / f"{method}.py"
    spec = importlib.util.spec_from_file_location(f"{method}_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(",".join(filter(None, ["model=tiny", arg])))
    return set_fields(config, {"data.synthetic.num_train": 2000, **overrides})


def test_auto_trains_swaps_where_the_words_carry_the_attributes(monkeypatch):
    config = _par_config()
    assert config.method.objective == "auto" and config.method.swap_weight == 0.0
    found = []
    finder = context._counterpart_groups
    monkeypatch.setattr(
        context,
        "_counterpart_groups",
        lambda dataset, attr, *a: found.append(attr) or finder(dataset, attr, *a),
    )
    ctx = train.build_context(config)
    # The swaps' tables reuse the groups the decision found (once each).
    assert sorted(found) == ["age", "gender"]
    # The resolved config is the swap recipe; the requested one is untouched.
    assert ctx.config.method.objective == "swap" and config.method.objective == "auto"
    assert (
        ctx.config.method.swap_weight == 10.0 and ctx.config.method.swap_target == 0.75
    )
    assert ctx.config.method.fisher_weight == 0.0
    assert not ctx.config.method.swap_twin_gradient
    assert ctx.config.diff.compose_prob == 0.5
    assert set(ctx.swap_tables) == {"gender", "age"}
    choice = ctx.objective_choice
    assert choice["objective"] == "swap"
    for attr, read in choice["reads"].items():
        assert (
            read["closed"] >= 0.5 and read["groups"] == ctx.swap_reads[attr]["chosen"]
        )
    from moddiffy_jax.eval.report import objective_line

    line = objective_line(choice)
    assert line.startswith("objective auto -> swap") and "gender: " in line
    # The run's report.md says it too.
    from moddiffy_jax.eval import composition

    task = {"accuracy": 0.5, "macro_f1": 0.5}
    results = {
        "method": "moddiffy_par",
        "dataset": "synthetic",
        "attributes": [],
        "probe_config": {"members": 1, "seeds": [0]},
        "composition": {
            "core": {
                "dev_task_acc": 0.5,
                "test_task_acc": 0.5,
                "task": {"dev": task, "test": task},
                "leakage": {},
            }
        },
        "objective_choice": choice,
    }
    assert line in composition.format_report(results).splitlines()


#: The tiny run where the swaps pass for gender and not for age: asking
#: them for 0.99 of the gap within half a point (age's read: 0.84).
_GENDER_ONLY = {"method.auto_swap_closed": 0.99, "method.swap_max_drop": 0.5}
_AGE_SHORT = "age's swaps close 0.84 of its gap (< 0.99) within 0.5 points"


def test_auto_keeps_the_mmd_recipe_where_the_swaps_fall_short_and_says_why():
    # Asking the swaps for more than the read gives: the MMD recipe, for
    # every attribute where they pass for none (here: no dev split to read
    # them on) or where auto_mix is off.
    for overrides in (
        {"data.synthetic.num_dev": 0},
        {**_GENDER_ONLY, "method.auto_mix": False},
    ):
        ctx = train.build_context(_par_config(**overrides))
        assert ctx.config.method.objective == "mmd" and ctx.swap_tables is None
        assert ctx.config.method.fisher_weight == 10.0
        assert ctx.config.diff.compose_prob == 0.0
        assert not ctx.config.method.attribute_weights
        choice = ctx.objective_choice
        assert choice["objective"] == "mmd"
        assert choice["reason"] in ("the swaps' read needs a dev split", _AGE_SHORT)
        assert choice["attributes"] == {"gender": "mmd", "age": "mmd"}
    # A named objective is left as it is, with no choice recorded.
    named = train.build_context(_par_config("objective=mmd"))
    assert named.config.method.objective == "mmd" and named.objective_choice is None


def test_auto_gives_each_attribute_its_own_removal_where_the_swaps_pass_for_some():
    """Where the swaps pass for gender and not for age, one run swaps
    gender's words alone and gives age the MMD recipe (stop 78; it used to
    send both to the MMD); an attribute_weights entry the run set keeps its
    value, and the report line says which attribute took which."""
    from moddiffy_jax.eval.report import objective_line
    from moddiffy_jax.methods import attribute_weights
    from tests.test_substeps import _first_step

    config = _par_config(
        **_GENDER_ONLY, **{"method.attribute_weights": "age: mmd_weight=5"}
    )
    ctx = train.build_context(config)
    choice = ctx.objective_choice
    assert choice["objective"] == "mixed", choice
    assert choice["attributes"] == {"gender": "swap", "age": "mmd"}
    assert choice["reason"] == _AGE_SHORT + "; the swaps for gender"
    line = objective_line(choice)
    assert line.startswith("objective auto -> swap for gender, mmd for age: ")
    assert config.method.objective == "auto"  # config.json keeps the request
    method = ctx.config.method
    assert method.objective == "mmd" and set(ctx.swap_tables) == {"gender"}
    # The swap recipe's shared fields; the MMD's Fisher weight for age alone.
    assert method.swap_target == 0.75 and ctx.config.diff.compose_prob == 0.5
    assert method.task_guard and method.fisher_weight == 0.0
    gender = attribute_weights.for_attribute(ctx.debias, "gender")
    age = attribute_weights.for_attribute(ctx.debias, "age")
    assert gender.mmd_weight == 0.0 and gender.fisher_weight == 0.0
    assert gender.swap_weight > 0.0  # the read gap's weight (swap_gap_reference)
    assert age.swap_weight == 0.0 and age.fisher_weight == 10.0
    assert age.mmd_weight == 5.0  # the run's own entry
    # A swap weight of the run's own that says otherwise than the read is
    # refused, naming the entry and the fix.
    for entry, chose in (
        ("age: swap_weight=3", "MMD"),
        ("gender: swap_weight=0", "swaps"),
    ):
        bad = _par_config(**_GENDER_ONLY, **{"method.attribute_weights": entry})
        with pytest.raises(ValueError, match=f"chose the {chose}.*drop that entry"):
            train.build_context(bad)
    # Each debias step trains the terms of its own removal only.
    import jax

    from moddiffy_jax.methods import common

    run, substeps, state, frozen, batch = _first_step(
        "moddiffy_par",
        **_GENDER_ONLY,
        **{
            "method.objective": "auto",
            "method.attribute_weights": "age: mmd_weight=5",
            "data.synthetic.num_train": 2000,
        },
    )
    assert run.objective_choice["objective"] == "mixed"
    step = jax.jit(common.make_train_step(substeps))
    _, metrics = step(state, frozen, batch, jax.random.PRNGKey(0))
    names = sorted(metrics)
    for term in ("swap/gender", "mmd/age", "fisher/age"):
        assert any(n.endswith(term) for n in names), (term, names)
    for term in ("mmd/gender", "fisher/gender", "swap/age"):
        assert not any(n.endswith(term) for n in names), (term, names)


def test_auto_with_every_group_judges_the_every_group_read():
    """``swap_target=0`` asks the swaps for every counterpart group: auto
    judges that read (it used to read the fewest groups that close a share
    0 of the gap, one group, and fall back to MMD on it), and the run swaps
    every group."""
    config = _par_config(
        **{"method.swap_target": 0.0, "method.auto_keep": "method.swap_target"}
    )
    ctx = train.build_context(config)
    assert ctx.config.method.objective == "swap", ctx.objective_choice
    assert ctx.config.method.swap_target == 0.0
    for attr, read in ctx.objective_choice["reads"].items():
        assert read["groups"] == read["of"] == len(ctx.swap_groups[attr]), attr


def test_auto_keeps_the_swap_fields_a_run_set():
    """objective=auto applies the swap preset after the command line's
    overrides: a field set away from the method's default keeps its value,
    the others take the preset's."""
    from moddiffy_jax import config_lib

    config = _par_config(**{"method.swap_target": 0.5, "diff.compose_prob": 0.25})
    resolved = config.copy_and_resolve_references()
    config_lib.swap_preset(resolved, keep_changed=True)
    assert resolved.method.swap_target == 0.5 and resolved.diff.compose_prob == 0.25
    assert resolved.method.swap_weight == 10.0
    assert resolved.method.swap_twin_gradient is False
    assert resolved.method.objective == "swap"
    # MoDDiffy-par: the gap rule and the task guard (stop 51).
    assert resolved.method.swap_gap_reference == 0.075
    assert resolved.method.task_guard and resolved.method.task_guard_slack == 0.1
    assert resolved.method.task_guard_start_share == pytest.approx(2 / 3)
    # The tiny phases (4 + 3 steps) are too short for the warm-up.
    assert resolved.optim.warmup_steps == 0
    # Each diff keeps the decision of what it is added to (stop 68).
    assert resolved.method.swap_distill == 3.0 and resolved.method.swap_keep_pivotal
    assert resolved.method.keep_from == "added_to"
    # objective=swap (before the overrides) sets every field.
    config_lib.swap_preset(resolved)
    assert resolved.method.swap_target == 0.75 and resolved.diff.compose_prob == 0.5


def test_auto_keeps_a_swap_field_the_command_line_set_to_its_default():
    """An explicit ``--config.diff.compose_prob=0`` equals MoDDiffy-par's
    default; main.py names it in ``method.auto_keep``, and the swap preset
    keeps it (stop 47 found it replaced by 0.5). A name outside the preset's
    fields is refused."""
    from absl import flags

    from moddiffy_jax import config_lib, main

    argv = [
        "moddiffy_jax.main",
        "--config=configs/moddiffy_par.py",
        "--config.diff.compose_prob=0",
        "--workdir=/nonexistent",
    ]
    fv = flags.FlagValues()
    main.define_flags(fv, argv)
    fv(argv)
    main.keep_command_line_swaps(fv)
    assert fv.config.method.auto_keep == "diff.compose_prob"
    resolved = fv.config.copy_and_resolve_references()
    config_lib.swap_preset(resolved, keep_changed=True)
    assert resolved.diff.compose_prob == 0.0
    assert resolved.method.swap_weight == 10.0
    # README command 1's phases (150 + 75 steps) warm up over 20 updates
    # (stop 67), unless the command line set the warm-up, also to 0.
    assert resolved.optim.warmup_steps == config_lib.SWAP_WARMUP == 20

    def preset_after(*overrides):  # the recipe over these command-line values
        given = [*argv[:2], *overrides, argv[-1]]
        values = flags.FlagValues()
        main.define_flags(values, given)
        values(given)
        main.keep_command_line_swaps(values)
        config = values.config.copy_and_resolve_references()
        config_lib.swap_preset(config, keep_changed=True)
        return config

    kept = preset_after("--config.optim.warmup_steps=0")
    assert kept.optim.warmup_steps == 0 and kept.diff.compose_prob == 0.5
    # The decision-keeping forms (stop 68): set, unless the command line
    # named them, also at the method's defaults.
    assert resolved.method.keep_from == "added_to" and resolved.method.swap_distill == 3
    off = preset_after(
        "--config.method.keep_from=core",
        "--config.method.swap_distill=0",
        "--config.method.swap_keep_pivotal=false",
    )
    assert off.method.keep_from == "core" and off.method.swap_distill == 0.0
    assert not off.method.swap_keep_pivotal and off.optim.warmup_steps == 20
    # Without the record the preset replaces the default-valued field.
    with resolved.unlocked():
        resolved.method.auto_keep = ""
    config_lib.swap_preset(resolved, keep_changed=True)
    assert resolved.diff.compose_prob == 0.5
    with resolved.unlocked():
        resolved.method.auto_keep = "diff.compose_prob, diff.keep"
    with pytest.raises(ValueError, match=r"auto_keep names \['diff.keep'\]"):
        config_lib.swap_preset(resolved, keep_changed=True)


def test_the_post_config_chooses_the_objective_unless_named():
    assert _par_config(method="moddiffy_post").method.objective == "auto"
    named = _par_config("objective=mmd", method="moddiffy_post")
    assert named.method.objective == "mmd"


def test_the_gap_reference_sets_each_attributes_swap_weight_from_its_read():
    assert swap_budget.gap_weight(10.0, 0.2, 0.08) == pytest.approx(25.0)
    assert swap_budget.gap_weight(10.0, 0.0, 0.08) == pytest.approx(2.5)  # low end
    assert swap_budget.gap_weight(10.0, 1.0, 0.08) == pytest.approx(40.0)  # high end
    overrides = {
        "method.swap_weight": 10.0,
        "method.swap_target": 0.5,
        "data.synthetic.num_train": 2000,
    }
    plain = train.build_context(tiny("moddiffy_par", **overrides))
    assert plain.debias.attribute_weights == {}
    scaled = train.build_context(
        tiny(
            "moddiffy_par",
            **overrides,
            **{
                "method.swap_gap_reference": 0.1,
                "method.attribute_weights": "gender: swap_weight=3",
            },
        )
    )
    weights = scaled.debias.attribute_weights
    # gender keeps the weight attribute_weights gives it.
    assert weights["gender"]["swap_weight"] == 3.0
    assert scaled.swap_reads["gender"]["swap_weight_from"] == "attribute_weights"
    read = scaled.swap_reads["age"]
    gap = read["reads"][0]["leakage"] - read["floor"]
    assert read["gap"] == pytest.approx(gap, abs=1e-4) and gap > 0.02
    assert weights["age"]["swap_weight"] == pytest.approx(
        swap_budget.gap_weight(10.0, gap, 0.1), rel=1e-6
    )
    assert read["swap_weight_from"] == "gap"
    # The groups and their reads are the plain run's.
    assert read["chosen"] == plain.swap_reads["age"]["chosen"]
    # swap_target 0 (every group): the no-group read alone gives the gap.
    every = train.build_context(
        tiny(
            "moddiffy_par",
            **{**overrides, "method.swap_target": 0.0},
            **{"method.swap_gap_reference": 0.1},
        )
    )
    assert every.swap_reads["age"]["gap"] == pytest.approx(read["gap"], abs=1e-4)
    assert len(every.swap_reads["age"]["reads"]) == 1
    with pytest.raises(ValueError, match="swap_gap_reference must be >= 0"):
        train.build_context(
            tiny("moddiffy_par", **overrides, **{"method.swap_gap_reference": -1.0})
        )


def _costly_first(n, seed):
    """Attribute counterparts 3/4 in the examples without a task word (there
    they are the task's only evidence, through the attribute, which equals
    the label 85% of the time) and 5/6 in those with one: merging either
    hides the attribute in half the examples, merging 3/4 costs the task
    far more."""
    rng = np.random.default_rng(seed)
    task = rng.integers(0, 2, n)
    attr = np.where(rng.random(n) < 0.85, task, 1 - task)
    has_word = rng.random(n) < 0.5
    word = np.where(has_word, np.where(rng.random(n) < 0.9, task, 1 - task) + 1, 0)
    costly = np.where(~has_word, 3 + attr, 0)
    cheap = np.where(has_word, 5 + attr, 0)
    return _split(np.column_stack([word, costly, cheap]), task, attr)


def test_the_efficiency_order_takes_the_group_that_removes_most_per_task_point():
    train_split, dev = _costly_first(4000, 0), _costly_first(4000, 1)
    groups = [[3, 4], [5, 6]]  # the costly group ranked first
    kw = {"num_task_classes": 2, "num_attr_classes": 2}
    ranked, _ = swap_budget.read_prefixes(train_split, dev, "a", groups, **kw)
    assert ranked[1].cost > 5.0  # the first ranked group is expensive
    reads, floor, order = swap_budget.efficient_order(
        train_split, dev, "a", groups, target=0.3, max_drop=20.0, **kw
    )
    assert order == (1, 0) and len(reads) == 2  # one group taken, the target met
    assert reads[1].closed >= 0.3 and reads[1].cost < ranked[1].cost - 3.0
    choice = swap_budget.choose_groups(
        train_split, dev, "a", groups, target=0.3, max_drop=20.0, efficient=True, **kw
    )
    assert choice.order == (1, 0) and choice.chosen == 1
    # Where the rank order's choice is as good, it stays (order empty).
    plain = swap_budget.choose_groups(
        train_split,
        dev,
        "a",
        groups[::-1],
        target=0.3,
        max_drop=20.0,
        efficient=True,
        **kw,
    )
    assert plain.order == () and plain.chosen == 1
    # A budget no single group fits: the first ranked group, over budget.
    over = swap_budget.efficient_order(
        train_split, dev, "a", groups, target=0.3, max_drop=-100.0, **kw
    )
    assert over[2] == (0, 1) and len(over[0]) == 2


def test_the_efficiency_order_reaches_the_swap_tables_and_a_bad_order_is_named():
    overrides = {
        "method.swap_weight": 10.0,
        "method.swap_target": 0.75,
        "data.synthetic.num_train": 2000,
        "method.swap_order": "efficiency",
    }
    ctx = train.build_context(tiny("moddiffy_par", **overrides))
    ranked = train.build_context(
        tiny("moddiffy_par", **{**overrides, "method.swap_order": "rank"})
    )
    for attr, read in ctx.swap_reads.items():
        order = read["order"] or list(range(len(ctx.swap_ranked[attr])))
        for kept, i in zip(ctx.swap_groups[attr], order, strict=False):
            np.testing.assert_array_equal(kept, ranked.swap_ranked[attr][i])
        assert len(ctx.swap_groups[attr]) == read["chosen"]
    for target in (0.75, 0.0):  # also where no prefix is read
        with pytest.raises(ValueError, match="swap_order='best' is not one of"):
            train.build_context(
                tiny(
                    "moddiffy_par",
                    **{
                        **overrides,
                        "method.swap_order": "best",
                        "method.swap_target": target,
                    },
                )
            )
