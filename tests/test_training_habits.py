"""Training habits of the paper and of pod users. Learning-rate schedules
with warm-up and gradient accumulation (config.optim.schedule /
warmup_steps / accumulate): the factors equal transformers' schedules, a
scheduled sub-step equals AdamW with that learning rate, k micro-batches
equal one batch k times larger, and a run preempted between two
micro-batches resumes to the uninterrupted result. Mixed precision
(config.model.dtype=bfloat16): bf16 compute, float32 master weights."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moddiffy_jax import checkpoints, train
from moddiffy_jax.config_lib import experiment_config
from moddiffy_jax.methods import common
from moddiffy_jax.workdir import Preempted


def _hf_factor(schedule, step, warmup, total):
    """transformers' get_*_schedule_with_warmup lr_lambda, written out."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))
    return 1.0


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
def test_factors_are_the_transformers_schedules(schedule, warmup):
    factor = jax.jit(common.lr_factor(schedule, warmup, 10))
    got = [float(factor(c)) for c in range(12)]
    want = [_hf_factor(schedule, c, warmup, 10) for c in range(12)]
    np.testing.assert_allclose(got, want, atol=1e-6)


OPTIM = {
    "lr_encoder": 0.1,
    "wd_encoder": 0.01,
    "lr_log_alpha": 0.05,
    "wd_log_alpha": 0.0,
    **{f"lr_{r}": 0.0 for r in ("adapter", "diff", "heads", "adversary", "scores")},
    **{f"wd_{r}": 0.0 for r in ("adapter", "diff", "heads", "adversary", "scores")},
    "b1": 0.9,
    "b2": 0.999,
    "eps": 1e-8,
    "clip_norm": 0.0,
}


def _toy(x, y):
    """A linear model's squared error (core/w) plus a separate pull on a
    gate logit (diffs/g/log_alpha): one sub-step training both."""
    trainable = {
        "core": {"w": jnp.asarray([0.5, -0.3, 0.2])},
        # (a diff's values too: every role rule must match something)
        "diffs": {"g": {"log_alpha": jnp.asarray([1.0, 2.0]), "d": jnp.zeros(2)}},
    }

    def loss(full, frozen, batch, rng):
        err = batch["x"] @ full["core"]["w"] - batch["y"]
        pull = jnp.sum((full["diffs"]["g"]["log_alpha"] - 3.0) ** 2)
        return jnp.mean(err**2) + pull, {}

    batch = {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)}
    return trainable, loss, batch


def _run(substeps, trainable, batches):
    step = jax.jit(common.make_train_step(substeps))
    state = common.TrainState(
        step=jnp.zeros((), jnp.int32),
        trainable=trainable,
        opt_states=common.init_opt_states(substeps, trainable),
    )
    seen = []
    for batch in batches:
        state, _ = step(state, {}, batch, jax.random.PRNGKey(0))
        seen.append(jax.tree.map(np.asarray, state.trainable))
    return seen


def test_a_scheduled_substep_is_adamw_with_the_scheduled_rate():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)), rng.normal(size=8)
    trainable, loss, batch = _toy(x, y)
    optim = {**OPTIM, "schedule": "linear", "warmup_steps": 2}
    sub = common.SubStep(
        "task", (("core",), ("diffs",)), loss, common.make_optimizer(optim)
    )
    (sub,) = common.schedule_substeps([sub], optim, 6)
    got = _run([sub], trainable, [batch] * 6)[-1]

    # By hand: AdamW on w with lr 0.1 * factor(count), constant AdamW on the gate.
    factor = common.lr_factor("linear", 2, 6)
    w_opt = optax.adamw(lambda c: 0.1 * factor(c), weight_decay=0.01)
    g_opt = optax.adamw(0.05, weight_decay=0.0)
    w, g = trainable["core"]["w"], trainable["diffs"]["g"]["log_alpha"]
    ws, gs = w_opt.init(w), g_opt.init(g)
    for _ in range(6):
        full = {"core": {"w": w}, "diffs": {"g": {"log_alpha": g, "d": jnp.zeros(2)}}}
        grads = jax.grad(lambda t: loss(t, {}, batch, None)[0])(full)
        u, ws = w_opt.update(grads["core"]["w"], ws, w)
        w = optax.apply_updates(w, u)
        u, gs = g_opt.update(grads["diffs"]["g"]["log_alpha"], gs, g)
        g = optax.apply_updates(g, u)
    np.testing.assert_allclose(got["core"]["w"], w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got["diffs"]["g"]["log_alpha"], g, rtol=1e-5)
    # The warm-up's first update is zero, as in transformers: w moved only
    # from the second step on, the (unscheduled) gate from the first.
    first = _run([sub], trainable, [batch])[0]
    np.testing.assert_array_equal(first["core"]["w"], trainable["core"]["w"])
    assert not np.array_equal(
        first["diffs"]["g"]["log_alpha"], trainable["diffs"]["g"]["log_alpha"]
    )


