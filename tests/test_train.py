"""End-to-end training on the tiny config: every method, the first steps'
invariants, bad input. (The MoDDiffy-par run, its resumes and its data-parallel
twins: tests/test_par_runs.py.)"""

import dataclasses
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax import checkpoints, train
from moddiffy_jax.config_lib import experiment_config, parse_arg
from moddiffy_jax.methods import METHODS, common, registry, removal
from moddiffy_jax.subnets import diffs as diffs_lib
from tests.helpers import check_run, exported_diffs, tiny

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("finetune")
    return workdir, train.train_and_evaluate(tiny("finetune"), workdir)


@pytest.mark.parametrize(
    "method",
    sorted(
        m
        for m in METHODS
        if m not in ("moddiffy_par", "finetune", "moddiffy_post")
        and not m.startswith("srnets")  # tests/test_srnets.py
        and m != "ffw"  # tests/test_ffw.py
        and m != "lora_debias"  # tests/test_lora.py
    ),
)
def test_method_runs(method, tmp_path):
    results = train.train_and_evaluate(tiny(method), tmp_path)
    check_run(tmp_path, results, method)
    task_diff = {"diffprun", "diffprun_debias", "lora"}  # a task diff, no other
    expected = ["task"] if method in task_diff else []
    assert [f.stem for f in exported_diffs(tmp_path)] == expected


def test_finetune_then_post(finetune_run, tmp_path):
    ft_dir, ft_results = finetune_run
    check_run(ft_dir, ft_results, "finetune")
    config = tiny("moddiffy_post", **{"method.core_run": str(ft_dir)})
    results = train.train_and_evaluate(config, tmp_path)
    core = check_run(tmp_path, results, "moddiffy_post")
    # The frozen core is exactly the finetune run's core.
    ft_core, _ = checkpoints.load_params(ft_dir / "export" / "core.safetensors")
    for x, y in zip(jax.tree.leaves(core), jax.tree.leaves(ft_core), strict=True):
        np.testing.assert_array_equal(x, y)
    # Post-hoc diffs load on the finetune core and are refused elsewhere.
    for f in exported_diffs(tmp_path):
        diffs_lib.load_sparse_diff(f, base=ft_core)
        other = jax.tree.map(lambda x: x + 1.0, ft_core)
        with pytest.raises(ValueError, match="fingerprint"):
            diffs_lib.load_sparse_diff(f, base=other)


def test_post_without_core_run_is_refused(tmp_path):
    with pytest.raises(ValueError, match="core_run"):
        train.train_and_evaluate(tiny("moddiffy_post"), tmp_path)
    with pytest.raises(FileNotFoundError, match="finetune run"):
        train.train_and_evaluate(
            tiny("moddiffy_post", **{"method.core_run": str(tmp_path / "nope")}),
            tmp_path / "run",
        )


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
    teacher = common._core_prediction(
        ctx.model,
        ctx.method,
        state.trainable,
        frozen,
        batch,
        phase="l0",
        settings=ctx.diff_settings,
    )
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
    _, full = common.stored_loss(gender)(state.trainable, frozen, batch, rng)
    for step, factor in ((0, 0.0), (1, 0.25), (8, 1.0)):
        _, terms = common.stored_loss(gender)(
            state.trainable, frozen, {**batch, common.STEP_KEY: step}, rng
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


def test_post_core_and_head_bit_identical_after_step(finetune_run):
    ft_dir, _ = finetune_run
    config = tiny("moddiffy_post", **{"method.core_run": str(ft_dir)})
    ctx = train.build_context(config)
    trainable, frozen = ctx.method.init(ctx, jax.random.PRNGKey(0))
    substeps = ctx.method.substeps(ctx, "l0", trainable)
    assert [s.name for s in substeps] == ["debias/gender", "debias/age"]
    state = common.TrainState(
        step=common.jnp_zero_step(),
        trainable=trainable,
        opt_states=common.init_opt_states(substeps, trainable),
    )
    before = jax.tree.map(np.array, frozen)
    from moddiffy_jax.data import TrainIterator

    batch = next(TrainIterator(ctx.data.splits["train"], batch_size=8, seed=0))
    step = common.compile_train_step(substeps, donate=False)  # one debias program
    for i in range(2):
        state, _ = step(state, frozen, batch, jax.random.PRNGKey(i))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(frozen), strict=True):
        np.testing.assert_array_equal(x, np.asarray(y))
    assert "task_head" not in state.trainable


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


