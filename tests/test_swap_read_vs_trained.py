"""benchmarks/swap_read_vs_trained.py reads a run's two JSON files."""

import importlib.util
import json
from pathlib import Path

import pytest


def _script():
    path = (
        Path(__file__).resolve().parents[1] / "benchmarks" / "swap_read_vs_trained.py"
    )
    spec = importlib.util.spec_from_file_location("swap_read_vs_trained", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_trained_diffs_gap_is_read_toward_the_same_floor(tmp_path):
    reads = [{"closed": 0.0, "cost": 0.0}, {"closed": 0.8, "cost": 1.5}]
    (tmp_path / "eval").mkdir()
    (tmp_path / "results.json").write_text(
        json.dumps({"swap_reads": {"gender": {"chosen": 1, "reads": reads}}})
    )

    def row(acc, attacker, linear):
        leak = {"mean": attacker, "linear": {"test_balanced_accuracy": linear}}
        return {"test_task_acc": acc, "leakage": {"gender": leak}}

    report = {
        "composition": {
            "core": row(0.93, 0.98, 0.97),
            "core+gender": row(0.91, 0.93, 0.93),
        },
        "floors": {"gender": {"floor": 0.88}},
    }
    (tmp_path / "eval" / "results.json").write_text(json.dumps(report))
    (got,) = _script().rows(tmp_path)
    assert got["groups"] == "1 of 1" and got["read_closed"] == 0.8
    assert got["closed"] == pytest.approx([0.5, 4 / 9])
    assert got["cost"] == pytest.approx(2.0)
