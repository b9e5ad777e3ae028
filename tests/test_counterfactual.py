"""Counterfactual token swaps (config.method.swap_weight)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax import objectives, train
from moddiffy_jax.data import synthetic
from moddiffy_jax.methods import common, conditioning
from moddiffy_jax.models import bert
from tests.helpers import core_prediction, tiny
from tests.test_substeps import _first_step


def test_the_swap_table_permutes_each_group_and_nothing_else():
    table = objectives.swap_table([[3, 7], [1, 4, 9]], vocab=10)
    np.testing.assert_array_equal(table, [0, 4, 2, 7, 9, 5, 6, 3, 8, 1])
    assert sorted(table) == list(range(10))  # a permutation
    assert np.array_equal(objectives.swap_table([], vocab=4), np.arange(4))


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([[1, 2], [2, 3]], "more than one counterpart group"),
        ([[1, 1]], "more than one counterpart group"),
        ([[1, 12]], "outside the vocabulary"),
    ],
)
def test_a_table_that_is_not_a_permutation_is_refused(groups, message):
    with pytest.raises(ValueError, match=message):
        objectives.swap_table(groups, vocab=10)


def test_the_invariance_term_reads_only_the_changed_rows_in_units_of_spread():
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(4000, 8)), jnp.float32)
    twin = jnp.asarray(rng.normal(size=(4000, 8)), jnp.float32)
    every = jnp.ones(4000, bool)
    # An unrelated twin is as far as a random other example: about 1.
    assert float(objectives.swap_invariance_loss(h, twin, every)) == pytest.approx(
        1.0, abs=0.05
    )
    assert float(objectives.swap_invariance_loss(h, h, every)) == 0.0
    # Rows the swap does not change count for nothing, gradient included.
    changed = jnp.arange(4000) < 10
    near = h.at[:10].add(0.1)
    value, grad = jax.value_and_grad(objectives.swap_invariance_loss, argnums=1)(
        h, near, changed
    )
    assert float(value) > 0.0
    assert float(jnp.abs(grad[10:]).max()) == 0.0 and float(jnp.abs(grad[:10]).max())
    none = jnp.zeros(4000, bool)
    assert float(objectives.swap_invariance_loss(h, twin, none)) == 0.0


def test_the_invariance_term_gives_nothing_for_shrinking_the_batch():
    # A diff must not meet the term by collapsing every representation: the
    # term is scale-free, and its gradient along a common scale is zero.
    rng = np.random.default_rng(2)
    h = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    twin = h + 0.3 * jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    every = jnp.ones(32, bool)

    def scaled(c):
        return objectives.swap_invariance_loss(c * h, c * twin, every)

    value, slope = jax.value_and_grad(scaled)(1.0)
    assert float(scaled(0.1)) == pytest.approx(float(value), rel=1e-5)
    assert abs(float(slope)) < 1e-5 * float(value)
    # The twin held fixed (swap_twin_gradient=False): shrinking the batch
    # away from it costs, it does not pay.
    _, own = jax.value_and_grad(
        lambda c: objectives.swap_invariance_loss(c * h, twin, every)
    )(1.0)
    assert float(own) < 0.0


def test_keeping_the_decision_directions_leaves_them_out_of_the_distance():
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
    every = jnp.ones(64, bool)
    keep = jnp.asarray(rng.normal(size=(64, 2, 8)), jnp.float32)
    along = h + jnp.einsum("bk,bkh->bh", jnp.asarray(rng.normal(size=(64, 2))), keep)
    plain = objectives.swap_invariance_loss(h, along, every)
    assert float(plain) > 0.1
    assert float(objectives.swap_invariance_loss(h, along, every, keep)) < 1e-6
    # A difference with no part along them counts in full.
    other = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
    across = h + objectives.outside(other, keep)
    np.testing.assert_allclose(
        objectives.swap_invariance_loss(h, across, every, keep),
        objectives.swap_invariance_loss(h, across, every),
        rtol=1e-4,
    )


def _head_kernel(trainable, frozen):
    for tree in (trainable, frozen):
        head = tree.get("task_head") if isinstance(tree, dict) else None
        if head is not None:
            leaves = {
                "/".join(str(getattr(k, "key", k)) for k in path): v
                for path, v in jax.tree_util.tree_flatten_with_path(head)[0]
            }
            (kernel,) = [v for k, v in leaves.items() if k.endswith("kernel")]
            return np.asarray(kernel)
    raise AssertionError("no task head")


def _marker_class(tokenizer, attribute):
    """token id -> the class whose synthetic marker words hold it."""
    out = {}
    for cls, phrases in synthetic.ATTR_MARKERS[attribute].items():
        for phrase in phrases:
            for t in tokenizer(phrase, add_special_tokens=False)["input_ids"]:
                out.setdefault(t, set()).add(cls)
    return out


def test_the_groups_pair_marker_words_of_different_classes():
    # The main job's 2,000 training examples (the tiny config's few hundred
    # rank chance tokens among the markers).
    ctx = train.build_context(
        tiny(
            "moddiffy_par",
            **{"method.swap_weight": 1.0, "data.synthetic.num_train": 2000},
        )
    )
    tokenizer = bert.load_tokenizer()
    for attr in ("gender", "age"):
        groups = ctx.swap_groups[attr]
        assert groups, attr
        classes = _marker_class(tokenizer, attr)
        for group in groups:
            assert len(group) == 2  # binary attributes: one token per class
            a, b = (classes.get(int(t), set()) for t in group)
            # Every swapped token is a marker word, and the two are markers
            # of different classes (never two female words, say).
            assert a and b and a != b, (attr, group, a, b)
        table = ctx.swap_tables[attr]
        for x, y in groups:
            assert table[x] == y and table[y] == x


def _own_tables(frozen):
    """``frozen`` without the run's swap tables (the step inputs that
    methods/swap_reread.py changes), so a loss reads the table it was built
    with."""
    return {k: v for k, v in frozen.items() if k != "swap_tables"}


def _debias_terms(ctx, attribute, debias, trainable, inputs, batch):
    """The scalar terms of ``attribute``'s debias loss (L0 phase, the run's
    swap table for it, settings ``debias``) on ``batch`` with step inputs
    ``inputs``."""
    loss = common.make_debias_loss(
        ctx.model,
        ctx.method,
        attribute,
        phase="l0",
        diff_settings=ctx.diff_settings,
        debias=debias,
        swap_table=ctx.swap_tables[attribute],
    )
    _, out = loss(trainable, inputs, batch, jax.random.PRNGKey(1))
    return {k: float(v) for k, v in out.items() if not isinstance(v, dict)}


def _gender_loss(ctx, swaps, debias=None, **more):
    """The gender debias step's loss (L0 phase) with swap table ``swaps``
    and removal settings ``debias`` (the run's by default; ``more``:
    make_debias_loss's other keywords); call it with :func:`_own_tables` of
    the run's frozen inputs."""
    return common.make_debias_loss(
        ctx.model,
        ctx.method,
        "gender",
        phase="l0",
        diff_settings=ctx.diff_settings,
        debias=ctx.debias if debias is None else debias,
        swap_table=swaps,
        **more,
    )


def test_the_debias_step_reads_the_swapped_twin():
    """With a swap table the debias loss has a ``swap/<attribute>`` term that
    is 0 for the identity table and positive for the attribute's own; the
    task forward gives the head's decision directions (swap_keep_task)."""
    ctx, _, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.swap_weight": 1.0}
    )
    table = ctx.swap_tables["gender"]
    assert np.any(table[np.asarray(batch["input_ids"])] != batch["input_ids"])
    values = {}
    for name, swaps in (("own", table), ("identity", np.arange(table.size))):
        loss = _gender_loss(ctx, swaps)
        _, terms = loss(
            state.trainable, _own_tables(frozen), batch, jax.random.PRNGKey(1)
        )
        values[name] = float(terms["swap/gender"])
    assert values["identity"] == 0.0
    assert values["own"] > 0.0
    # swap_keep_task leaves out of the distance each row's directions that
    # move the head's decision: for a linear head, its kernel's column
    # difference.
    _, _, _, _, _, _, decision = common._task_forward(
        ctx.model,
        ctx.method,
        state.trainable,
        frozen,
        batch,
        jax.random.PRNGKey(1),
        phase="l0",
        settings=ctx.diff_settings,
        attribute="gender",
    )
    h = jnp.zeros((3, ctx.model.bert_config.hidden_size))
    directions = np.asarray(decision(h))
    assert directions.shape == (3, 1, h.shape[1])
    kernel = _head_kernel(state.trainable, frozen)
    np.testing.assert_allclose(directions[0, 0], kernel[:, 1] - kernel[:, 0], atol=1e-6)


