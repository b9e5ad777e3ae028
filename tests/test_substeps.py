"""The train step's sub-steps on the tiny config, one step at a time: each
touches only its own parts, the removal terms and their running statistics,
the task guard, warm-up, distillation, and the attributes' shared debias
sub-step (one program for all attributes, the same arithmetic)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax import train
from moddiffy_jax.methods import common, removal
from tests.helpers import core_prediction, tiny


def _first_step(method, phase="l0", arg="", **overrides):
    config = tiny(method, arg, **overrides)
    ctx = train.build_context(config)
    trainable, frozen = ctx.method.init(ctx, jax.random.PRNGKey(0))
    substeps = ctx.method.substeps(ctx, phase, trainable)
    state = common.TrainState(
        step=common.jnp_zero_step(),
        trainable=trainable,
        opt_states=common.init_opt_states(substeps, trainable),
    )
    from moddiffy_jax.data import TrainIterator

    batch = next(TrainIterator(ctx.data.splits["train"], batch_size=8, seed=0))
    return ctx, substeps, state, frozen, batch


def test_debias_steps_touch_only_their_diff():
    """Each sub-step changes only its own parts; the frozen tree is untouched."""
    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par", arg="objective=adversarial"
    )
    frozen_before = jax.tree.map(np.array, frozen)
    gender_only = [s for s in substeps if s.name == "debias/gender"]
    step = jax.jit(common.make_train_step(gender_only))
    before = jax.tree.map(np.array, state.trainable)
    new, metrics = step(state, frozen, batch, jax.random.PRNGKey(0))
    after = jax.tree.map(np.array, new.trainable)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    changed = lambda a, b: any(  # noqa: E731
        not np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    assert changed(before["diffs"]["gender"], after["diffs"]["gender"])
    assert changed(before["adversaries"]["gender"], after["adversaries"]["gender"])
    for key in ("core",):
        assert not changed(before[key], after[key])
    assert not changed(before["diffs"]["age"], after["diffs"]["age"])
    assert not changed(before["adversaries"]["age"], after["adversaries"]["age"])
    assert not changed(frozen_before, frozen)


def test_task_distill_term_reads_the_core_without_gradient():
    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.task_distill": 2.0}
    )
    gender_only = [s for s in substeps if s.name == "debias/gender"]
    loss = jax.jit(common.stored_loss(gender_only[0]))  # compiled: faster than op by op
    rng = jax.random.PRNGKey(0)
    _, terms = loss(state.trainable, frozen, batch, rng)
    assert float(terms["distill"]) >= 0.0 and np.isfinite(float(terms["distill"]))
    # The teacher is the core without the diff, a distribution, and carries
    # no gradient.
    teacher = core_prediction(ctx, state.trainable, frozen, batch)
    grad = jax.jit(
        jax.grad(
            lambda t: jnp.sum(
                common._core_prediction(
                    ctx.model,
                    ctx.method,
                    t,
                    frozen,
                    batch,
                    phase="l0",
                    settings=ctx.diff_settings,
                )
            )
        )
    )(state.trainable)
    assert not any(np.any(np.asarray(g)) for g in jax.tree.leaves(grad))
    np.testing.assert_allclose(np.exp(np.asarray(teacher)).sum(-1), 1.0, rtol=1e-5)
    off = _first_step("moddiffy_par")[1]
    _, terms_off = jax.jit(
        common.stored_loss([s for s in off if s.name == "debias/gender"][0])
    )(state.trainable, frozen, batch, rng)
    assert "distill" not in terms_off


def test_task_guard_backs_off_removal_while_the_diff_costs_the_task():
    """The guard's dual step: the backoff rises by rate * (gap - slack) while
    the diff trails the core, falls back to 0 when it does not, and the
    removal terms are scaled by exp(-backoff) of the state before the step."""
    settings = removal.DebiasSettings(
        objective="mmd",
        adv_lambda=1.0,
        mmd_weight=1.0,
        attr_classes={"gender": 2},
        task_guard=True,
        task_guard_slack=0.01,
        task_guard_rate=2.0,
        task_guard_decay=0.5,
    )
    update = jax.jit(
        lambda st, core, diff: removal.guard_update(st, core, diff, settings)
    )
    state = {"gap": jnp.zeros(()), "backoff": jnp.zeros(())}
    state = update(state, jnp.asarray(0.9), jnp.asarray(0.7))
    np.testing.assert_allclose(state["gap"], 0.1, rtol=1e-6)
    np.testing.assert_allclose(state["backoff"], 2.0 * (0.1 - 0.01), rtol=1e-6)
    for _ in range(50):  # the diff now matches the core: the gap decays.
        state = update(state, jnp.asarray(0.9), jnp.asarray(0.9))
    assert float(state["backoff"]) == 0.0  # clipped at 0, never a boost.

    # From task_guard_start on: before it the gap is tracked, the weight kept.
    late = dataclasses.replace(settings, task_guard_start=5)
    state = {"gap": jnp.zeros(()), "backoff": jnp.zeros(())}
    for step in range(5):
        state = removal.guard_update(
            state, jnp.asarray(0.9), jnp.asarray(0.7), late, jnp.asarray(step)
        )
        assert float(state["backoff"]) == 0.0
    assert float(state["gap"]) > 0.1
    moved = removal.guard_update(
        state, jnp.asarray(0.9), jnp.asarray(0.7), late, jnp.asarray(5)
    )
    assert float(moved["backoff"]) > 0.2

    # task_guard_release: the step while the gap is under the slack (the
    # weight coming back) is that many times larger; over it, unchanged.
    quick = dataclasses.replace(settings, task_guard_release=4.0)
    held = {"gap": jnp.asarray(0.3), "backoff": jnp.asarray(2.0)}
    for core, diff in ((0.9, 0.9), (0.9, 0.4)):
        slow = removal.guard_update(held, core, diff, settings)
        fast = removal.guard_update(held, core, diff, quick)
        np.testing.assert_allclose(slow["gap"], fast["gap"])
        step_slow = float(slow["backoff"]) - 2.0
        step_fast = float(fast["backoff"]) - 2.0
        if float(slow["gap"]) < settings.task_guard_slack:
            raise AssertionError("the first case must stay over the slack")
        np.testing.assert_allclose(step_fast, step_slow, rtol=1e-6)
    under = {"gap": jnp.asarray(0.0), "backoff": jnp.asarray(2.0)}
    slow = removal.guard_update(under, 0.9, 0.9, settings)
    fast = removal.guard_update(under, 0.9, 0.9, quick)
    np.testing.assert_allclose(float(slow["backoff"]), 2.0 - 2.0 * 0.01, rtol=1e-6)
    np.testing.assert_allclose(float(fast["backoff"]), 2.0 - 4 * 2.0 * 0.01, rtol=1e-6)

    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.task_guard": True}
    )
    guard = state.trainable[removal.TASK_GUARD]
    assert set(guard["attrs"]) == {"gender", "age"}
    backed_off = common.set_part(
        state.trainable,
        (removal.TASK_GUARD, "attrs", "gender", "backoff"),
        jnp.asarray(np.log(4.0), jnp.float32),
    )
    gender = [s for s in substeps if s.name == "debias/gender"][0]
    rng = jax.random.PRNGKey(0)
    loss = jax.jit(common.stored_loss(gender))  # compiled once: faster than op by op
    _, full = loss(state.trainable, frozen, batch, rng)
    _, quarter = loss(backed_off, frozen, batch, rng)
    np.testing.assert_allclose(
        quarter["mmd/gender"], full["mmd/gender"] / 4.0, rtol=1e-5
    )
    np.testing.assert_allclose(quarter["task"], full["task"], rtol=1e-6)
    # One program per distinct sub-step (the two debias sub-steps share one).
    step = common.compile_train_step(substeps, donate=False)
    new, metrics = step(state, frozen, batch, rng)
    # The task step wrote the core's batch accuracy; each debias step its gap.
    core_acc = float(new.trainable[removal.TASK_GUARD]["core_acc"])
    assert 0.0 <= core_acc <= 1.0
    for attr in ("gender", "age"):
        gap = float(new.trainable[removal.TASK_GUARD]["attrs"][attr]["gap"])
        assert gap == pytest.approx(float(metrics[f"debias/{attr}/guard/gap"]))
        assert 0.0 < float(metrics[f"debias/{attr}/guard/weight"]) <= 1.0
    off = _first_step("moddiffy_par")[2]
    assert removal.TASK_GUARD not in off.trainable


@pytest.mark.parametrize("within", ["attribute", "cell"])
def test_whitened_mmd_updates_only_its_attributes_statistics(within):
    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par",
        **{"method.mmd_whiten": True, "method.mmd_whiten_within": within},
    )
    stats = state.trainable[removal.MMD_STATS]
    assert set(stats) == {"gender", "age"}
    assert stats["gender"]["cov"].shape == (ctx.model.feature_dim,) * 2
    gender_only = [s for s in substeps if s.name == "debias/gender"]
    new, metrics = jax.jit(common.make_train_step(gender_only))(
        state, frozen, batch, jax.random.PRNGKey(0)
    )
    assert np.isfinite(float(metrics["debias/gender/mmd/gender"]))
    after = new.trainable[removal.MMD_STATS]
    decay = ctx.debias.mmd_whiten_decay
    np.testing.assert_allclose(float(after["gender"]["weight"]), 1.0 - decay)
    cov = np.asarray(after["gender"]["cov"]) / (1.0 - decay)
    np.testing.assert_allclose(cov, cov.T, atol=1e-5)
    assert np.all(np.linalg.eigvalsh(cov) > -1e-4) and np.trace(cov) > 0
    assert float(after["age"]["weight"]) == 0.0
    assert not np.any(np.asarray(after["age"]["cov"]))
    # Degrees of freedom: rows minus the groups whose scatter is pooled
    # (gender values, or (task, gender) cells).
    gender = np.asarray(batch["attrs"]["gender"])
    groups = gender if within == "attribute" else 2 * np.asarray(batch["task"]) + gender
    dof = len(gender) - len(np.unique(groups))
    np.testing.assert_allclose(float(after["gender"]["rows"]), (1.0 - decay) * dof)


def test_running_erasure_needs_the_whitened_mmd():
    with pytest.raises(ValueError, match="reads the whitened MMD"):
        train.build_context(
            tiny(
                "moddiffy_par",
                "objective=adversarial",
                **{"method.fisher_weight": 1.0},
            )
        )


def test_running_erasure_keeps_per_stratum_mean_differences():
    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par",
        **{
            "method.mmd_whiten": True,
            "method.fisher_weight": 2.0,
            "method.mmd_conditional": "stratify",
        },
    )
    stats = state.trainable[removal.FISHER_STATS]
    dim = ctx.model.feature_dim
    assert stats["gender"]["diff"].shape == (2, dim)  # one pair per task class
    gender_only = [s for s in substeps if s.name == "debias/gender"]
    new, metrics = jax.jit(common.make_train_step(gender_only))(
        state, frozen, batch, jax.random.PRNGKey(0)
    )
    assert np.isfinite(float(metrics["debias/gender/fisher/gender"]))
    after = new.trainable[removal.FISHER_STATS]
    task = np.asarray(batch["task"])
    gender = np.asarray(batch["attrs"]["gender"])
    for t in range(2):
        both = len(np.unique(gender[task == t])) == 2
        weight = float(after["gender"]["weight"][t])
        decay = ctx.debias.fisher_decay
        assert weight == pytest.approx((1.0 - decay) if both else 0.0)
    assert not np.any(np.asarray(after["age"]["diff"]))
    off = _first_step("moddiffy_par", **{"method.fisher_weight": 0.0})[2]
    assert removal.FISHER_STATS not in off.trainable


def test_erased_targets_need_the_whitened_mmd():
    with pytest.raises(ValueError, match="target_weight > 0 reads the whitened"):
        train.build_context(
            tiny(
                "moddiffy_par",
                "objective=adversarial",
                **{"method.target_weight": 1.0},
            )
        )


def test_erased_targets_keep_running_cell_means_of_the_core():
    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.target_weight": 3.0}
    )
    stats = state.trainable[removal.TARGET_STATS]
    dim = ctx.model.feature_dim
    assert stats["gender"]["sum"].shape == (2, 2, dim)  # (task class, value)
    gender_only = [s for s in substeps if s.name == "debias/gender"]
    new, metrics = jax.jit(common.make_train_step(gender_only))(
        state, frozen, batch, jax.random.PRNGKey(0)
    )
    assert float(metrics["debias/gender/target/gender"]) > 0.0
    after = new.trainable[removal.TARGET_STATS]
    counts = np.zeros((2, 2))
    np.add.at(
        counts, (np.asarray(batch["task"]), np.asarray(batch["attrs"]["gender"])), 1
    )
    decay = ctx.debias.target_decay
    np.testing.assert_allclose(
        after["gender"]["weight"], (1.0 - decay) * counts, rtol=1e-6
    )
    assert not np.any(np.asarray(after["age"]["sum"]))
    off = _first_step("moddiffy_par", **{"method.target_weight": 0.0})[2]
    assert removal.TARGET_STATS not in off.trainable


def test_the_anchor_is_the_core_under_the_same_dropout():
    """With the diff at 0 (its start), the erased targets' anchor is exactly
    the debias step's own representation: same dropout, no diff."""
    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.target_weight": 3.0}
    )
    assert ctx.model.bert_config.hidden_dropout_prob > 0.0
    method = ctx.method
    kwargs = dict(phase="l0", settings=ctx.diff_settings)
    rng = jax.random.PRNGKey(3)
    h = common._task_forward(
        ctx.model,
        method,
        state.trainable,
        frozen,
        batch,
        rng,
        attribute="gender",
        **kwargs,
    )[0]
    anchor = common._undebiased_representation(
        ctx.model, method, state.trainable, frozen, batch, rng, **kwargs
    )
    np.testing.assert_allclose(h, anchor, atol=1e-6)
    other = common._undebiased_representation(
        ctx.model,
        method,
        state.trainable,
        frozen,
        batch,
        jax.random.PRNGKey(4),
        **kwargs,
    )
    assert not np.allclose(h, other, atol=1e-3)  # dropout is on


