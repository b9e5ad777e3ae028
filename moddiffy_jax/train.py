"""The training loop: phases, jitted steps, checkpoints; it knows no method.

``train_and_evaluate(config, workdir)`` runs any method of
``moddiffy_jax.methods`` from a config (see ``configs/``). Everything that
differs between methods is a hook of the run's
:class:`~moddiffy_jax.methods.interface.Method` value: its phases, initial
state, the sub-steps of each phase, host-side work after a step and between
phases, what a checkpoint holds beside the Orbax state, and what is
exported. The loop never asks which method it runs.

Data flow: config -> context (data, model, pretrained params) -> grain
iterator -> sharded batches -> ``jit(train_step)`` per phase -> metrics /
eval / Orbax checkpoints -> ``Method.transition`` between phases ->
``moddiffy_jax.export`` (files, composition table) -> leakage probes ->
``results.json``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from moddiffy_jax import averaging, checkpoints, parallel
from moddiffy_jax import best as best_lib
from moddiffy_jax import workdir as workdir_lib
from moddiffy_jax.config_lib import resolve_epochs
from moddiffy_jax.context import Context, build_context
from moddiffy_jax.eval import discriminant_diff
from moddiffy_jax.eval.during import evaluate_during
from moddiffy_jax.eval.evaluator import Evaluator
from moddiffy_jax.export import export_and_evaluate
from moddiffy_jax.methods import common, removal, swap_reread
from moddiffy_jax.workdir import (
    MetricWriter,
    Preempted,
    check_workdir,
    prepare_workdir,
    progress_bar,
)

# Re-exported: ``train.build_context``, ``train.Preempted``... keep working.
__all__ = [
    "Context",
    "Evaluator",
    "MetricWriter",
    "Preempted",
    "build_context",
    "prepare_workdir",
    "train_and_evaluate",
]


def _check_finite(
    records: Sequence[Mapping[str, float]], first_step: int, ckpt, workdir
):
    for offset, rec in enumerate(records):
        bad = [k for k, v in rec.items() if not math.isfinite(v)]
        if bad:
            last = ckpt.latest_step()
            kept = (
                f"the last good checkpoint is step {last} in {workdir / 'checkpoints'}"
                if last is not None
                else "no checkpoint had been written yet"
            )
            raise FloatingPointError(
                f"Non-finite {', '.join(sorted(bad)[:4])} at step "
                f"{first_step + offset}; "
                f"training stopped and {kept}. Lower the learning rates "
                "(config.optim.lr_*) or check the data."
            )


class _Logger:
    """Buffers a phase's step metrics on device and writes their means."""

    def __init__(self, ctx: Context, writer: MetricWriter, ckpt, workdir, progress):
        self.ctx, self.writer, self.ckpt = ctx, writer, ckpt
        self.workdir, self.progress = workdir, progress
        self.restart(0)

    def restart(self, global_step: int) -> None:
        self.pending: list[Any] = []
        self.start, self.first = time.time(), global_step

    def flush(self, global_step: int, phase: str) -> None:
        records = [
            {k: float(v) for k, v in m.items()} for m in jax.device_get(self.pending)
        ]
        _check_finite(records, self.first + 1, self.ckpt, self.workdir)
        elapsed = max(time.time() - self.start, 1e-9)
        mean = {k: float(np.mean([r[k] for r in records])) for k in records[0]}
        mean["examples_per_sec"] = (
            len(records) * self.ctx.config.train.batch_size / elapsed
        )
        self.writer.write(global_step, {"phase": phase, **mean})
        self.progress.set_postfix(
            phase=phase,
            loss=f"{mean.get('task/loss', next(iter(mean.values()))):.3f}",
            ex_s=f"{mean['examples_per_sec']:.0f}",
        )
        self.restart(global_step)


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    *,
    break_lock: bool = False,
    allow_changed_inputs: bool = False,
) -> dict:
    """Trains ``config``'s method in ``workdir`` (resuming if it holds a checkpoint).

    The run holds ``workdir``'s lock (:class:`~moddiffy_jax.workdir.RunLock`)
    throughout; a SIGTERM saves a checkpoint at the next step and raises
    :class:`Preempted`.

    Args:
      config: an experiment config (``configs/``).
      workdir: the run directory (created, or resumed).
      break_lock: take over a lock left by a process on another host.
      allow_changed_inputs: resume although the base model, tokenizer or data
        differ from the run's start (a warning instead of an error).

    Returns:
      The final results (also written to ``workdir/results.json``).
    """
    from moddiffy_jax.methods import registry

    method = registry.get_method(config.method.name)
    workdir = Path(workdir)
    check_workdir(config, workdir)
    with (
        workdir_lib.locked(workdir, break_lock=break_lock),
        workdir_lib.preemption_handler(),
    ):
        if method.driver is not None:
            return method.run_driver(
                config, workdir, allow_changed_inputs=allow_changed_inputs
            )
        return _train_and_evaluate(config, workdir, method, allow_changed_inputs)