@pytest.mark.parametrize(
    ("method", "overrides", "message"),
    [
        ("moddiffy_par", {"method.swap_weight": -1.0}, "swap_weight must be >= 0"),
        ("moddiffy_par", {"method.swap_candidates": True}, "whole number >= 1"),
        ("moddiffy_par", {"method.swap_share": 2.0}, "swap_share must be in"),
        ("moddiffy_par", {"method.swap_target": 1.5}, "swap_target must be a share"),
        ("moddiffy_par", {"method.swap_max_drop": -1.0}, "swap_max_drop must be"),
        ("moddiffy_par", {"method.swap_distill": -1.0}, "swap_distill must be in"),
        (
            "moddiffy_par",
            {"method.swap_distill_pivotal": 1.0, "method.swap_keep_pivotal": False},
            "swap_keep_pivotal is off",
        ),
        (
            "moddiffy_par",
            {
                "method.swap_keep_pivotal": True,
                "method.attribute_weights": "gender: swap_distill_pivotal=1, "
                "swap_keep_pivotal=false",
            },
            "swap_distill_pivotal for 'gender'",
        ),
        ("diffprun_debias", {"method.swap_weight": 1.0}, "modular debiasing"),
    ],
)
def test_bad_swap_settings_name_the_fix(method, overrides, message):
    with pytest.raises(ValueError, match=message):
        train.build_context(tiny(method, "", **overrides))