def test_removal_warms_up_from_zero():
    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par", **{"method.removal_warmup_steps": 4}
    )
    gender = [s for s in substeps if s.name == "debias/gender"][0]
    rng = jax.random.PRNGKey(0)
    loss = jax.jit(common.stored_loss(gender))  # compiled: faster than op by op
    _, full = loss(state.trainable, frozen, batch, rng)
    for step, factor in ((0, 0.0), (1, 0.25), (8, 1.0)):
        _, terms = loss(
            state.trainable, frozen, {**batch, common.STEP_KEY: jnp.int32(step)}, rng
        )
        np.testing.assert_allclose(
            terms["mmd/gender"], factor * full["mmd/gender"], rtol=1e-5, atol=1e-7
        )
        np.testing.assert_allclose(terms["task"], full["task"], rtol=1e-6)
    # In the train step the counter is the state's step: at 0 no removal.
    new, metrics = jax.jit(common.make_train_step([gender]))(state, frozen, batch, rng)
    assert float(metrics["debias/gender/mmd/gender"]) == 0.0


def test_auto_conditioning_follows_the_training_table():
    # Gender follows the task with correlation 0.8 (smallest cell ~5% of the
    # data: ~1.6 members in a batch of 32), age with 0.5 (~12.5%: ~4).
    config = tiny(
        "moddiffy_par",
        **{"method.mmd_conditional": "auto", "train.batch_size": 32},
    )
    settings = train.build_context(config).debias
    assert settings.mmd_conditional_by_attr == {
        "gender": "reweight",
        "age": "stratify",
    }
    assert removal.auto_conditioning([[0.25, 0.25], [0.25, 0.25]], 8) == "reweight"
    assert removal.auto_conditioning([[0.25, 0.25], [0.25, 0.25]], 12) == "stratify"