def test_nan_loss_stops_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    make = common.compile_train_step

    def poisoned(substeps, **kwargs):
        step = make(substeps, **kwargs)

        def wrapped(state, frozen, batch, rng):
            new, metrics = step(state, frozen, batch, rng)
            bad = jnp.where(state.step >= 4, jnp.nan, 0.0)
            return new, {k: v + bad for k, v in metrics.items()}

        return wrapped

    monkeypatch.setattr(common, "compile_train_step", poisoned)
    with pytest.raises(FloatingPointError, match="at step 5") as info:
        train.train_and_evaluate(tiny("finetune"), tmp_path)
    assert "last good checkpoint is step 4" in str(info.value)
    ckpt = checkpoints.RunCheckpointer(tmp_path / "checkpoints")
    assert ckpt.latest_step() == 4
    ckpt.close()
    assert not (tmp_path / "results.json").exists()


def test_missing_model_dir_is_a_clear_error(tmp_path):
    config = tiny("finetune", **{"model.init": "pretrained", "model.dir": "/no/model"})
    with pytest.raises(FileNotFoundError, match="/no/model"):
        train.train_and_evaluate(config, tmp_path)


def test_unknown_attribute_and_method(tmp_path):
    with pytest.raises(ValueError, match="dataset does not have"):
        train.train_and_evaluate(
            tiny("moddiffy_par", **{"method.attributes": ("race",)}), tmp_path / "a"
        )
    with pytest.raises(ValueError, match="valid methods"):
        registry.get_method("moddify_par")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("mmd_whiten_within", "task", "mmd_whiten_within='task' is not one of"),
        ("mmd_conditional", "strata", "mmd_conditional='strata' is not one of"),
        ("mmd_whiten_shrinkage", 0.0, "mmd_whiten_shrinkage must be > 0"),
        ("task_distill", -1.0, "task_distill must be in"),
        ("task_guard_decay", 1.0, "task_guard_decay must be in"),
        ("task_guard_rate", -1.0, "task_guard_rate must be in"),
        ("fisher_weight", -1.0, "fisher_weight must be >= 0"),
        ("fisher_decay", 1.0, "fisher_decay must be in"),
        ("removal_warmup_steps", -5, "removal_warmup_steps must be >= 0"),
        ("target_weight", -1.0, "target_weight must be >= 0"),
        ("target_decay", 1.0, "target_decay must be in"),
        ("target_mode", "move", "target_mode='move' is not one of"),
    ],
)
def test_bad_removal_settings_are_named(key, value, message):
    with pytest.raises(ValueError, match=message):
        train.build_context(tiny("moddiffy_par", **{f"method.{key}": value}))


def test_configs_are_locked_and_arguments_checked():
    config = experiment_config("moddiffy_par", None)
    with pytest.raises(AttributeError):
        config.train.l0_step = 3  # misspelled
    with pytest.raises(ValueError, match="Unknown config argument"):
        parse_arg("dataset=dwmw17")
    with pytest.raises(ValueError, match="valid values"):
        parse_arg("data=imdb")


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.py")))
def test_every_config_file_loads(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if path.stem == "tiny":
        args = [f"{m}" for m in METHODS]
    elif path.stem == "ffw":
        args = ["data=bmnist", "data=mcmnist", "data=dwmw17", "data=synthetic"]
    elif path.stem.startswith("srnets"):
        args = ["data=synthetic", "data=dwmw17,loss=poe,sparsity=0.7", "data=mnli"]
    else:
        args = ["data=synthetic", "data=dwmw17", "data=dwmw17,objective=mmd"]
    for arg in args:
        config = module.get_config(arg)
        assert config.method.name in METHODS
        registry.get_method(config.method.name)