def test_a_run_records_its_swap_groups_as_text():
    got = train.swap_group_text(tiny("moddiffy_par"), {"gender": [[2016, 2002]]})
    assert got == {"gender": [["she", "he"]]}


def test_per_attribute_swap_weights_swap_only_those_attributes():
    ctx = train.build_context(
        tiny(
            "moddiffy_par",
            **{
                "method.attribute_weights": "gender: swap_weight=2",
                "data.synthetic.num_train": 2000,
            },
        )
    )
    assert set(ctx.swap_tables) == {"gender"}


def test_a_fixed_twin_reads_the_same_term_with_a_one_sided_gradient():
    grads = {}
    for twin in (True, False):
        ctx, _, state, frozen, batch = _first_step(
            "moddiffy_par",
            **{
                "method.swap_weight": 1.0,
                "method.mmd_weight": 0.0,
                "method.fisher_weight": 0.0,
                "method.swap_twin_gradient": twin,
            },
        )
        loss = _gender_loss(ctx, ctx.swap_tables["gender"])

        def swap_term(diff, loss=loss, state=state, frozen=frozen, batch=batch):
            trainable = {**state.trainable, "diffs": {**state.trainable["diffs"]}}
            trainable["diffs"]["gender"] = diff
            _, terms = loss(trainable, frozen, batch, jax.random.PRNGKey(1))
            return terms["swap/gender"]

        value, grad = jax.value_and_grad(swap_term)(state.trainable["diffs"]["gender"])
        grads[twin] = (float(value), jax.tree.leaves(grad))
    assert grads[True][0] == pytest.approx(grads[False][0], rel=1e-6)
    assert grads[True][0] > 0.0
    assert any(
        not np.allclose(a, b)
        for a, b in zip(grads[True][1], grads[False][1], strict=True)
    )


def test_a_composing_twin_also_swaps_the_added_diffs_words():
    """swap_compose: where a debias step adds another attribute's diff, its
    twin also swaps that attribute's words; the gender step with an identity
    table of its own then reads age's swaps, and only when asked to."""
    ctx, _, state, frozen, batch = _first_step(
        "moddiffy_par",
        **{
            "method.swap_weight": 1.0,
            "diff.compose_prob": 1.0,
            "data.synthetic.num_train": 2000,
        },
    )
    age = ctx.swap_tables["age"]
    ids = np.asarray(batch["input_ids"])
    assert np.any(age[ids] != ids)
    identity = np.arange(age.size)
    values = {}
    for name, others in (("composed", {"age": age}), ("alone", None)):
        loss = _gender_loss(
            ctx, identity, others=("age",), others_prob=1.0, other_swap_tables=others
        )
        _, terms = loss(
            state.trainable, _own_tables(frozen), batch, jax.random.PRNGKey(1)
        )
        values[name] = float(terms["swap/gender"])
    assert values["alone"] == 0.0
    assert values["composed"] > 0.0
    assert not ctx.debias.swap_compose  # off unless asked for


