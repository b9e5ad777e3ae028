"""Best-dev selection (train.select="best_dev"): what is exported is the state
that scored best on dev, and a preempted run selects the same one (tiny BERT
fine-tuning; the rule is the same for every method of the shared loop)."""

import json

import ml_collections
import numpy as np
import pytest

from moddiffy_jax import best, train
from moddiffy_jax.config_lib import experiment_config
from moddiffy_jax.workdir import Preempted


def _config(method="finetune", **train_overrides):
    config = experiment_config(method, "model=tiny")
    with config.unlocked():
        config.train.num_steps = 8
        config.train.eval_every = 1
        config.train.checkpoint_every = 4
        config.train.select = "best_dev"
        config.optim.lr_encoder = 3e-3  # dev accuracy moves within 8 steps
        config.optim.lr_heads = 3e-3
        config.train.update(train_overrides)
    return config


def _dev_scores(workdir):
    scores = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval/core/dev_task_acc" in record:
            scores[record["step"]] = record["eval/core/dev_task_acc"]
    return scores


def test_a_preempted_run_exports_the_best_dev_state(tmp_path):
    """Preempted after its best evaluation and its checkpoint at step 4, then
    resumed: the run still exports the best state of all eight evaluations
    (kept in best/ across the restart), as an uninterrupted run would."""
    with pytest.raises(Preempted):
        train.train_and_evaluate(_config(stop_at_step=5), tmp_path)
    results = train.train_and_evaluate(_config(), tmp_path)
    scores = _dev_scores(tmp_path)
    assert sorted(scores) == list(range(1, 9))
    top = max(scores.values())
    first_best = min(s for s, v in scores.items() if v == top)
    chosen = results["selected"]
    assert chosen["rule"] == "best_dev" and chosen["row"] == "core"
    assert chosen["step"] == first_best and chosen["score"] == top
    # Chosen before the restart: the state came from best/, not the resumed
    # weights; and the scores moved, so the choice was a real one.
    assert first_best < 4 and len(set(scores.values())) > 1
    # The exported model, evaluated afresh, scores what the selection saw.
    assert results["composition"]["core"]["dev_task_acc"] == top


def test_select_from_ignores_the_early_evaluations():
    keeper = best.BestDev("/nonexistent", True, start=0.5)
    rows = {"core": {"dev_task_acc": 0.9}}
    assert not keeper.offer(rows, {}, {}, "train", 2, progress=0.25)
    assert keeper.info is None


@pytest.mark.parametrize(
    "train_cfg, match",
    [
        ({"select": "best", "eval_every": 5}, "train.select='best'"),
        ({"select": "best_dev", "eval_every": 0}, "train.eval_every"),
        ({"select": "best_dev", "eval_every": 5, "select_from": 1.5}, "select_from"),
        ({"select_metric": "leakage"}, "select_metric='leakage'"),
        ({"select_leakage_weight": -1.0}, "select_leakage_weight"),
    ],
)
def test_bad_selection_names_the_fix(train_cfg, match):
    config = ml_collections.ConfigDict({"train": train_cfg})
    with pytest.raises(ValueError, match=match):
        best.check_select(config)


def test_full_row_is_the_composition_with_every_export():
    rows = {"core": {}, "core+a": {}, "core+b": {}, "core+a+b": {}}
    assert best.full_row(rows) == "core+a+b"
    assert best.full_row({"core": {}}) == "core"


def test_leakage_aware_score_reads_each_attributes_own_row():
    rows = {
        "core": {"dev_task_acc": 0.90, "dev_leakage/a": 0.95, "dev_leakage/b": 0.9},
        "core+a": {"dev_task_acc": 0.88, "dev_leakage/a": 0.70},
        "core+b": {"dev_task_acc": 0.89, "dev_leakage/b": 0.60},
        "core+a+b": {"dev_task_acc": 0.86},
    }
    assert best.score(rows) == (0.86, "core+a+b")
    value, row = best.score(rows, "task_minus_leakage", ("a", "b"), 0.5)
    assert row == "core+a+b"
    assert value == pytest.approx(0.86 - 0.5 * (0.70 + 0.60) / 2)
    # Without a diff per attribute, the full composition must not carry it.
    only_core = {"core": rows["core"]}
    value, _ = best.score(only_core, "task_minus_leakage", ("a", "b"))
    assert value == pytest.approx(0.90 - (0.95 + 0.9) / 2)
    with pytest.raises(ValueError, match="no dev leakage of 'a'"):
        best.score({"core": {"dev_task_acc": 0.9}}, "task_minus_leakage", ("a",))
    with pytest.raises(ValueError, match="needs protected attributes"):
        best.score(only_core, "task_minus_leakage", ())