def test_k_micro_batches_equal_one_batch_k_times_larger():
    """Clipped as one: the clip sees the mean gradient of the two halves."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(8, 3)), 3.0 * rng.normal(size=8)
    trainable, loss, big = _toy(x, y)
    halves = [{k: v[:4] for k, v in big.items()}, {k: v[4:] for k, v in big.items()}]
    optim = {**OPTIM, "clip_norm": 0.5}
    sub = common.SubStep(
        "task", (("core",), ("diffs",)), loss, common.make_optimizer(optim)
    )
    (one,) = common.schedule_substeps([sub], optim, 2)
    (two,) = common.schedule_substeps([sub], {**optim, "accumulate": 2}, 4)
    want = _run([one], trainable, [big, big])
    got = _run([two], trainable, halves * 2)
    # Between updates the parameters stay put.
    for leaf_got, leaf_start in zip(
        jax.tree.leaves(got[0]), jax.tree.leaves(trainable), strict=True
    ):
        np.testing.assert_array_equal(leaf_got, leaf_start)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(got[3]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_defaults_leave_the_optimizer_unchanged():
    sub = common.SubStep("task", (("core",),), None, common.make_optimizer(OPTIM))
    assert common.schedule_substeps([sub], OPTIM, 10)[0] is sub


@pytest.mark.parametrize(
    "optim, steps, match",
    [
        ({"schedule": "step"}, {"train": 8}, "optim.schedule='step'"),
        ({"accumulate": 0}, {"train": 8}, "accumulate must be >= 1"),
        ({"accumulate": 3}, {"l0": 9, "fixmask": 4}, "'fixmask' has 4 steps"),
        ({"warmup_steps": -1}, {"train": 8}, "warmup_steps must be >= 0"),
        ({"warmup_steps": 4, "accumulate": 2}, {"train": 8}, "no update after"),
    ],
)
def test_bad_settings_name_the_field_and_the_fix(optim, steps, match):
    with pytest.raises(ValueError, match=match):
        common.check_optim(optim, steps)


def _config(**train_overrides):
    config = experiment_config("finetune", "model=tiny")
    with config.unlocked():
        config.optim.schedule = "linear"
        config.optim.warmup_steps = 1
        config.optim.accumulate = 2
        config.train.checkpoint_every = 3  # between the two micro-batches
        config.eval.leakage = False
        config.train.update(train_overrides)
    return config


def test_a_run_preempted_mid_accumulation_resumes_exactly(tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train.train_and_evaluate(_config(), full)
    with pytest.raises(Preempted):
        train.train_and_evaluate(_config(stop_at_step=3), resumed)
    train.train_and_evaluate(_config(), resumed)
    for name in ("core.safetensors", "task_head.safetensors"):
        a, _ = checkpoints.load_params(full / "export" / name)
        b, _ = checkpoints.load_params(resumed / "export" / name)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y)
    # The accumulation was in the loop: without it the same six batches
    # give other weights.
    plain = tmp_path / "plain"
    config = _config()
    with config.unlocked():
        config.optim.accumulate = 1
    train.train_and_evaluate(config, plain)
    a, _ = checkpoints.load_params(full / "export" / "task_head.safetensors")
    b, _ = checkpoints.load_params(plain / "export" / "task_head.safetensors")
    assert any(
        not np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_bf16_training_keeps_float32_weights_and_tracks_float32(tmp_path):
    """Tiny fine-tuning in bf16 (activations and matmul inputs) beside
    float32: the exported weights stay float32 (master weights and optimizer
    in float32), and the first steps' losses agree to bf16 precision."""

    def run(dtype):
        config = experiment_config("finetune", "model=tiny")
        with config.unlocked():
            config.model.dtype = dtype
            config.eval.leakage = False
            config.train.log_every = 1
        workdir = tmp_path / dtype
        train.train_and_evaluate(config, workdir)
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
        return workdir, [json.loads(x) for x in lines if '"task/loss"' in x]

    _, f32 = run("float32")
    bf16_dir, bf16 = run("bfloat16")
    for name in ("core.safetensors", "task_head.safetensors"):
        params, _ = checkpoints.load_params(bf16_dir / "export" / name)
        assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}
    assert len(f32) == len(bf16) == 6
    for a, b in zip(f32, bf16, strict=True):
        assert b["task/loss"] == pytest.approx(a["task/loss"], rel=0.03, abs=0.01)
    # ... and they are not the same computation.
    assert any(a["task/loss"] != b["task/loss"] for a, b in zip(f32, bf16, strict=True))