STEP_JIT = ("step", "substeps")
COMPILE_AHEAD = ("auto", "on", "off")


def _train_choice(config, key: str, default: str, choices, meaning: str) -> str:
    """``config.train.<key>``, one of ``choices`` (else a clear error)."""
    value = config.train.get(key, default)
    if value not in choices:
        raise ValueError(
            f"config.train.{key}={value!r}; use one of {list(choices)} ({meaning})."
        )
    return value


def step_jit_mode(config) -> str:
    """``config.train.step_jit``, checked."""
    return _train_choice(
        config,
        "step_jit",
        "step",
        STEP_JIT,
        '"step": one program per phase, the fastest step; "substeps": one per '
        "distinct sub-step, the least compile time",
    )


def compile_step(config, substeps) -> Callable:
    """The phase's train step, compiled as ``config.train.step_jit`` says."""
    if step_jit_mode(config) == "substeps":
        return common.compile_train_step(substeps)
    return jax.jit(common.make_train_step(substeps), donate_argnums=(0,))


def _train_and_evaluate(config, workdir: Path, method, allow_changed_inputs) -> dict:
    from moddiffy_jax.data import TrainIterator

    wall_start = time.time()
    best_lib.check_select(config)
    averaging.check(config)  # train.average_from
    step_jit_mode(config)  # a bad train.step_jit fails before anything runs
    compile_ahead_on(config)  # and a bad train.compile_ahead
    requested = config  # what config.json holds; phases in epochs resolve below
    ctx = build_context(config)  # ctx.config: objective "auto" resolved
    config = resolve_epochs(ctx.config, len(ctx.data.splits["train"]))
    if config is not ctx.config:
        ctx = dataclasses.replace(ctx, config=config)
    common.check_optim(
        config.optim,
        {p: method.phase_steps(config, p) for p in method.phases_of(config)},
    )
    rng = jax.random.PRNGKey(config.seed)
    init_rng, step_rng = jax.random.split(rng)
    trainable, frozen = method.init(ctx, init_rng)  # reads method.core_run
    # Nothing is written until the config, data, model and runs it builds on
    # have all been read and checked.
    iterator = TrainIterator(
        ctx.data.splits["train"],
        batch_size=config.train.batch_size,
        seed=config.seed,
        shard_index=jax.process_index(),
        shard_count=jax.process_count(),
    )
    inputs = workdir_lib.check_inputs(
        workdir, ctx, allow_changed=allow_changed_inputs, record=False
    )
    prepare_workdir(requested, workdir)
    workdir_lib.record_inputs(workdir, inputs)  # on a fresh run
    ckpt = checkpoints.RunCheckpointer(
        workdir / "checkpoints", max_to_keep=config.train.keep_checkpoints
    )
    latest = ckpt.latest_step()
    writer = MetricWriter(workdir, resume_step=latest or 0)
    evaluator = Evaluator(ctx)

    phases = method.phases_of(config)
    phase_index, phase_step, global_step = 0, 0, 0
    restored_state = None
    best = best_lib.keeper(workdir, config, ctx.attributes)
    if latest is not None:
        best.load()
        meta, extra = ckpt.restore_meta(latest)
        phase_index = phases.index(meta["phase"])
        phase_step, global_step = meta["phase_step"], meta["step"]
        iterator.set_state(meta["iterator"])
        trainable, frozen = method.restore(ctx, trainable, frozen, meta["phase"], extra)
        _, frozen = swap_reread.resume(ctx, workdir, global_step, frozen)
        restored_state = latest
        logging.info("Resuming from step %d (phase %s).", latest, meta["phase"])

    averaged = None  # train.average_from: which steps the export averages
    ahead: _Ahead | None = None  # the next phase's step, compiling meanwhile
    previous = None  # the last phase's jitted step and its arguments' signature
    total_steps = sum(method.phase_steps(config, p) for p in phases)
    reread_at = swap_reread.read_step(ctx, total_steps)  # method.swap_reread_at
    progress = progress_bar(config, total_steps, global_step)
    logger = _Logger(ctx, writer, ckpt, workdir, progress)
    # Where the wall time goes (results.json "timings"): the setup, each
    # phase (its first step holds the compile) and the end-of-run work.
    timings: dict[str, Any] = {"setup_s": time.time() - wall_start, "phases": {}}
    try:
        for pi in range(phase_index, len(phases)):
            phase = phases[pi]
            n_steps = method.phase_steps(config, phase)
            # train.average_from: the last phase's running mean, kept in the
            # state so that a resume averages the same steps.
            average_from = (
                averaging.first_step(config, n_steps) if pi == len(phases) - 1 else None
            )
            state, substeps = _phase_state(
                ctx, method, phase, trainable, global_step, average_from is not None
            )
            # On the mesh first: the restore then lands on the same global
            # shardings (on every process of a multi-process run).
            state = parallel.replicate(state, ctx.mesh)
            if restored_state is not None:
                state = ckpt.restore_state(restored_state, state)
                restored_state = None
            frozen = parallel.replicate(frozen, ctx.mesh)
            step_fn = compile_step(config, substeps)
            if ahead is not None:  # the step compiled meanwhile, if it is this one
                step_fn, record = ahead.step_fn(step_fn, state, frozen, step_rng)
                writer.write(global_step, record)
                ahead = None
            ahead_asked, reuse = False, ahead is None and previous is not None
            logger.restart(global_step)
            phase_start, first_step = time.time(), phase_step < n_steps
            while phase_step < n_steps:
                batch = parallel.shard_batch(next(iterator), ctx.mesh)
                args = (state, frozen, batch, step_rng)
                if reuse:  # the previous phase's step, if it is the same program
                    reuse = False
                    step_fn, record = _same_program(previous, step_fn, args)
                    writer.write(global_step, {"phase": phase, **record})
                if first_step and step_jit_mode(config) == "step":
                    previous = (step_fn, _signature(args))
                state, metrics = step_fn(*args)
                if first_step:  # the call compiles (then dispatches)
                    first_step = False
                    timings["phases"][phase] = {
                        "first_step_s": time.time() - phase_start
                    }
                logger.pending.append(metrics)
                phase_step += 1
                global_step += 1
                state, record = method.after_step(
                    ctx, state, phase, phase_step, n_steps
                )
                if record is not None:
                    writer.write(global_step, {"phase": phase, **record})
                if average_from is not None and phase_step >= average_from:
                    state = averaging.update(state, phase_step - average_from + 1)
                if global_step == reread_at:  # the swap groups chosen again
                    frozen, record = swap_reread.reread(
                        ctx,
                        evaluator,
                        workdir,
                        state.trainable,
                        frozen,
                        phase,
                        global_step,
                    )
                    frozen = parallel.replicate(frozen, ctx.mesh)
                    writer.write(global_step, record)
                    logger.start = time.time()  # throughput excludes the read
                if (
                    not ahead_asked
                    and pi + 1 < len(phases)
                    and method.next_shapes_settled(config, phase, phase_step, n_steps)
                ):
                    ahead_asked = True
                    ahead = _Ahead.start(
                        ctx, method, state, frozen, batch, step_rng, phases[pi + 1]
                    )
                progress.update(1)
                at_end = phase_step == n_steps
                # A preemption (SIGTERM, or simulated by stop_at_step) saves
                # like a periodic save, then stops.
                stop = _stop_reason(config, global_step)
                save = (
                    at_end or stop or global_step % config.train.checkpoint_every == 0
                )
                if save or global_step % config.train.log_every == 0:
                    logger.flush(global_step, phase)
                if save:
                    meta = {
                        "phase": phase,
                        "phase_step": phase_step,
                        "step": global_step,
                        "iterator": iterator.get_state(),
                    }
                    extra = jax.device_get(method.checkpoint_extra(frozen))
                    ckpt.save(global_step, state, meta, extra)
                if config.train.eval_every and (
                    global_step % config.train.eval_every == 0 or at_end
                ):
                    rows = evaluate_during(
                        ctx,
                        evaluator,
                        writer,
                        state.trainable,
                        frozen,
                        phase,
                        global_step,
                    )
                    if phase == phases[-1]:
                        best.offer(
                            rows,
                            state.trainable,
                            frozen,
                            phase,
                            global_step,
                            progress=phase_step / n_steps,
                        )
                    logger.start = time.time()  # throughput excludes eval
                if stop:
                    raise Preempted(global_step, stop)
            if average_from is not None:  # the mean is what the run exports
                trainable = jax.device_get(averaging.result(state))
                averaged = {
                    "from_step": global_step - n_steps + average_from,
                    "steps": n_steps - average_from + 1,
                }
            else:
                trainable = jax.device_get(state.trainable)
            frozen = jax.device_get(frozen)
            if phase in timings["phases"]:
                timings["phases"][phase]["seconds"] = time.time() - phase_start
            if pi + 1 < len(phases):
                next_phase = phases[pi + 1]
                trainable, frozen = method.transition(
                    ctx, trainable, frozen, next_phase
                )
                if config.train.eval_every:  # right after the cut
                    rows = evaluate_during(
                        ctx,
                        evaluator,
                        writer,
                        trainable,
                        frozen,
                        next_phase,
                        global_step,
                    )
                    if next_phase == phases[-1]:
                        best.offer(
                            rows, trainable, frozen, next_phase, global_step, 0.0
                        )
                phase_step = 0
        ckpt.wait()
        # Trained and saved; a stop asked for now exports on the resume.
        if workdir_lib.agree_to_stop(workdir_lib.stop_requested() is not None):
            raise Preempted(global_step, "SIGTERM received")
    finally:
        # Waits for in-flight async saves, so an error (a NaN loss, a
        # preemption) still leaves the last good checkpoint complete.
        ckpt.close()
        progress.close()
        writer.close()
    selected = {"rule": "last", "step": global_step}
    kept = best.restore(trainable, frozen)
    if kept is not None:
        trainable, frozen, _ = kept
        selected = {"rule": "best_dev", **best.info}
    trainable, frozen, finished = method.finish(ctx, trainable, frozen, phases[-1])
    # The table's representations, which the leakage probes below reuse.
    reps = {} if config.eval.leakage and jax.process_index() == 0 else None
    # The core's last-layer parts, from which the report's discriminant
    # diffs are read without an encoder pass (eval/discriminant_diff.py).
    wanted = discriminant_diff.wants_parts(
        ctx.model, eval_options(config, "discriminant")
    )
    parts = {} if reps is not None and wanted else None
    table_start = time.time()
    results = export_and_evaluate(
        ctx, evaluator, workdir, trainable, frozen, phases[-1], reps, parts
    )
    timings["export_and_table_s"] = time.time() - table_start
    if removal.TASK_GUARD in trainable:  # config.method.task_guard: where it ended
        results["task_guard"] = guard_summary(ctx.debias, trainable[removal.TASK_GUARD])
    if finished is not None:  # Method.finish (the diffs' erasure refit)
        results["finish"] = finished
    if averaged is not None:
        selected = {"rule": "average", **averaged}
    results["selected"] = selected
    results["phase_steps"] = {p: method.phase_steps(config, p) for p in phases}
    if ctx.word_tokens is not None:  # config.diff.word_rows
        results["word_rows"] = _word_row_tokens(config, ctx.word_tokens)
    if getattr(ctx, "swap_groups", None):  # config.method.swap_weight
        results["swap_groups"] = swap_group_text(config, ctx.swap_groups)
    if getattr(ctx, "swap_reads", None):  # config.method.swap_target
        results["swap_reads"] = ctx.swap_reads
    if reread_at is not None:  # config.method.swap_reread_at
        saved = json.loads((workdir / swap_reread.FILE).read_text())
        results["swap_reread"] = swap_reread.summary(saved)
    if getattr(ctx, "objective_choice", None):  # config.method.objective "auto"
        results["objective_choice"] = ctx.objective_choice
    results["train_wall_time_s"] = time.time() - wall_start
    if config.eval.leakage and jax.process_index() == 0:
        report_start = time.time()
        results.update(_leakage(config, workdir, results, ctx.attributes, reps, parts))
        timings["report_s"] = time.time() - report_start
    del reps, parts
    results["wall_time_s"] = time.time() - wall_start
    results["timings"] = timings
    if jax.process_index() == 0:
        checkpoints.write_json_atomic(workdir / "results.json", results)
    if jax.process_count() > 1:
        # Every process ends here, after the chief's probes and writes, and
        # returns the chief's results.
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("moddiffy_jax: run finished")
        results = json.loads((workdir / "results.json").read_text())
    return results


