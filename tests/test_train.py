"""End-to-end training on the tiny config: every method, the post-hoc core
kept bit for bit, bad input. (One step at a time: tests/test_substeps.py; the
MoDDiffy-par run, its resumes and its data-parallel twins:
tests/test_par_runs.py.)"""

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moddiffy_jax import checkpoints, main, train
from moddiffy_jax.config_lib import experiment_config, parse_arg
from moddiffy_jax.methods import METHODS, common, registry
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
    # Each diff exported at its own best dev evaluation (select_scope "diff").
    config = tiny(
        "moddiffy_post",
        **{
            "method.core_run": str(ft_dir),
            "train.select": "best_dev",
            "train.select_scope": "diff",
            "train.eval_every": 1,
        },
    )
    results = train.train_and_evaluate(config, tmp_path)
    core = check_run(tmp_path, results, "moddiffy_post")
    records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    fixmask_from = results["phase_steps"]["l0"]  # only the last phase counts
    chosen = results["selected"]
    assert chosen["rule"] == "best_dev" and chosen["scope"] == "diff"
    for a in ("gender", "age"):
        key = f"eval/core+{a}/dev_task_acc"
        scores = {r["step"]: r[key] for r in records if key in r}
        scores = {s: v for s, v in scores.items() if s >= fixmask_from}
        top = max(scores.values())
        assert chosen["diffs"][a]["step"] == min(
            s for s, v in scores.items() if v == top
        )
        assert chosen["diffs"][a]["score"] == top
        # The exported diff, evaluated afresh, scores what the selection saw.
        assert results["composition"][f"core+{a}"]["dev_task_acc"] == top
    printed = main.format_results(results)
    assert "best dev, each diff on its own: age at step" in printed
    assert f"gender at step {chosen['diffs']['gender']['step']} (core+gender" in printed
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


def _text_model(config):
    """The text model and encoder params ``config.model`` builds."""
    from moddiffy_jax.models import text

    return text.build_model(
        config.model,
        num_task_classes=2,
        attr_classes={},
        adversary=None,
        rng=jax.random.PRNGKey(0),
    )


def test_scan_layers_reaches_the_encoder():
    for scan in (False, True):
        model, _ = _text_model(tiny("moddiffy_par", **{"model.scan_layers": scan}))
        assert model.encoder.scan_layers is scan


def test_the_attention_kernel_and_its_dropout_reach_the_encoder():
    model, _ = _text_model(
        tiny(
            "moddiffy_par",
            **{"model.attention": "dot_product", "model.attention_dropout": 0.0},
        )
    )
    assert model.encoder.attention == "dot_product"
    assert model.bert_config.attention_probs_dropout_prob == 0.0
    # A fused kernel with the checkpoint's attention dropout is refused at
    # build time, naming the fix.
    with pytest.raises(ValueError, match="config.model.attention_dropout=0"):
        _text_model(tiny("moddiffy_par", **{"model.attention": "cudnn"}))


def test_the_tiny_model_has_the_configs_layers_and_refuses_none():
    from moddiffy_jax.models import text

    for layers in (1, 2):
        model, params = _text_model(tiny("finetune", **{"model.num_layers": layers}))
        assert model.bert_config.num_hidden_layers == layers
        assert sorted(params["encoder"]) == [f"layer_{i}" for i in range(layers)]
    with pytest.raises(ValueError, match="num_layers=0"):
        text.random_bert_config(tiny("finetune", **{"model.num_layers": 0}).model)


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
        ("task_guard_release", -1.0, "task_guard_release must be in"),
        ("task_guard_start", -1, "task_guard_start must be >= 0"),
        ("task_guard_start_share", 1.5, "task_guard_start_share must be in"),
        ("attribute_weights", "race: mmd_weight=1", "not an attribute this run"),
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


def test_task_guard_start_share_is_a_share_of_the_l0_phase():
    """The guard's start from a share of the L0 phase, counted after the
    phases' epochs are resolved, and task_guard_start itself where it is 0."""
    base = {"method.task_guard": True, "train.l0_steps": 40}
    ctx = train.build_context(
        tiny("moddiffy_par", **base, **{"method.task_guard_start_share": 0.25})
    )
    assert ctx.debias.task_guard_start == 10
    own = {"method.task_guard_start": 7}
    assert (
        train.build_context(tiny("moddiffy_par", **base, **own)).debias.task_guard_start
        == 7
    )
    per_epoch = -(-len(ctx.data.splits["train"]) // ctx.config.train.batch_size)
    epochs = train.build_context(
        tiny(
            "moddiffy_par",
            **base,
            **{"method.task_guard_start_share": 0.5, "train.l0_epochs": 2.0},
        )
    )
    assert epochs.debias.task_guard_start == round(0.5 * 2 * per_epoch)


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
