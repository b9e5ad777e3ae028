"""The report's probe programs, compiled while training's first step compiles.

A run's end-of-training report (``composition.evaluate_run``) trains the
same few probe programs on every row: the attacker ensemble, the linear
probe's and INLP's L-BFGS fits and the converged MLP, each compiled once
per shape. From an empty compilation cache they cost about 36 s of XLA
compile in README command 1's report (docs/speed.md, "Stop 70"), while
the first training step's compile leaves one of two cores idle for about
50 s (tracing, lowering and XLA's passes run on one thread).

:func:`start` runs the report's own probe functions once on a background
thread, on random representations of the report's shapes and the run's
own labels, so that jax's in-memory caches (and the persistent cache, where
one is set) hold those programs when the report asks for them. Nothing
the run computes reads what this thread computes: the probes are pure
functions of their inputs, and their outputs here are dropped. An error
here is logged and otherwise ignored (the report compiles what it needs).

Off by default (``config.eval.warm_probes``): on a 2-core CPU the thread
also slows the first step (the GIL, and its probes' own arithmetic), and
on README command 1 from a fresh clone the report was 15 s shorter while
the first step was 26 s longer (docs/speed.md, "Stop 70"). It is for
hosts with cores the first compile leaves idle.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import logging

SPLITS = ("train", "dev", "test")


def report_probes(
    ctx: Any,
    probe_config: Any,
    *,
    linear: bool = True,
    mlp: bool = True,
    inlp: bool = True,
    decision: bool = True,
    stop: threading.Event | None = None,
) -> list[str]:
    """Runs each probe program the report will run, once per shape, on
    random representations (``ctx``: the run's context, train as read;
    ``decision``: also the ``core decision`` row's, on the task's logits;
    ``stop``: once set, no further program starts). Returns what was run,
    for the log."""
    from moddiffy_jax.eval import composition
    from moddiffy_jax.eval import inlp as inlp_lib

    splits = ctx.data.splits
    rng = np.random.default_rng(0)

    def random_reps(width: int) -> dict[str, np.ndarray]:
        return {
            s: rng.normal(size=(len(splits[s].task), width)).astype(np.float32)
            for s in SPLITS
        }

    # One attribute per number of classes: the programs depend on it, not
    # on the attribute.
    by_classes: dict[int, str] = {}
    for a in ctx.attributes:
        by_classes.setdefault(len(ctx.data.attr_classes[a]), a)
    done = []
    rows = [(int(ctx.model.feature_dim), True)]
    if decision:
        rows.append((len(ctx.data.task_classes), False))
    stopped = stop.is_set if stop is not None else lambda: False
    for n, attr in by_classes.items():
        one = dataclasses.replace(ctx, attributes=(attr,))
        for width, attacker in rows:
            if stopped():
                return done
            reps = random_reps(width)
            composition._leakage(
                one, reps, probe_config, linear=linear, mlp=mlp, attacker=attacker
            )
            done.append(f"{n} classes, width {width}")
        if inlp and not stopped():
            reps = random_reps(int(ctx.model.feature_dim))
            y = {s: splits[s].attrs[attr] for s in ("train", "dev")}
            inlp_lib.fit_inlp(
                reps["train"],
                y["train"],
                reps["dev"],
                y["dev"],
                num_classes=n,
                tol=1e-4,
                n_iterations=1,
            )
            done.append(f"INLP, {n} classes")
    return done


class Warmup:
    """The background thread of :func:`start`."""

    def __init__(self, thread: threading.Thread, stop: threading.Event):
        self.thread, self._stop = thread, stop

    def join(self) -> None:
        """Waits for every program (before the report)."""
        self.thread.join()

    def stop(self) -> None:
        """Starts no further program and waits for the one running (a run
        that stops early, e.g. preempted, leaves no compile running into
        the interpreter's exit)."""
        self._stop.set()
        self.thread.join()


def start(ctx: Any, options: Mapping[str, Any]) -> Warmup | None:
    """Starts :func:`report_probes` on a daemon thread (``options``: its
    keyword arguments and ``probe_config``); None where the run has no
    attributes. Join it before the report; stop it where the run ends
    early."""
    if not ctx.attributes or not all(s in ctx.data.splits for s in SPLITS):
        return None
    from moddiffy_jax import data as data_lib

    if getattr(ctx.data, "train_originals", None) is not None:
        ctx = dataclasses.replace(ctx, data=data_lib.original_train(ctx.data))
    options = dict(options)
    probe_config = options.pop("probe_config")
    stop = threading.Event()

    def run() -> None:
        try:
            done = report_probes(ctx, probe_config, stop=stop, **options)
            logging.info("Report probe programs compiled ahead: %s", "; ".join(done))
        except Exception as e:  # an optimisation only: the report compiles them
            logging.warning("Compiling the report's probes ahead failed: %r", e)

    thread = threading.Thread(target=run, name="warm-report-probes", daemon=True)
    thread.start()
    return Warmup(thread, stop)