def _signature(args) -> tuple[Any, tuple]:
    """The arguments' tree and each leaf's shape and dtype."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)


def _same_program(previous, step_fn: Callable, args) -> tuple[Callable, dict]:
    """The previous phase's jitted step where this phase's step lowers to the
    same program text for these arguments (shapes, shardings and donation
    included), else ``step_fn``: the dense fixmask state
    (``diff.fixmask_state``) makes the L0 step's program the fixmask step's,
    and the previous one is compiled already. The check lowers both (the
    previous one from its trace cache); nothing the run computes can depend
    on which is used."""
    start = time.time()
    old_fn, signature = previous
    same = False
    if _signature(args) == signature:
        same = _program_key(step_fn.lower(*args)) == _program_key(old_fn.lower(*args))
    record = {
        "program/reused": int(same),
        "program/check_s": time.time() - start,
    }
    return (old_fn if same else step_fn), record


class _Ahead:
    """The next phase's train step compiling on a background thread while this
    phase trains (``config.train.compile_ahead``), from the state
    ``Method.transition`` gives now: once ``Method.next_shapes_settled``
    says so, that state has the shapes the phase change will give. At the
    phase change the step is lowered from the real state and the compiled
    program used only if the two lowerings are the same text; otherwise
    (or if the compile failed) the phase compiles as it would have. Nothing
    the run computes depends on it."""

    def __init__(self, phase: str, at_step: int, batch):
        self.phase, self.at_step = phase, at_step
        self.batch = batch  # a batch of the run: its shapes
        self.seconds: float | None = None
        self.error: str | None = None
        self.program: tuple[Any, Any] | None = None  # (_program_key, compiled)
        self.thread: threading.Thread | None = None

    @classmethod
    def start(
        cls, ctx, method, state, frozen, batch, rng, next_phase: str
    ) -> _Ahead | None:
        config = ctx.config
        if not (
            compile_ahead_on(config)
            and step_jit_mode(config) == "step"
            and jax.process_count() == 1  # no second program beside collectives
        ):
            return None
        ahead = cls(next_phase, int(state.step), batch)
        # Host copies now: the next step donates these buffers.
        trainable, frozen = jax.device_get((state.trainable, frozen))

        def work():
            start = time.time()
            try:
                tr, fr = method.transition(ctx, trainable, frozen, next_phase)
                average = (
                    averaging.share(config) is not None
                    and next_phase == method.phases_of(config)[-1]
                )
                st, substeps = _phase_state(ctx, method, next_phase, tr, 0, average)
                st, fr = parallel.replicate((st, fr), ctx.mesh)
                lowered = compile_step(config, substeps).lower(st, fr, batch, rng)
                ahead.program = (_program_key(lowered), lowered.compile())
            except Exception as e:  # noqa: BLE001  (an optimisation only)
                ahead.error = f"{type(e).__name__}: {e}"
            ahead.seconds = time.time() - start

        # A daemon: a preempted run exits without waiting for the compile.
        ahead.thread = threading.Thread(target=work, name="compile-ahead", daemon=True)
        ahead.thread.start()
        return ahead

    def step_fn(self, step_fn, state, frozen, rng) -> tuple[Callable, dict]:
        """The phase's compiled step (the one compiled ahead if its lowering
        is this one) and what the metrics record of it."""
        waited = time.time()
        self.thread.join()
        record: dict[str, Any] = {
            "phase": self.phase,
            "compile_ahead/from_step": self.at_step,
            "compile_ahead/seconds": self.seconds,
            "compile_ahead/waited_s": time.time() - waited,
        }
        lowered = step_fn.lower(state, frozen, self.batch, rng)
        if self.program is not None and self.program[0] == _program_key(lowered):
            record["compile_ahead/used"] = 1
            return self.program[1], record
        record["compile_ahead/used"] = 0
        if self.error is not None:
            logging.warning(
                "Compiling the %s step ahead failed (%s); it compiles now.",
                self.phase,
                self.error,
            )
            record["compile_ahead/error"] = self.error
        return lowered.compile(), record


def _phase_state(
    ctx, method, phase: str, trainable, global_step: int, average: bool = False
):
    """A phase's fresh train state (new optimizer states) and its sub-steps;
    with ``average``, an empty running mean of the parameters beside them
    (averaging.py)."""
    substeps = common.schedule_substeps(
        method.substeps(ctx, phase, trainable),
        ctx.config.optim,
        method.phase_steps(ctx.config, phase),
    )
    opt_states = common.init_opt_states(substeps, trainable)
    if average:
        if averaging.KEY in opt_states:
            raise ValueError(f"a sub-step may not be named {averaging.KEY!r}")
        opt_states[averaging.KEY] = averaging.init(trainable)
    state = common.TrainState(
        step=jnp.asarray(global_step, jnp.int32),
        trainable=trainable,
        opt_states=opt_states,
    )
    return state, substeps


def compile_ahead_on(config) -> bool:
    """``config.train.compile_ahead``, checked: "on", "off" or "auto" (on
    where the steps run on an accelerator, whose host's cores are free for
    the compile; on a CPU backend the compile takes cores from the steps)."""
    value = _train_choice(
        config,
        "compile_ahead",
        "auto",
        COMPILE_AHEAD,
        "\"auto\": compile the next phase's step beside this phase's steps on "
        "accelerators only",
    )
    return value == "on" or (value == "auto" and jax.default_backend() != "cpu")


def _program_key(lowered) -> tuple[Any, str]:
    """What makes two lowerings the same program for the same arguments: the
    arguments' tree and the program text (shapes, shardings and donation
    included)."""
    return lowered.in_tree, hashlib.sha256(lowered.as_text().encode()).hexdigest()


def _stop_reason(config, global_step: int) -> str | None:
    """Why the loop stops after this step (it saves first), or None.

    A SIGTERM is seen at once in a one-process run; processes of a
    multi-process run agree on it at logging steps, so that all stop after
    the same step.
    """
    if config.train.stop_at_step and global_step >= config.train.stop_at_step:
        return "config.train.stop_at_step"
    signal_name = workdir_lib.stop_requested()
    if jax.process_count() > 1:
        if global_step % config.train.log_every:
            return None
        if workdir_lib.agree_to_stop(signal_name is not None):
            return f"{signal_name or 'SIGTERM'} received"
        return None
    return f"{signal_name} received" if signal_name else None


def eval_options(config, name: str) -> dict[str, Any] | None:
    """``config.eval.<name>`` (an optional step of the evaluation with an
    ``enabled`` switch: ``token_merge``, ``strength``, ``task_only`` or
    ``discriminant``) as the keyword arguments ``evaluate_run`` takes for it
    (None when off, or for a config without the section)."""
    section = config.eval.get(name)
    if section is None or not section.enabled:
        return None
    return {k: v for k, v in section.items() if k != "enabled"}


def _leakage(
    config, workdir: Path, results: dict, attributes, reps=None, parts=None
) -> dict[str, Any]:
    """Fresh probes of the exported run (``eval.composition.evaluate_run``;
    ``reps``: the representations the end-of-run table already encoded);
    adds the INLP baselines' accuracy rows to ``results["composition"]``."""
    from moddiffy_jax.eval import composition, probes

    probe_config = probes.ProbeConfig(
        seeds=tuple(config.eval.probe_seeds),
        max_epochs=config.eval.probe_epochs,
        max_dev=config.eval.get("probe_max_dev"),
        whiten=config.eval.get("probe_whiten", True),
        threads=config.eval.get("probe_threads", 2),
    )
    evaluation = composition.evaluate_run(
        workdir,
        probe_config=probe_config,
        inlp=config.eval.inlp,
        mlp=config.eval.get("probe_mlp", True),
        verify_inputs=False,  # checked when this run started
        known_reps=reps,
        known_parts=parts,
        token_merge=eval_options(config, "token_merge"),
        strength=eval_options(config, "strength"),
        task_only=eval_options(config, "task_only"),
        discriminant=eval_options(config, "discriminant"),
    )
    for label, row in evaluation["composition"].items():
        # INLP, task-only, discriminant and merge rows
        if label not in results["composition"]:
            results["composition"][label] = {
                k: row[k] for k in ("dev_task_acc", "test_task_acc")
            }
    return {
        "report_timings": evaluation.get("timings", {}),
        "leakage": {
            label: {a: row["leakage"][a] for a in attributes}
            for label, row in evaluation["composition"].items()
        },
        "floors": evaluation.get("floors", {}),
        "probe_whiten": probe_config.whiten,
        "probe_seeds": list(probe_config.seeds),
        "eval_report": str(workdir / "eval" / "report.md"),
    }


