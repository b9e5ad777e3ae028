"""The report's probe programs compiled ahead (eval/warm.py)."""

import dataclasses
import threading

import numpy as np

from moddiffy_jax import train
from moddiffy_jax.eval import composition, linear_probes, probes, warm
from tests.helpers import tiny


def _sizes():
    return (
        probes._probe_program._cache_size(),
        linear_probes._fit_lbfgs._cache_size(),
    )


def test_the_report_finds_every_probe_program_compiled():
    """After :func:`warm.report_probes` the report's probes of a row (the
    attacker, the linear probe, the converged MLP, INLP, and the core
    decision's row) compile nothing more, and their numbers are the same
    as without it (pure functions: the cache holds programs, not results)."""
    config = tiny("moddiffy_par", **{"eval.leakage": True})
    ctx = train.build_context(config)
    options = train.report_probe_options(config)
    assert options["decision"] and options["inlp"] and options["mlp"]
    rng = np.random.default_rng(1)
    width = ctx.model.feature_dim
    reps = {
        s: rng.normal(size=(len(ctx.data.splits[s].task), width)).astype(np.float32)
        for s in composition.SPLITS
    }
    logits = {s: h[:, :2] - h[:, :2].mean(-1, keepdims=True) for s, h in reps.items()}
    config_ = options["probe_config"]

    def report_row():
        return [
            composition._leakage(ctx, reps, config_, linear=True, mlp=True),
            composition._leakage(
                ctx, logits, config_, linear=True, mlp=True, attacker=False
            ),
        ]

    done = warm.report_probes(ctx, config_, linear=True, mlp=True, inlp=True)
    assert done == ["2 classes, width 32", "2 classes, width 2", "INLP, 2 classes"]
    before = _sizes()
    first = report_row()
    assert _sizes() == before  # nothing compiled for the report's row
    assert first == report_row()


def test_start_runs_on_a_thread_and_skips_runs_without_attributes():
    config = tiny("moddiffy_par", **{"eval.leakage": True})
    ctx = train.build_context(config)
    options = train.report_probe_options(config)
    handle = warm.start(ctx, options)
    assert handle is not None and handle.thread.daemon
    handle.join()
    # Stopped, it starts no further program (a run that ends early).
    stop = threading.Event()
    stop.set()
    assert warm.report_probes(ctx, options["probe_config"], stop=stop) == []
    handle = warm.start(ctx, options)
    handle.stop()
    assert not handle.thread.is_alive()
    assert warm.start(dataclasses.replace(ctx, attributes=()), options) is None