def test_objective_swap_trains_with_the_swaps_alone():
    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par", arg="objective=swap", **{"data.synthetic.num_train": 2000}
    )
    assert ctx.debias.objective == "swap" and ctx.debias.swap_weight == 10.0
    assert set(ctx.swap_tables) == {"gender", "age"}
    # The groups a bag-of-tokens read chooses (stop 40), not every group.
    assert ctx.debias.swap_target == 0.75 and set(ctx.swap_reads) == {"gender", "age"}
    assert not {"mmd_stats", "fisher_stats", "adversaries"} & set(state.trainable)
    gender = [s for s in substeps if s.name == "debias/gender"]
    _, metrics = jax.jit(common.make_train_step(gender))(
        state, frozen, batch, jax.random.PRNGKey(0)
    )
    terms = {k.split("/")[-2] for k in metrics if k.startswith("debias/gender/")}
    assert "swap" in terms and not {"mmd", "fisher", "adv"} & terms, sorted(metrics)


def test_objective_swap_without_a_weight_names_the_fix():
    config = tiny("moddiffy_par", "objective=swap", **{"method.swap_weight": 0.0})
    with pytest.raises(ValueError, match="set config.method.swap_weight > 0"):
        train.build_context(config)


def test_decision_moved_marks_rows_whose_argmax_the_swap_changes():
    core = jnp.log(jnp.array([[0.9, 0.1], [0.4, 0.6], [0.2, 0.8]]))
    twin = jnp.log(jnp.array([[0.6, 0.4], [0.7, 0.3], [0.1, 0.9]]))
    np.testing.assert_array_equal(
        np.asarray(objectives.decision_moved(core, twin)), [0.0, 1.0, 0.0]
    )


def _with_head_bias(tree, bias):
    """``tree`` with the task head's bias set to ``bias`` (a decision the
    encoder cannot move)."""

    def put(path, leaf):
        names = "/".join(str(getattr(k, "key", k)) for k in path)
        return (
            jnp.asarray(bias, leaf.dtype)
            if "task_head" in names and names.endswith("bias")
            else leaf
        )

    return jax.tree_util.tree_map_with_path(put, tree)


def test_keep_pivotal_keeps_the_decision_only_where_the_swap_moves_it():
    """``swap_keep_pivotal``: where the swap moves no decision of the core
    (a head bias no representation outweighs) the term is the whole
    distance; otherwise it lies between swap_keep_task's and the whole."""
    ctx, _, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.swap_weight": 1.0}
    )
    table = ctx.swap_tables["gender"]

    def term(trainable, frozen_tree, **switches):
        loss = _gender_loss(ctx, table, dataclasses.replace(ctx.debias, **switches))
        _, out = loss(trainable, _own_tables(frozen_tree), batch, jax.random.PRNGKey(1))
        return float(out["swap/gender"])

    whole = term(state.trainable, frozen)
    kept = term(state.trainable, frozen, swap_keep_task=True)
    pivotal = term(state.trainable, frozen, swap_keep_pivotal=True)
    assert kept < whole
    assert kept - 1e-6 <= pivotal <= whole + 1e-6
    fixed = (
        _with_head_bias(state.trainable, [1e4, 0.0]),
        _with_head_bias(frozen, [1e4, 0.0]),
    )
    assert term(*fixed, swap_keep_pivotal=True) == pytest.approx(term(*fixed), rel=1e-6)
    assert term(*fixed, swap_keep_task=True) < term(*fixed)


def test_the_teachers_batch_and_twin_reads_are_one_pass_of_the_same_rows():
    """``conditioning.teacher_passes``: the teacher's reads on the batch and
    on its twin come from one pass over the two stacked, and equal two
    separate passes row for row (padding rows included)."""
    ctx, _, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.swap_weight": 1.0}
    )
    ids = np.asarray(batch["input_ids"])
    twin_ids = ctx.swap_tables["gender"][ids]
    assert np.any(twin_ids != ids) and np.any(np.asarray(batch["attention_mask"]) == 0)
    calls = []

    def predict(batch):
        calls.append(batch["input_ids"].shape[0])
        return core_prediction(ctx, state.trainable, frozen, batch)

    on_batch, on_twin = conditioning.teacher_passes(predict, batch, twin_ids)
    got_batch, got_twin = on_batch(), on_twin()
    assert calls == [2 * ids.shape[0]]  # one pass, read twice
    np.testing.assert_allclose(got_batch, predict(batch), rtol=1e-5, atol=1e-6)
    alone = predict({**batch, "input_ids": jnp.asarray(twin_ids)})
    np.testing.assert_allclose(got_twin, alone, rtol=1e-5, atol=1e-6)
    only, none = conditioning.teacher_passes(predict, batch)
    assert none is None and only() is only()