def swap_group_text(config, groups) -> dict[str, list[list[str]]]:
    """Each attribute's counterpart groups (config.method.swap_weight) as text."""
    from moddiffy_jax.models import text as text_lib

    tokenizer = text_lib.load_tokenizer_for(config.model)
    return {
        attr: [tokenizer.convert_ids_to_tokens([int(t) for t in g]) for g in gs]
        for attr, gs in groups.items()
    }


def _word_row_tokens(config, tokens) -> dict[str, list[str]]:
    """The tokens whose word rows each attribute's diff may change, as text."""
    from moddiffy_jax.methods import word_rows
    from moddiffy_jax.models import text as text_lib

    described = word_rows.describe(tokens, text_lib.load_tokenizer_for(config.model))
    for attr, words in described.items():
        logging.info("diff %s may change the word rows of: %s", attr, " ".join(words))
    return described


def guard_summary(debias: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """The task guard's settings and each diff's removal weight at the end
    (``exp(-backoff)``: 1 where the guard let the removal be, down to 0.01
    where the diff trailed the core's task accuracy past the slack)."""
    weights = {
        a: round(math.exp(-float(s["backoff"])), 4) for a, s in state["attrs"].items()
    }
    return {
        "slack": debias.task_guard_slack,
        "start_step": debias.task_guard_start,
        "release": debias.task_guard_release,
        "final_weight": weights,
    }
