"""Best-dev selection (train.select="best_dev"): what is exported is the state
that scored best on dev, and a preempted run selects the same one (tiny BERT
fine-tuning; the rule is the same for every method of the shared loop)."""

import json

import ml_collections
import numpy as np
import pytest

from moddiffy_jax import best, checkpoints, train
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


@pytest.fixture(scope="module")
def selected_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("best")
    return workdir, train.train_and_evaluate(_config(), workdir)


def test_the_export_is_the_best_dev_state(selected_run):
    workdir, results = selected_run
    scores = _dev_scores(workdir)
    assert sorted(scores) == list(range(1, 9))
    top = max(scores.values())
    first_best = min(s for s, v in scores.items() if v == top)
    chosen = results["selected"]
    assert chosen["rule"] == "best_dev" and chosen["row"] == "core"
    assert chosen["step"] == first_best and chosen["score"] == top
    # The exported model, evaluated afresh, scores what the selection saw,
    # and is not the last step's (unless that was the best).
    assert results["composition"]["core"]["dev_task_acc"] == top
    # The scores moved, so choosing the best was a real choice.
    assert len(set(scores.values())) > 1


def test_select_from_ignores_the_early_evaluations():
    keeper = best.BestDev("/nonexistent", True, start=0.5)
    rows = {"core": {"dev_task_acc": 0.9}}
    assert not keeper.offer(rows, {}, {}, "train", 2, progress=0.25)
    assert keeper.info is None


def test_a_preempted_run_selects_and_exports_the_same(selected_run, tmp_path):
    workdir, results = selected_run
    with pytest.raises(Preempted):
        train.train_and_evaluate(_config(stop_at_step=5), tmp_path)
    resumed = train.train_and_evaluate(_config(), tmp_path)
    assert resumed["selected"] == results["selected"]
    name = "core.safetensors"
    a, _ = checkpoints.load_params(workdir / "export" / name)
    b, _ = checkpoints.load_params(tmp_path / "export" / name)
    for x, y in zip(
        checkpoints.selection.flatten(a).values(),
        checkpoints.selection.flatten(b).values(),
        strict=True,
    ):
        np.testing.assert_array_equal(x, y)


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