def test_kl_where_averages_over_the_chosen_rows_only():
    teacher = jnp.log(jnp.array([[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]))
    logits = jnp.log(jnp.array([[0.5, 0.5], [0.5, 0.5], [0.2, 0.8]]))
    kl_row1 = 0.9 * np.log(0.9 / 0.5) + 0.1 * np.log(0.1 / 0.5)
    rows = jnp.array([True, True, False])
    got = float(objectives.kl_where(teacher, logits, rows))
    assert got == pytest.approx(kl_row1 / 2, rel=1e-5)
    assert float(objectives.kl_where(teacher, logits, ~rows)) == pytest.approx(
        0.0, abs=1e-6
    )
    assert float(objectives.kl_where(teacher, logits, jnp.zeros(3, bool))) == 0.0


def test_swap_distill_is_the_task_distill_term_on_unswapped_rows():
    """With a swap that changes no row, ``swap_distill`` is the KL to the
    core's prediction over the whole batch: task_distill's term at the same
    weight; with the attribute's own swap it reads fewer rows."""
    ctx, _, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.swap_weight": 1.0}
    )
    table = ctx.swap_tables["gender"]
    debias = dataclasses.replace(ctx.debias, swap_distill=2.0, task_distill=2.0)
    got = {}
    for name, swaps in (("identity", np.arange(table.size)), ("own", table)):
        loss = _gender_loss(ctx, swaps, debias)
        _, terms = loss(
            state.trainable, _own_tables(frozen), batch, jax.random.PRNGKey(1)
        )
        got[name] = {k: float(terms[k]) for k in ("distill", "distill_unswapped")}
    assert got["identity"]["distill"] > 0.0
    assert got["identity"]["distill_unswapped"] == pytest.approx(
        got["identity"]["distill"], rel=1e-5
    )
    assert got["own"]["distill_unswapped"] != pytest.approx(
        got["own"]["distill"], rel=1e-3
    )


def test_swap_distill_pivotal_is_the_kl_on_both_twins_where_the_decision_moves(
    monkeypatch,
):
    """``swap_distill_pivotal`` reads only the rows whose swap moves the
    core's decision, on the batch and on its twin: none under the identity
    swap; with every row counted as moved, under the identity swap (the twin
    is the batch) twice task_distill's KL at the same weight, and under the
    attribute's own swap something else (the twin's own teacher and logits)."""
    ctx, _, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.swap_weight": 1.0}
    )
    table = ctx.swap_tables["gender"]
    debias = dataclasses.replace(
        ctx.debias, swap_keep_pivotal=True, swap_distill_pivotal=2.0, task_distill=2.0
    )

    def terms_with(swaps):
        loss = _gender_loss(ctx, swaps, debias)
        _, terms = loss(
            state.trainable, _own_tables(frozen), batch, jax.random.PRNGKey(1)
        )
        return {k: float(terms[k]) for k in ("distill", "distill_pivotal")}

    identity = np.arange(table.size)
    none = terms_with(identity)
    assert none["distill"] > 0.0 and none["distill_pivotal"] == 0.0
    monkeypatch.setattr(
        objectives, "decision_moved", lambda core, twin: jnp.ones(core.shape[:1])
    )
    same = terms_with(identity)
    assert same["distill_pivotal"] == pytest.approx(2 * same["distill"], rel=1e-5)
    own = terms_with(table)
    assert own["distill_pivotal"] != pytest.approx(2 * own["distill"], rel=1e-3)


def test_task_target_core_decision_fits_the_cores_argmax_not_the_gold_label():
    """With the head's bias set so that the core decides class 0 on every
    row, the gold labels cost the diff's task term ~1e4 on the rows labelled
    1, and the core's decisions (``task_target="core_decision"``) nothing."""
    ctx, _, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.swap_weight": 1.0}
    )
    assert 0 < int(np.sum(batch["task"])) < batch["task"].size  # both labels
    trainable = _with_head_bias(state.trainable, [1e4, 0.0])
    frozen = _own_tables(_with_head_bias(frozen, [1e4, 0.0]))
    got = {}
    for target in ("gold", "core_decision"):
        debias = dataclasses.replace(ctx.debias, task_target=target)
        loss = _gender_loss(ctx, ctx.swap_tables["gender"], debias)
        _, terms = loss(trainable, frozen, batch, jax.random.PRNGKey(1))
        got[target] = float(terms["task"])
    assert got["gold"] > 100.0
    assert got["core_decision"] < 1e-3


def test_a_bad_task_target_names_the_choices():
    with pytest.raises(ValueError, match="task_target='label'.*core_decision"):
        train.build_context(tiny("moddiffy_par", **{"method.task_target": "label"}))
