"""Best-dev selection (train.select="best_dev"): what is exported is the state
that scored best on dev, and a preempted run selects the same one (tiny BERT
fine-tuning; the rule is the same for every method of the shared loop)."""

import json

import ml_collections
import pytest

from moddiffy_jax import best, train
from moddiffy_jax.config_lib import experiment_config
from moddiffy_jax.workdir import Preempted


def _config(**train_overrides):
    config = experiment_config("finetune", "model=tiny")
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
