"""benchmarks/synthetic_bayes.py --split: the Bayes rule on the main job's
own split reads the cues the generator wrote."""

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


def test_the_split_bayes_rule_reads_the_generators_cues(capsys):
    args = argparse.Namespace(
        split="test",
        data_seed=0,
        gender_corr=0.8,
        age_corr=0.5,
        label_noise=0.1,
        marker_prob=0.9,
    )
    out = _script().split_accuracies(args)
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