def test_epochs_resolve_to_steps_of_the_training_split():
    from moddiffy_jax.config_lib import resolve_epochs

    config = experiment_config("moddiffy_par", "model=tiny")
    assert resolve_epochs(config, 21) is config  # no phase in epochs
    with config.unlocked():
        config.train.batch_size = 8
        config.train.l0_epochs = 2.5  # 3 steps per epoch: ceil(7.5) = 8
        config.train.fixmask_epochs = 1.0
    got = resolve_epochs(config, 21)
    assert (got.train.l0_steps, got.train.fixmask_steps) == (8, 3)
    assert got.train.num_steps == config.train.num_steps  # not in epochs
    assert config.train.l0_steps != 8  # the requested config is untouched
    with config.unlocked():
        config.optim.accumulate = 3
    got = resolve_epochs(config, 21)
    assert (got.train.l0_steps, got.train.fixmask_steps) == (9, 3)


def test_paper_scale_is_the_papers_recipe():
    from moddiffy_jax.config_lib import resolve_epochs

    config = experiment_config("moddiffy_par", "data=dwmw17,scale=paper")
    assert config.train.batch_size == 64 and config.optim.lr_diff == 2e-5
    assert (config.train.l0_epochs, config.train.fixmask_epochs) == (15.0, 15.0)
    steps = resolve_epochs(config, 7474).train  # 117 steps per epoch
    assert (steps.l0_steps, steps.fixmask_steps) == (1755, 1755)
    cpu = experiment_config("moddiffy_par", "data=dwmw17")
    assert cpu.train.l0_epochs == 0.0 and cpu.optim.lr_diff == 5e-4
    mask = experiment_config("srnets_mask", "data=dwmw17,scale=paper")
    assert mask.train.epochs == 5.0 and mask.optim.lr_scores == 5e-5
    with pytest.raises(ValueError, match="scale=paper is the text papers'"):
        experiment_config("finetune", "data=bmnist,scale=paper")


def test_a_run_in_epochs_records_its_steps_and_resumes(tmp_path):
    def config(**train):
        c = experiment_config("finetune", "model=tiny")
        with c.unlocked():
            c.train.epochs = 0.75
            c.train.checkpoint_every = 2
            c.eval.leakage = False
            c.train.update(train)
        return c

    with pytest.raises(Preempted):
        train.train_and_evaluate(config(stop_at_step=2), tmp_path)
    results = train.train_and_evaluate(config(), tmp_path)
    n_train = len(train.build_context(config()).data.splits["train"])
    want = math.ceil(0.75 * math.ceil(n_train / 8))
    assert results["phase_steps"] == {"train": want} and want > 2
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["train"]["epochs"] == 0.75  # what was asked, resolved per run
    steps = [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl")]
    assert max(steps) == want


def test_word_rows_of_a_diff_learn_at_their_own_scale():
    # optim.diff_words_lr_scale multiplies AdamW's step on a diff's word-
    # embedding rows only; at 1 the state keeps its old layout (one role).
    tree = {
        "diffs": {
            "a": {
                "delta": {
                    "embeddings": {"word_embeddings": {"embedding": jnp.zeros((4, 3))}},
                    "layer": {"kernel": jnp.zeros((3, 3))},
                }
            }
        }
    }
    grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.5), tree)
    optim = {**OPTIM, "lr_diff": 1e-3}

    def update(scale):
        opt = common.make_optimizer({**optim, "diff_words_lr_scale": scale})
        state = opt.init(tree)
        return opt.update(grads, state, tree)[0]["diffs"]["a"]["delta"], state

    one, state_one = update(1.0)
    ten, state_ten = update(10.0)
    assert "diff_words" not in state_one[-1].inner_states
    assert "diff_words" in state_ten[-1].inner_states
    rows = ("embeddings", "word_embeddings", "embedding")
    word_one, word_ten = one[rows[0]][rows[1]][rows[2]], ten[rows[0]][rows[1]][rows[2]]
    np.testing.assert_allclose(word_ten, 10.0 * word_one, rtol=1e-6)
    assert float(jnp.abs(word_one).min()) > 0.0
    np.testing.assert_array_equal(ten["layer"]["kernel"], one["layer"]["kernel"])
    with pytest.raises(ValueError, match="diff_words_lr_scale"):
        common.make_optimizer({**optim, "diff_words_lr_scale": 0.0})
    with pytest.raises(ValueError, match="diff_words_lr_scale"):  # before a run
        common.check_optim({**optim, "diff_words_lr_scale": -1.0}, {"l0": 4})


