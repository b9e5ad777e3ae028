"""The next phase's step compiled beside this phase's steps
(``train.compile_ahead``): the phase change finds it is the program it
would compile, and uses it."""

import json

import pytest

from moddiffy_jax import train
from moddiffy_jax.methods import moddiffy
from moddiffy_jax.subnets import diffs as diffs_lib
from tests.helpers import check_run, exported_diffs, tiny


def _config(ahead):
    # Cuts after L0 steps 1 and 2 of 4: fixmask's shapes are settled from step 2.
    return tiny(
        "moddiffy_par",
        **{
            "train.step_jit": "step",
            "train.compile_ahead": ahead,
            "diff.prune_every": 1,
            "eval.leakage": False,
        },
    )


def test_the_step_compiled_ahead_runs_the_phase_and_changes_nothing(tmp_path):
    config = _config("on")
    settled = [
        s
        for s in range(1, 5)
        if moddiffy.next_shapes_settled(config, "l0", s, config.train.l0_steps)
    ]
    assert settled == [2, 3, 4]
    assert not moddiffy.next_shapes_settled(config, "fixmask", 1, 3)

    results = train.train_and_evaluate(config, tmp_path / "run")
    core = check_run(tmp_path / "run", results, "moddiffy_par")
    records = [
        json.loads(line)
        for line in open(tmp_path / "run" / "metrics.jsonl")
        if "compile_ahead" in line
    ]
    assert len(records) == 1, records
    assert records[0]["phase"] == "fixmask"
    assert records[0]["compile_ahead/from_step"] == 2
    # Used only when the phase change lowers the step to the same program
    # text (shapes, shardings and donation included): the run then computes
    # what it computes without it.
    assert records[0]["compile_ahead/used"] == 1, records
    assert "compile_ahead/error" not in records[0]
    # The fixmask phase trained on that program: exact budgets, as always.
    files = exported_diffs(tmp_path / "run")
    assert [f.stem for f in files] == ["age", "gender"]
    for f in files:
        diff = diffs_lib.load_sparse_diff(f, base=core)
        assert diff.nnz() == round(config.diff.keep * diff.num_selected())


def test_a_bad_compile_ahead_value_is_named(tmp_path):
    with pytest.raises(ValueError, match="compile_ahead"):
        train.train_and_evaluate(_config("yes"), tmp_path / "run")
    assert not (tmp_path / "run").exists()