def test_attributes_debias_sub_steps_trace_once_and_match_the_whole_step():
    """With equal removal settings the attributes' debias sub-steps are one
    loss over the attribute's view: the separately compiled step traces it
    once (not once per attribute) and computes what one loss per attribute,
    jitted as one program, computes: metric names and stored layout included."""
    ctx, substeps, state, frozen, batch = _first_step("moddiffy_par")
    debias = [s for s in substeps if s.name.startswith("debias/")]
    assert [s.attribute for s in debias] == ["gender", "age"]
    substeps = debias  # the task step is not shared (and compiles slowly)
    state = state.replace(opt_states={s.name: state.opt_states[s.name] for s in debias})
    assert debias[0].loss is debias[1].loss
    traces = []

    def counting(loss):
        def traced(*args):
            traces.append(loss)
            return loss(*args)

        return traced

    wrapped = {id(s.loss): counting(s.loss) for s in substeps}
    counted = [dataclasses.replace(s, loss=wrapped[id(s.loss)]) for s in substeps]
    # The reference: one loss per attribute, written for its own name (as
    # before the sharing), the whole step jitted as one program.
    own = [
        s
        if s.attribute is None
        else common.SubStep(
            s.name,
            common.stored_updates(s),
            common.make_debias_loss(
                ctx.model,
                ctx.method,
                s.attribute,
                phase="l0",
                diff_settings=ctx.diff_settings,
                debias=ctx.debias,
            ),
            s.optimizer,
        )
        for s in substeps
    ]
    rng = jax.random.PRNGKey(3)
    whole, m_whole = jax.jit(common.make_train_step(own))(state, frozen, batch, rng)
    copy = jax.tree.map(jnp.array, state)  # the compiled step donates its input
    split, m_split = common.compile_train_step(counted)(copy, frozen, batch, rng)
    assert len(traces) == 1  # one debias loss for both attributes
    assert sorted(m_split) == sorted(m_whole)
    assert "debias/age/mmd/age" in m_split
    for a, b in ((whole, split), (m_whole, m_split)):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-6)
    # Each attribute's own labels and diff: the two diffs moved apart.
    gender, age = (
        jax.tree.leaves(split.trainable["diffs"][a]) for a in ("gender", "age")
    )
    assert any(not np.array_equal(x, y) for x, y in zip(gender, age, strict=True))