def test_table_normalizer_moves_word_rows_with_their_gradient():
    # optim.diff_words_normalizer="table": one step divisor for the word
    # table (root mean second moment of the entries with gradient), so a row
    # with a tenth of the gradient moves a tenth as far, a row without any
    # stays put, and every other leaf keeps AdamW's per-entry step.
    words = jnp.zeros((4, 3))
    tree = {
        "diffs": {
            "a": {
                "delta": {
                    "embeddings": {"word_embeddings": {"embedding": words}},
                    "layer": {"kernel": jnp.zeros((3, 3))},
                }
            }
        }
    }
    g_rows = jnp.array([1.0, 0.1, 0.0, -0.5])[:, None] * jnp.ones((4, 3))
    grads = {
        "diffs": {
            "a": {
                "delta": {
                    "embeddings": {"word_embeddings": {"embedding": g_rows}},
                    "layer": {"kernel": jnp.full((3, 3), 0.01)},
                }
            }
        }
    }
    optim = {**OPTIM, "lr_diff": 1e-3, "clip_norm": 0.0}

    def run(normalizer, steps=3):
        opt = common.make_optimizer({**optim, "diff_words_normalizer": normalizer})
        params, state = tree, opt.init(tree)
        for _ in range(steps):
            upd, state = opt.update(grads, state, params)
            params = optax.apply_updates(params, upd)
        return params["diffs"]["a"]["delta"]

    table, entry = run("table"), run("entry")
    moved = np.asarray(table["embeddings"]["word_embeddings"]["embedding"])
    rms = math.sqrt((1.0 + 0.01 + 0.25) / 3)  # over the three rows with gradient
    np.testing.assert_allclose(
        moved[:, 0], -3e-3 * np.array([1.0, 0.1, 0.0, -0.5]) / rms, rtol=1e-4
    )
    assert moved[2].tolist() == [0.0, 0.0, 0.0]
    # AdamW's entries all move by lr per step whatever their gradient.
    adam = np.asarray(entry["embeddings"]["word_embeddings"]["embedding"])
    np.testing.assert_allclose(np.abs(adam[[0, 1, 3]]), 3e-3, rtol=1e-4)
    np.testing.assert_array_equal(table["layer"]["kernel"], entry["layer"]["kernel"])
    with pytest.raises(ValueError, match="diff_words_normalizer"):
        common.make_optimizer({**optim, "diff_words_normalizer": "row"})
    with pytest.raises(ValueError, match="diff_words_normalizer"):  # before a run
        common.check_optim({**optim, "diff_words_normalizer": "rows"}, {"l0": 4})


def test_table_normalized_state_survives_a_donating_jitted_update():
    # Train steps donate their optimizer state: the moments must be buffers
    # of their own (one zeros tree used twice fails at the first step).
    params = {
        "diffs": {
            "a": {
                "delta": {
                    "embeddings": {"word_embeddings": {"embedding": jnp.zeros((4, 3))}},
                    "layer": {"kernel": jnp.zeros((3, 3))},
                }
            }
        }
    }
    optim = {**OPTIM, "lr_diff": 1e-3, "diff_words_normalizer": "table"}
    opt = common.make_optimizer(optim)
    update = jax.jit(opt.update, donate_argnums=(1,))
    grads = jax.tree.map(jnp.ones_like, params)
    state = opt.init(params)
    for _ in range(2):
        changes, state = update(grads, state, params)
    words = changes["diffs"]["a"]["delta"]["embeddings"]["word_embeddings"]
    assert np.all(np.asarray(words["embedding"]) < 0)


def test_a_diff_of_word_rows_alone_takes_the_word_rows_step():
    # diff.include on the word table only, with its own word-row scale: the
    # plain "diff" role then has nothing to take, which must not be an error.
    rows = jnp.zeros((4, 3))
    tree = {
        "diffs": {
            "a": {"delta": {"embeddings": {"word_embeddings": {"embedding": rows}}}}
        },
        "task_head": {"kernel": jnp.zeros((3, 2))},
    }
    optim = {**OPTIM, "lr_diff": 1e-3, "diff_words_lr_scale": 4.0}
    opt = common.make_optimizer(optim)
    grads = jax.tree.map(jnp.ones_like, tree)
    changes, _ = opt.update(grads, opt.init(tree), tree)
    word = changes["diffs"]["a"]["delta"]["embeddings"]["word_embeddings"]["embedding"]
    np.testing.assert_allclose(word, -4e-3, rtol=1e-4)