def test_leakage_aware_selection_keeps_the_best_trade(tmp_path):
    """A tiny debiasing run selected by task accuracy minus leakage: the
    exported state is the evaluation with the highest such score, computed
    here from the metrics the run wrote (the probes ran although
    eval.probe_during is off)."""
    config = _config(
        "finetune_debias",
        num_steps=6,
        select_metric="task_minus_leakage",
        select_leakage_weight=2.0,
    )
    assert not config.eval.probe_during
    attributes = train.build_context(config).attributes
    assert len(attributes) == 2
    results = train.train_and_evaluate(config, tmp_path)
    scores = {}
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval/core/dev_task_acc" not in record:
            continue
        leaks = [record[f"probe/core/{a}/linear_dev_bacc"] for a in attributes]
        scores[record["step"]] = record["eval/core/dev_task_acc"] - 2.0 * sum(
            leaks
        ) / len(leaks)
    assert sorted(scores) == list(range(1, 7))
    assert len(set(scores.values())) > 1, scores  # a real choice
    top = max(scores.values())
    chosen = results["selected"]
    assert chosen["metric"] == "task_minus_leakage" and chosen["row"] == "core"
    assert chosen["step"] == min(s for s, v in scores.items() if v == top)
    assert chosen["score"] == pytest.approx(top)


def test_a_best_state_of_another_metric_is_refused(tmp_path):
    keeper = best.BestDev(tmp_path, True)
    keeper.offer({"core": {"dev_task_acc": 0.9}}, {}, {}, "train", 1, progress=1.0)
    other = best.BestDev(tmp_path, True, metric="task_minus_leakage", attributes=("a",))
    with pytest.raises(ValueError, match="scores do not compare"):
        other.load()
    with pytest.raises(ValueError, match="needs protected attributes"):
        best.BestDev(tmp_path, True, metric="task_minus_leakage")


def _diffs(g, a):
    return {"diffs": {"gender": {"w": np.full(2, g)}, "age": {"w": np.full(2, a)}}}


def test_each_diff_is_kept_at_its_own_best_evaluation(tmp_path):
    """select_scope='diff': the gender diff stops where core+gender scored best
    (step 2, before it broke down at 3), the age diff where core+age did
    (step 3), although the full composition scored best at step 1; a resumed
    keeper reads the same choice back and puts each diff back into the last
    state, leaving the rest of it alone."""
    config = experiment_config("moddiffy_post", "model=tiny")
    with config.unlocked():
        config.train.select, config.train.eval_every = "best_dev", 1
        config.train.select_scope = "diff"
    best.check_select(config)
    keeper = best.keeper(tmp_path, config, ("gender", "age"))
    evaluations = [  # step: (core+gender, core+age, core+gender+age)
        (1, 0.80, 0.85, 0.95),
        (2, 0.90, 0.85, 0.90),
        (3, 0.50, 0.88, 0.90),
    ]
    for step, g, a, both in evaluations:
        rows = {
            "core": {"dev_task_acc": 0.9},
            "core+gender": {"dev_task_acc": g},
            "core+age": {"dev_task_acc": a},
            "core+gender+age": {"dev_task_acc": both},
        }
        keeper.offer(rows, _diffs(step, 10 * step), {}, "fixmask", step, 1.0)
    last = {**_diffs(3, 30), "adversaries": {"x": np.ones(1)}}
    for k in (keeper, best.keeper(tmp_path, config, ("gender", "age"))):
        if k is not keeper:
            k.load()
        assert k.info["scope"] == "diff" and k.info["phase"] == "fixmask"
        assert {a: d["step"] for a, d in k.info["diffs"].items()} == {
            "gender": 2,
            "age": 3,
        }
        assert k.info["diffs"]["gender"]["row"] == "core+gender"
        trainable, frozen, phase = k.restore(last, {"core": 1})
        np.testing.assert_array_equal(trainable["diffs"]["gender"]["w"], [2, 2])
        np.testing.assert_array_equal(trainable["diffs"]["age"]["w"], [30, 30])
        assert trainable["adversaries"] is last["adversaries"]
        assert frozen == {"core": 1} and phase == "fixmask"
    # The run-scope keeper of the same workdir refuses the file, and back.
    with pytest.raises(ValueError, match="select_scope='diff'"):
        best.BestDev(tmp_path, True).load()
    with pytest.raises(ValueError, match="core\\+gender"):
        keeper.offer(
            {"core": {"dev_task_acc": 0.9}}, _diffs(4, 4), {}, "fixmask", 4, 1.0
        )


def test_diff_scope_needs_diffs_trained_apart():
    config = experiment_config("moddiffy_par", "model=tiny")
    with config.unlocked():
        config.train.select, config.train.eval_every = "best_dev", 5
        config.train.select_scope = "diff"
    with pytest.raises(ValueError, match="diffs trained apart on a frozen core"):
        best.check_select(config)
    with config.unlocked():
        config.train.select_scope = "each"
    with pytest.raises(ValueError, match="select_scope='each'"):
        best.check_select(config)
