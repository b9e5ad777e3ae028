"""benchmarks/synthetic_bayes.py: the Bayes rule on the main job's own split
reads the cues the generator wrote; hiding by words (--hide, --spread, --pairs)."""

import argparse
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from moddiffy_jax.data.synthetic import TASK_WORDS, generate_synthetic


def _script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "synthetic_bayes.py"
    spec = importlib.util.spec_from_file_location("synthetic_bayes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(hide=""):
    return argparse.Namespace(
        split="test",
        data_seed=0,
        gender_corr=0.8,
        age_corr=0.5,
        label_noise=0.1,
        marker_prob=0.9,
        hide=hide,
    )


def test_the_split_bayes_rule_reads_the_generators_cues(capsys):
    out = _script().split_accuracies(_args())
    # The task word alone: right exactly where the text's word is the label's.
    split = generate_synthetic(
        seed=0,
        num_train=2000,
        num_dev=2000,
        num_test=3000,
        attr_task_correlation={"gender": 0.8, "age": 0.5},
    ).splits["test"]
    positive = np.array(
        [any(f" {w} " in f" {t} " for w in TASK_WORDS["positive"]) for t in split.text]
    )
    word_right = np.mean(positive == (np.asarray(split.task) == 1))
    assert out["t"] == word_right == 1.0 - out["noisy"]
    # All three cues beat any subset; age's likelihood ratio (3) never
    # outweighs the task word's (9), so t, a decides as t does; the gender
    # marker's ratio equals the word's, so their disagreements are ties.
    assert out["tga"] > max(out["ta"], out["tg"], out["t"])
    assert out["ta"] == out["t"]
    assert 0.85 < out["tg"] < out["tga"]
    assert "test split (data seed 0): 3000 rows" in capsys.readouterr().out


def test_hidden_marker_words_are_read_as_absent(capsys):
    script = _script()
    old = ("retirement", "grandchildren", "pension", "retired", "my grandson")
    young = ("homework", "college", "school", "classmates", "my exams")
    # Hiding every age word is the row with age left out; one pair costs
    # something but less than two (each pair hides a fifth of the markers).
    every = script.split_accuracies(_args(",".join(old + young)))
    assert every["thi"] == every["tg"]
    one = script.split_accuracies(_args("pension,school"))["thi"]
    two = script.split_accuracies(_args("pension,school,college,retirement"))["thi"]
    assert every["tg"] < two < one < every["tga"]
    assert "pension, school read as absent" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="grandpa.*ATTR_MARKERS"):
        script.split_accuracies(_args("pension,grandpa"))


def test_word_level_hiding_rows(capsys):
    script = _script()
    rng = np.random.default_rng(0)
    y, t, values, seen = script.sample(
        300_000, rng, {"gender": 0.8, "age": 0.5}, 0.1, 0.9
    )
    script.pairs(rng, y, t, values, seen)
    out = capsys.readouterr().out.split("age: 5 marker words")[1]
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            rows[int(cells[0]), int(cells[1])] = float(cells[2]), float(cells[3])
    assert abs(rows[0, 0][0]) < 0.1 and abs(rows[0, 0][1]) < 0.02
    # Each pair hides a fifth of the markers: cost and removal grow with k.
    assert rows[1, 0][0] < rows[2, 0][0] < rows[3, 0][0]
    assert rows[1, 0][1] < rows[2, 0][1] < rows[3, 0][1]
    # An age word read as absent keeps its tie-break (the absent state
    # leans to its class): no cost, more of the gap closed.
    assert abs(rows[2, 1][0] - rows[2, 0][0]) < 0.15
    assert rows[2, 1][1] > rows[2, 0][1] + 0.05


def test_the_spread_of_hidden_pairs_holds_each_choice():
    script = _script()
    old, young = (
        ("pension", "retirement", "retired"),
        ("school", "college", "classmates"),
    )
    out = script.split_accuracies(_args(",".join(old + young)))
    costs = script.hidden_pairs_spread(_args(), "age", 3)
    assert len(costs) == 100  # 3 of 5 words of each class: 10 x 10
    assert np.isclose(costs, 100.0 * (out["tga"] - out["thi"])).any()
    assert script.hidden_pairs_spread(_args(), "age", 0).tolist() == [0.0]
    every = script.hidden_pairs_spread(_args(), "age", 5)
    assert np.isclose(every, 100.0 * (out["tga"] - out["tg"])).all()
