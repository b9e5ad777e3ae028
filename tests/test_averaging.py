"""Tail weight averaging (train.average_from): the export is the mean of the
last phase's last steps, a resumed run averages the same steps, and the diff
methods keep exactly the budget's entries."""

import jax
import ml_collections
import numpy as np
import pytest

from moddiffy_jax import averaging, checkpoints, train
from moddiffy_jax.methods import common
from moddiffy_jax.subnets.diff_files import load_sparse_diff
from moddiffy_jax.workdir import Preempted
from tests.helpers import exported_diffs, tiny


def _finetune(steps, **train_overrides):
    return tiny(
        "finetune",
        **{
            "train.num_steps": steps,
            "train.checkpoint_every": 2,
            "eval.leakage": False,
            "optim.lr_encoder": 3e-3,  # the parameters move visibly per step
            **{f"train.{k}": v for k, v in train_overrides.items()},
        },
    )


def _core(workdir):
    params, _ = checkpoints.load_params(workdir / "export" / "core.safetensors")
    return params


def test_running_mean_is_the_mean_and_keeps_other_leaves():
    steps = [
        {"w": np.full((2, 3), float(i), np.float32), "n": np.int32(i)}
        for i in (1, 2, 6)
    ]
    state = common.TrainState(step=np.int32(0), trainable=steps[0], opt_states={})
    state = state.replace(opt_states={averaging.KEY: averaging.init(steps[0])})
    for count, trainable in enumerate(steps, start=1):
        state = averaging.update(state.replace(trainable=trainable), count)
    mean = averaging.result(state)
    np.testing.assert_allclose(mean["w"], np.full((2, 3), 3.0))
    assert mean["w"].dtype == np.float32
    assert int(mean["n"]) == 6  # not a parameter: its last value


def test_first_step_counts_the_share_of_the_last_phase():
    def config(value):
        return ml_collections.ConfigDict({"train": {"average_from": value}})

    assert averaging.first_step(config(-1.0), 75) is None
    assert averaging.first_step(config(0.0), 75) == 1
    assert averaging.first_step(config(0.5), 6) == 4
    assert averaging.first_step(config(0.99), 6) == 6


def test_export_is_the_mean_of_the_runs_that_stop_at_each_averaged_step(tmp_path):
    """Under a constant learning rate a run of k steps is the first k steps
    of a longer one, so the averaged export of 6 steps from 0.5 on (steps
    4, 5, 6) is the mean of the exports of runs of 4, 5 and 6 steps."""
    cores = []
    for steps in (4, 5, 6):
        workdir = tmp_path / f"last{steps}"
        train.train_and_evaluate(_finetune(steps), workdir)
        cores.append(_core(workdir))
    averaged = train.train_and_evaluate(
        _finetune(6, average_from=0.5), tmp_path / "avg"
    )
    assert averaged["selected"] == {"rule": "average", "from_step": 4, "steps": 3}
    mean = jax.tree.map(lambda *xs: np.mean(np.stack(xs), axis=0), *cores)
    got = _core(tmp_path / "avg")
    moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), cores[0], cores[2])
    assert max(jax.tree.leaves(moved)) > 1e-4  # the steps differ
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, mean
    )


def test_a_preempted_run_averages_the_same_steps(tmp_path):
    """Preempted inside the averaged steps (after its checkpoint at step 4)
    and resumed: the same export as an uninterrupted run, bit for bit."""
    whole = train.train_and_evaluate(_finetune(6, average_from=0.4), tmp_path / "a")
    with pytest.raises(Preempted):
        train.train_and_evaluate(
            _finetune(6, average_from=0.4, stop_at_step=4), tmp_path / "b"
        )
    resumed = train.train_and_evaluate(_finetune(6, average_from=0.4), tmp_path / "b")
    assert resumed["selected"] == whole["selected"]
    jax.tree.map(
        np.testing.assert_array_equal, _core(tmp_path / "a"), _core(tmp_path / "b")
    )


def test_diffs_keep_their_entries_and_average_their_values(tmp_path):
    """MoDDiffy-par: the averaged fixmask values sit on the same indices as
    the last step's (the budget is exact either way) and differ from them."""
    last = tmp_path / "last"
    avg = tmp_path / "avg"
    train.train_and_evaluate(tiny("moddiffy_par", **{"eval.leakage": False}), last)
    train.train_and_evaluate(
        tiny(
            "moddiffy_par",
            **{"eval.leakage": False, "train.average_from": 0.0},
        ),
        avg,
    )
    files = [f.name for f in exported_diffs(last)]
    assert files and files == [f.name for f in exported_diffs(avg)]
    differ = False
    for name in files:
        a = load_sparse_diff(last / "export" / "diffs" / name)
        b = load_sparse_diff(avg / "export" / "diffs" / name)
        assert a.indices.keys() == b.indices.keys()
        for key in a.indices:
            np.testing.assert_array_equal(a.indices[key], b.indices[key])
            differ |= not np.allclose(a.values[key], b.values[key])
    assert differ


@pytest.mark.parametrize(
    "train_cfg, match",
    [
        ({"average_from": 1.0}, "average_from=1.0"),
        ({"average_from": "half"}, "average_from='half'"),
        ({"average_from": 0.5, "select": "best_dev"}, "select='best_dev'"),
    ],
)
def test_bad_averaging_names_the_fix(train_cfg, match):
    config = ml_collections.ConfigDict({"train": train_cfg})
    with pytest.raises(ValueError, match=match):
        averaging.check(config)