def test_the_swap_recipes_task_guard_leaves_a_step_it_does_not_act_on_unchanged():
    """MoDDiffy-par's swap recipe turns the task guard on from two thirds of
    the L0 phase (tiny: 4 steps, from step 3); before that, and wherever the
    diff keeps within the slack, its weight is exactly 1 and the step equals
    the unguarded one bit for bit."""
    on = _first_step("moddiffy_par", arg="objective=swap")
    off = _first_step(
        "moddiffy_par", arg="objective=swap", **{"method.task_guard": False}
    )
    assert on[0].debias.task_guard and on[0].debias.task_guard_start == 3
    assert on[0].debias.swap_weight > 0 and not off[0].debias.task_guard
    # The recipe's decision-keeping forms reach the debias steps (stop 68).
    assert on[0].debias.swap_keep_pivotal and on[0].debias.swap_distill == 3.0
    assert on[0].debias.keep_from == "added_to"
    new = []
    for _ctx, substeps, state, frozen, batch in (on, off):
        step = jax.jit(common.make_train_step(substeps))
        new.append(step(state, frozen, batch, jax.random.PRNGKey(0))[0].trainable)
    for part in ("core", "diffs"):
        for x, y in zip(
            jax.tree.leaves(new[0][part]), jax.tree.leaves(new[1][part]), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # results.json and the printed table say where the guard left each diff.
    from moddiffy_jax.eval.report import guard_line

    guard = common.set_part(
        new[0], ("task_guard", "attrs", "age", "backoff"), jnp.asarray(np.log(4.0))
    )["task_guard"]
    summary = train.guard_summary(on[0].debias, guard)
    assert summary["final_weight"] == {"gender": 1.0, "age": 0.25}
    assert summary["start_step"] == 3 and summary["slack"] == 0.1
    assert summary["release"] == 1.0
    line = guard_line(summary)
    assert "age 0.25 (backed off" in line and "gender 1.00" in line
    assert "gender 1.00 (" not in line and "from step 3" in line
    assert "faster" not in line
    assert "from step 3, returning 4x faster)" in guard_line(summary | {"release": 4.0})
    # A frozen core in fixmask has no task step to read the core from: where
    # the recipe follows the overrides (objective auto) it leaves the guard
    # off; objective=swap sets it first, and the clash names the fix.
    from moddiffy_jax import config_lib

    config = tiny("moddiffy_par", **{"diff.freeze_core_in_fixmask": True})
    resolved = config.copy_and_resolve_references()
    config_lib.swap_preset(resolved, keep_changed=True)
    assert resolved.method.swap_gap_reference == 0.075
    assert not resolved.method.task_guard
    config = tiny(
        "moddiffy_par", "objective=swap", **{"diff.freeze_core_in_fixmask": True}
    )
    with pytest.raises(ValueError, match="turn one of them off"):
        train.build_context(config)


def test_a_frozen_core_in_fixmask_drops_the_task_sub_step():
    ctx, substeps, state, frozen, batch = _first_step(
        "moddiffy_par", **{"diff.freeze_core_in_fixmask": True}
    )
    assert [s.name for s in substeps][0] == "task"  # the L0 phase trains it
    fixmask = ctx.method.substeps(ctx, "fixmask", state.trainable)
    assert [s.name for s in fixmask] == ["debias/gender", "debias/age"]
    paper = _first_step("moddiffy_par")[0]
    assert ctx.method.substeps(paper, "fixmask", state.trainable)[0].name == "task"
    for method, extra, message in (
        ("diffprun", {}, "only moddiffy_par trains a core"),
        ("moddiffy_par", {"method.task_guard": True}, "turn one of them off"),
    ):
        config = tiny(method, **{"diff.freeze_core_in_fixmask": True, **extra})
        with pytest.raises(ValueError, match=message):
            train.build_context(config)


class _Teacher(Exception):
    """Raised by the spy below with the teacher's encoder kernel."""


def test_keep_from_added_to_reads_the_diffs_the_step_added(monkeypatch):
    """``keep_from="added_to"``: the core-reading terms' teacher is the
    core with the other diffs the composing step added (here always:
    ``compose_prob=1``); ``"core"``: the core alone. Read from the encoder
    params the teacher is called with (the step op by op, up to that call)."""
    fields = {"method.task_distill": 2.0, "diff.compose_prob": 1.0}
    ctx, substeps, state, frozen, batch = _first_step("moddiffy_par", **fields)
    debias = dataclasses.replace(ctx.debias, keep_from="added_to")
    added = ctx.method.substeps(
        dataclasses.replace(ctx, debias=debias), "l0", state.trainable
    )
    age = state.trainable["diffs"]["age"]
    moved = dataclasses.replace(age, delta=jax.tree.map(lambda x: x + 0.3, age.delta))
    trainable = {**state.trainable, "diffs": {**state.trainable["diffs"], "age": moved}}

    def kernel(params):
        return np.asarray(params["encoder"]["layer_0"]["output"]["dense"]["kernel"])

    def spy(model, method, t, *args, **kwargs):
        raise _Teacher(kernel(t["core"]))

    monkeypatch.setattr(common, "_core_prediction", spy)
    teachers = []
    for steps in (substeps, added):
        step = [s for s in steps if s.name == "debias/gender"][0]
        with jax.disable_jit(), pytest.raises(_Teacher) as got:
            common.stored_loss(step)(trainable, frozen, batch, jax.random.PRNGKey(0))
        teachers.append(got.value.args[0])
    core = kernel(trainable["core"])
    np.testing.assert_array_equal(teachers[0], core)
    np.testing.assert_allclose(teachers[1], core + 0.3, rtol=1e-6)
    with pytest.raises(ValueError, match="keep_from='diff'.*added_to"):
        train.build_context(tiny("moddiffy_par", **{"method.keep_from": "diff"}))
